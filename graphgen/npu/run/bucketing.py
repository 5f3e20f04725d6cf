"""Shape buckets for the NPU graphs and a stand-in loop that counts compilations per bucket.

Decode is padded to a batch-size bucket (T = B), prefill and splitfuse to a token-count bucket with a
fixed batch (``prefill_seqs + 1``: one padding sequence always absorbs the surplus tokens).  Block
tables always have ``max_blocks`` columns, saves ``save_rows`` rows.  So each bucket is one static set
of tensor shapes; the length lists vary freely as SymInt values (``compile_module(buckets=N)``).
Padding lives in a reserved block (``PAD_BLOCK``) no sequence owns.  CPU stand-in only: it counts Dynamo
/AOT graphs, which is what a GE compile or an aclgraph capture costs on an NPU; it measures nothing else.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

PAD_BLOCK = 0  # reserved: padding tokens write and read only this block


@dataclass(frozen=True)
class Buckets:
    """The shape buckets of one model (``Buckets.from_spec``: the spec's NpuTarget fields)."""

    decode_batch: tuple[int, ...] = (1, 2, 4, 8)
    prefill_tokens: tuple[int, ...] = (64, 128, 256, 512)
    prefill_seqs: int = 2          # real sequences per prefill/splitfuse step (the batch is this + 1)
    max_blocks: int = 4            # block-table columns = longest context / block_size
    save_rows: int = 8             # staging rows = blocks saved per step at most

    @classmethod
    def from_spec(cls, spec) -> "Buckets":
        """The buckets the spec's NPU target declares (docs/spec.md, NpuTarget)."""
        npu = spec.targets.npu
        if npu is None:
            raise ValueError(f"spec {spec.name} has no NPU target")
        bs = spec.kv_cache.block_size
        max_len = max_model_len(spec)
        decode, prefill = tuple(npu.decode_batch_buckets), tuple(npu.prefill_token_buckets)
        par = getattr(spec, "parallel", None)
        if par is not None and par.tp > 1 and (par.dp > 1 or par.sp):
            # the token collectives cut a call's tokens into tp equal shards (reduce_scatter_tensor /
            # all_gather_into_tensor): sequence parallel's around every norm, DP attention's MoE reduce-scatter
            # at tp > 1. So a call's tokens are a multiple of tp: only those buckets run (steps pad up to them)
            why = "sequence parallel" if par.sp else "DP attention"
            decode, prefill = (tuple(x for x in b if x % par.tp == 0) for b in (decode, prefill))
            if not decode or not prefill:
                raise ValueError(f"spec {spec.name}: {why} at tp {par.tp} runs only buckets that are "
                                 f"multiples of tp; targets.npu.decode_batch_buckets {npu.decode_batch_buckets} / "
                                 f"prefill_token_buckets {npu.prefill_token_buckets} leave none of one kind "
                                 f"(fix: add a multiple of {par.tp})")
        return cls(decode_batch=decode, prefill_tokens=prefill,
                   prefill_seqs=npu.prefill_seqs, max_blocks=-(-max_len // bs),
                   save_rows=npu.save_rows or max(1, npu.prefill_token_buckets[-1] // bs))

    def count(self, phase: str) -> int:
        return len(self.decode_batch) if phase == "decode" else len(self.prefill_tokens)

    def padding(self, phase: str, n_seqs: int, n_tokens: int, pad_block: int = PAD_BLOCK, *, at_least: int = 0):
        """The smallest bucket of ``phase`` that holds the step (and has at least ``at_least`` tokens: DP ranks
        run each call at one agreed bucket, `graphgen.npu.run.data_parallel`)."""
        from .inputs import StepPadding

        if phase == "decode":
            b = next((x for x in self.decode_batch if x >= max(n_seqs, at_least)), None)
            if b is None:
                raise ValueError(f"decode batch {n_seqs} exceeds the largest bucket {self.decode_batch[-1]}")
            return StepPadding(b, b, self.max_blocks, pad_block, self.save_rows)
        if n_seqs > self.prefill_seqs:
            raise ValueError(f"{n_seqs} prefill sequences > prefill_seqs {self.prefill_seqs}")
        batch = self.prefill_seqs + 1
        need = n_tokens + batch - n_seqs
        t = next((x for x in self.prefill_tokens if x >= max(need, at_least)), None)
        if t is None:
            raise ValueError(f"{n_tokens} prefill tokens exceed the largest bucket {self.prefill_tokens[-1]}")
        return StepPadding(batch, t, self.max_blocks, pad_block, self.save_rows)


def max_model_len(spec) -> int:
    """``targets.npu.max_model_len``, or the model's max_position_embeddings capped at 4096."""
    npu = spec.targets.npu
    if npu is not None and npu.max_model_len is not None:
        return npu.max_model_len
    return min(4096, getattr(spec.dims, "max_position_embeddings", 4096))


def bucketed_step(module, spec, buckets: Buckets, seqs: Sequence[tuple[int, int]], seed: int = 0, pad=None,
                  device=None):
    """Step inputs for sequences ``(history, new_tokens)``, blocks 1.. in order, padded to their bucket
    (or to ``pad``: a mixed batch's cell, `mixed_grid.MixedGrid.padding`), on ``device`` (default CPU)."""
    import torch

    from .inputs import npu_step_inputs

    g = torch.Generator().manual_seed(seed)
    bs = spec.kv_cache.block_size
    phase = module.META["phase"]
    ids, pos, slots, tables, seq_lens, qlens, logit_idx = [], [], [], [], [], [], []
    next_block = PAD_BLOCK + 1
    saves, loads = [], []
    for hist, q in seqs:
        n = (hist + q + bs - 1) // bs
        table = list(range(next_block, next_block + n))
        next_block += n
        pos += list(range(hist, hist + q))
        slots += [table[p // bs] * bs + p % bs for p in range(hist, hist + q)]
        ids += torch.randint(0, spec.dims.vocab_size, (q,), generator=g).tolist()
        tables.append(table)
        seq_lens.append(hist + q)
        qlens.append(q)
        logit_idx.append(len(ids) - 1)
        # as the scheduler saves: the blocks this step fills entirely (<= q // bs per sequence)
        saves += table[-(-hist // bs):(hist + q) // bs]
        loads += table[:hist // bs]  # as the scheduler loads: the full history blocks
    saves = saves[:buckets.save_rows] if module.META.get("saves") else None
    loads = loads[:buckets.save_rows] if module.META.get("history") else None
    return npu_step_inputs(input_ids=ids, positions=pos, slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
                           query_lens=qlens, logits_indices=logit_idx, block_size=bs, save_block_ids=saves,
                           load_block_ids=loads, decode=phase == "decode", device=device,
                           pad=pad or buckets.padding(phase, len(seqs), len(ids))), next_block


def mixed_steps(phase: str, history: bool, buckets: Buckets, block_size: int, steps: int, seed: int = 0):
    """A realistic mix: decode with growing lengths and a varying batch; prefills of varying lengths;
    splitfuse chunks over a varying history.  Every step fits ``buckets``."""
    rnd = random.Random(seed)
    cap = buckets.max_blocks * block_size
    if phase == "decode":
        hist = [rnd.randrange(1, cap // 2) for _ in range(buckets.decode_batch[-1])]
        out = []
        for _ in range(steps):
            b = rnd.randint(1, buckets.decode_batch[-1])
            hist = [h + 1 if h + 1 < cap else 1 for h in hist]
            out.append([(h, 1) for h in hist[:b]])
        return out
    out = []
    top = buckets.prefill_tokens[-1] - buckets.prefill_seqs - 1
    for _ in range(steps):
        n = rnd.randint(1, buckets.prefill_seqs)
        seqs = []
        for _ in range(n):
            q = rnd.randint(1, max(1, min(cap // 2, top // n)))
            h = rnd.randrange(0, cap - q) if history else 0
            seqs.append((h, q))
        out.append(seqs)
    return out


def bucket_steps(phase: str, history: bool, buckets: Buckets, block_size: int) -> list:
    """One deterministic step per bucket, in bucket order: decode with every batch size; prefill and
    splitfuse with ``prefill_seqs`` sequences filling each token bucket (``tokens - 1`` real tokens:
    the one padding sequence takes one token), splitfuse with a history crossing a block boundary.
    So ``--ops-json`` sees every bucket's graph whatever the random mix visited."""
    cap = buckets.max_blocks * block_size
    if phase == "decode":
        return [[(min(cap - 1, block_size + 1 + i), 1) for i in range(b)] for b in buckets.decode_batch]
    out, prev = [], 0
    n = buckets.prefill_seqs
    for t in buckets.prefill_tokens:
        real = t - 1
        qs = [real // n + (1 if i < real % n else 0) for i in range(n)]
        hist = min(block_size + 1, cap - max(qs)) if history else 0
        if hist < 0 or real + 1 <= prev:
            raise ValueError(f"bucket {t}: {n} sequences cannot hold {real} tokens within {cap} positions")
        out.append([(hist if history else 0, q) for q in qs])
        prev = t
    return out


def stable_seed(*parts: str) -> int:
    """A seed that is the same in every process: ``hash()`` of a str is salted per process
    (PYTHONHASHSEED), which made ``--steps`` visit different buckets from run to run."""
    return zlib.crc32("\0".join(parts).encode()) % 1000


@dataclass
class LoopResult:
    variant: str
    mode: str
    steps: int
    compilations: int
    buckets: int
    graphs: list = field(default_factory=list)  # [{"bucket": {"batch", "tokens"}, "captured": CapturedGraph}]
    mixed: int = 0  # mixed-batch steps run after the plain ones (history prefill variants; mixed_grid.py)
    tiling_sink: bool = False  # compiled with tiling_schedule_optimize (the module's TILING_SINK): a static graph

    @property
    def ok(self) -> bool:
        return self.compilations <= self.buckets


def run_standin_loop(spec, variants: Optional[Sequence[str]] = None, modes: Optional[Sequence[str]] = None,
                     steps: int = 24, buckets: Optional[Buckets] = None, *, check_limits: bool = True,
                     sources: Optional[dict] = None, every_bucket: bool = False,
                     mixed_batches: int = 0, device: str = "meta") -> list[LoopResult]:
    """Run ``steps`` mixed steps per (variant, mode) through the CPU stand-in; count compiled graphs.
    ``mixed_batches``: a history prefill variant (the one mixed batches run on) then also runs that many
    mixed batches (decode rows and chunks, `mixed_grid.MixedGrid`); its buckets are then the plain
    ones plus the grid's cells.

    Each bucket's first captured post-AOT graph is kept in ``LoopResult.graphs`` (the GE converter
    check's input); ``every_bucket``: also run one deterministic step per bucket (``bucket_steps``)
    after the mix, so every bucket has one.

    ``device``: where the weights, caches and step inputs live.  ``"meta"`` (the default): shapes only --
    Dynamo, AOT and the captured graphs are those of a CPU run (the same static shapes per bucket, the same
    SymInt lengths), and every step runs the graph on meta tensors, so the stand-in's meta kernels check each
    step's actual lengths against the documented limits and their contracts; no value is computed (a CPU run
    of tiny_deepseek_v3_npu's splitfuse spent 2/3 of its time in a bf16 matmul of the padded history rows,
    whose values nothing here reads).  ``"cpu"``: the same loop computing values with the CPU kernels.

    ``sources``: {(variant, mode): module source} (default: generated in memory from the spec).
    ``buckets``: default ``Buckets.from_spec(spec)``.  Weights and the RoPE table are cast to the KV
    dtype (the NPU kernels take one dtype)."""
    import torch

    from ..standin import fakes as standin
    from .inputs import random_weights

    buckets = buckets or Buckets.from_spec(spec)
    dtype = getattr(torch, spec.kv_cache.dtype)
    weights = {k: t.to(device=device, dtype=dtype) for k, t in random_weights(spec).items()}  # one draw for all
    loop = _StandinLoop(spec, buckets, steps, check_limits, every_bucket, mixed_batches, device, weights)
    if not standin.install():
        raise RuntimeError("torch_npu is installed: run on the NPU, not through the CPU stand-in")
    try:
        return [loop.run(variant, mode, (sources or {}).get((variant, mode)))
                for variant in list(variants or spec.variants) for mode in list(modes or spec.targets.npu.compile_modes)]
    finally:
        standin.uninstall()


@dataclass(frozen=True)
class _StandinLoop:
    """`run_standin_loop`'s settings and its one draw of weights (on ``device``, in the KV dtype); ``run`` is
    one (variant, mode) of it, with the stand-in installed."""

    spec: object
    buckets: Buckets
    steps: int
    check_limits: bool
    every_bucket: bool
    mixed_batches: int
    device: str
    weights: dict

    def run(self, variant: str, mode: str, src: Optional[str]) -> LoopResult:
        """Compile the variant's module in ``mode``, run its step plan (the mix, then the bucket steps and the
        mixed batches asked for) and count the graphs it compiled; each bucket's first graph is kept."""
        import torch

        from ..standin import fakes as standin
        from .mixed_grid import MixedGrid, MixedStep

        spec, buckets = self.spec, self.buckets
        grid = MixedGrid.from_buckets(buckets)
        v = spec.variants[variant]
        mixes = self.mixed_batches > 0 and v.phase == "prefill" and bool(v.history)
        n_buckets = buckets.count(v.phase) + (grid.count() if mixes else 0)
        mod, target, backend, (W, kv, staging, loads) = self._module(variant, mode, src, n_buckets)
        plan = mixed_steps(v.phase, bool(v.history), buckets, spec.kv_cache.block_size, self.steps,
                           seed=stable_seed(variant, mode))
        n_mixed = len(plan)
        if self.every_bucket:
            plan = plan + bucket_steps(v.phase, bool(v.history), buckets, spec.kv_cache.block_size)
        batches = grid.steps(self.mixed_batches, spec.kv_cache.block_size, seed=stable_seed(variant, mode, "mixed")) \
            if mixes else []
        by_bucket: dict = {}
        with torch.no_grad(), standin.enforce_limits(self.check_limits):
            for i, step in enumerate(plan + batches):
                seqs = getattr(step, "seqs", step)  # a plain step is its rows; a MixedStep has .seqs
                pad = grid.padding(step, PAD_BLOCK) if isinstance(step, MixedStep) else \
                    buckets.padding(v.phase, len(seqs), sum(q for _, q in seqs))
                b, _ = bucketed_step(mod, spec, buckets, seqs, seed=i, pad=pad, device=self.device)
                before = len(backend.graphs)
                mod.load(b, kv, loads)
                target.forward(W, b, kv, staging)
                if len(backend.graphs) > before:
                    by_bucket.setdefault((pad.batch, pad.tokens), backend.graphs[before])
        return LoopResult(variant, mode, n_mixed, len(backend.graphs), n_buckets,
                          [{"bucket": {"batch": k[0], "tokens": k[1]}, "captured": by_bucket[k]}
                           for k in sorted(by_bucket)], tiling_sink=bool(getattr(mod, "TILING_SINK", False)),
                          mixed=len(batches))

    def _module(self, variant: str, mode: str, src: Optional[str], n_buckets: int):
        """The variant's module compiled through the stand-in for ``n_buckets`` shapes, and its buffers on the
        loop's device: the load-time weights and the RoPE table, the KV cache, staging and load staging."""
        import torch

        from ..standin import fakes as standin
        from .compile import compile_module, load_module
        from .inputs import ROPE_CACHE_KEY, kv_buffers, load_buffers, rope_cache
        from .weights import load_time_weights

        spec, buckets, device = self.spec, self.buckets, self.device
        if src is None:
            from graphgen.lower.compile import compile_variant

            src = compile_variant(spec, variant, "npu", mode=mode)
        torch._dynamo.reset()
        with standin.fresh_tags():
            mod = load_module(Path(f"<{spec.name}>/npu/{mode}/{variant}.py"), src)
            target, backend = compile_module(mod, mode, use_standin=True, buckets=n_buckets)
        dtype = getattr(torch, spec.kv_cache.dtype)
        W = load_time_weights(dict(self.weights), [mod])
        W[ROPE_CACHE_KEY] = rope_cache(mod.ROPE, buckets.max_blocks * spec.kv_cache.block_size, dtype=dtype,
                                       device=device)
        nb = 1 + (buckets.prefill_seqs + buckets.decode_batch[-1]) * buckets.max_blocks
        kv, staging = kv_buffers(mod, spec.dims.num_hidden_layers, nb,
                                 staging_rows=buckets.save_rows if mod.META["saves"] else 0, device=device)
        loads = load_buffers(mod, spec.dims.num_hidden_layers, buckets.save_rows, device=device)
        return mod, target, backend, (W, kv, staging, loads)


def report(results: Sequence[LoopResult], out=print) -> int:
    """Print one line per (variant, mode); the exit status for ``graphgen compile --standin --steps N``:
    0, or 1 when any variant compiled more graphs than it has buckets."""
    for r in results:
        out(f"{r.variant:24} {r.mode:16} steps={r.steps:<4} {f'mixed={r.mixed:<4} ' if r.mixed else ''}"
            f"graphs compiled={r.compilations:<3} "
            f"buckets={r.buckets:<3} {'ok' if r.ok else 'MORE GRAPHS THAN BUCKETS'}")
    out("(CPU stand-in: Dynamo/AOT graph count only; nothing ran on an NPU)")
    return 0 if all(r.ok for r in results) else 1
