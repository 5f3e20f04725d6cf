"""The NPU model runner: the step driver for the NPU target, on the runtime's scheduler and KV connector.

`NpuModelRunner` has the CPU runner's interface (``submit``, ``collect`` -> `StepOutput`, ``settle``,
``close``, `RunnerSaves`): `EngineCore` drives it unchanged. It alone drives the `KVConnector`'s worker
side — every save of a plan: the graph calls' (`CommitPath.save_call`), those from the cache (decode-time
saves, write-backs: `CommitPath.save_filled`) — and adapts at the runner boundary:

* **bucketing**: a step plan's rows become `NpuStepInputs` padded to the spec's buckets
  (`Buckets.from_spec`, `StepPadding`); a prefill with more sequences than ``prefill_seqs``
  (the scheduler batches by tokens, not sequences) runs as several graph calls, one per chunk; a
  mixed batch (decode rows first, then at most ``prefill_seqs`` chunks) runs as ONE graph call padded
  to its cell of the static mixed grid (`mixed_grid.MixedGrid`: tokens x decode rows x tokens per
  row), so a varying mix compiles at most one graph per cell, never one per step;
* **the compile cache**: one compiled module per variant (in one compile mode), compiled lazily with
  ``compile_module(..., buckets=N)``: one graph per bucket, never per step;
* **the KV cache in the NPU layout**: the connector's `PagedKVCache` (CPU layout ``[NB, BS, Hkv, D]``,
  what the pool (de)serialises) is handed to the NPU module as views in its layout (``KV_SHAPES``,
  ``[NB, BS, Hkv*D]``): the same memory, so pool loads land where the kernels read;
* **commits off the critical path** (`graphgen.npu.run.staging.CommitPath`): a saving graph call writes
  into a slot of a `StagingRing` (persistent, never one whose commit is in flight); after the call a save
  event is recorded, a dedicated copy stream waits on it and issues one non-blocking D2H per (layer,
  component) into the slot's pinned host rows; the connector puts from those rows after the copy event
  (inline for sync, host stream for async) and then frees the slot. ``submit`` returns once the copies
  are issued. On the stand-in the copy stream is modelled (`graphgen.npu.standin.streams`), the host
  rows pageable.

`graphgen.npu.run.engine.npu_engine` builds the runtime `Engine` with this runner (the runtime's one assembly,
`build_engine`) and registers itself as ``open_engine(..., target="npu")``. ``standin=True`` runs everything on CPU through
graphgen's torchair stand-in (tests; never an NPU result); without it, torch_npu must import
(`NpuUnavailable` otherwise). The real-device parts (``device="npu"``, the NPU event after the forward)
have never run on an NPU.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ...runtime import current_progress
from ...runtime.core.kvcache import slot_mapping
from ...runtime.core.weights import cast_weights
from ...runtime.engine import LoadedBlocks, RunnerSaves, StepFuture, StepOutput, StepPlan
from .bucketing import Buckets, max_model_len
from .groups import bind_process_groups, process_group_names
from .inputs import UniformPadding
from .lora import acquire_lora, add_lora_inputs, release_lora
from .mixed_grid import MixedGrid, MixedStep
from .staging import CommitPath, DeviceBinding, NpuStreams, StagingRing
from .weights import load_time_weights

__all__ = ["NpuModelRunner"]


class NpuModelRunner(RunnerSaves):
    """Runs the generated NPU modules of ``spec`` (one compile mode) on the connector's ``cache``.

    ``weights``: checkpoint-name tensors (cast to ``targets.npu.dtype`` here, the family's ``fp32_suffixes``
    keys kept float32). ``pad_block``: a cache block no sequence owns (`npu_engine` reserves it from the
    allocator); padding tokens write and read only it. ``sources``: {variant: module source} (default: in memory)."""

    def __init__(self, spec, weights, cache, connector=None, *, pad_block: int, mode: Optional[str] = None,
                 standin: bool = False, sources: Optional[dict] = None, check_limits: bool = True,
                 cache_dir=None, groups=None, num_speculative_tokens: int = 0):
        from .compile import _import_torchair

        npu = spec.targets.npu
        if npu is None:
            raise ValueError(f"spec {spec.name} has no NPU target (targets.npu)")
        self.mode = mode or npu.compile_modes[0]
        if self.mode not in npu.compile_modes:
            raise ValueError(f"compile mode {self.mode} is not generated for {spec.name}: {list(npu.compile_modes)}")
        self.spec, self.cache, self.connector, self.pad_block = spec, cache, connector, pad_block
        self.observer = None  # the CPU runner's hook (save copies are not reported from the NPU runner yet)
        self.standin, self.check_limits = standin, check_limits
        # a DP rank's agreed padding of each graph call (data_parallel.NpuDPForward plugs it in), or None
        self.call_padding: Optional[Callable] = None
        # a CP rank's share of each prefill step (the runtime's ContextSplit plugs in: context_parallel.py), or None
        self.split = None
        self.buckets = Buckets.from_spec(spec)
        # speculative decoding (docs/mtp.md): verify rows of K + 1 tokens, in the decode module (K + 1 tokens a row)
        # and in the mixed grid's cells (tokens_per_row 1 and K + 1)
        self.k = num_speculative_tokens
        self.grid = MixedGrid.from_buckets(self.buckets, (1, self.k + 1) if self.k else (1,))  # mixed cells
        self.block_size = spec.kv_cache.block_size
        self._standin_mod = None
        if standin:
            from ..standin import fakes as _standin

            if not _standin.install():
                raise RuntimeError("torch_npu is installed: run on the NPU, not through the CPU stand-in")
            self._standin_mod = _standin
        else:
            _import_torchair(False)  # NpuUnavailable (one sentence) without torch_npu/torchair
        self.device = torch.device("cpu") if standin else torch.device("npu")
        # every thread touching NPU objects sets the device first (this one, the connector's commit thread)
        self.binding = DeviceBinding(0, lambda i: None) if standin else \
            DeviceBinding(torch.npu.current_device(), torch.npu.set_device)  # type: ignore[attr-defined]
        self.dtype = getattr(torch, npu.dtype)
        self.lora_slots = None  # Multi-LoRA: a LoraSlots in this dtype on the device (build_engine makes it)
        # a rank's process groups (graphgen.runtime RankGroups: its modules' HCCL names, the compile cache's rank)
        self.groups = groups
        self.cache_dir = cache_dir  # the on-disk compile cache (CacheKey)
        self.rank, self.world = (groups.coords.rank, groups.layout.world) if groups is not None else (0, 1)
        self.source_hashes: dict[str, str] = {}  # variant -> its module source's hash (the cache key's)
        self.modules = self._load(sources or {})
        self.seen: set = set()  # (variant, bucket entry) of every graph compiled (or loaded) so far
        self._compiled: dict[str, object] = {}  # variant -> compiled target
        self.backends: dict[str, object] = {}  # variant -> its compile backend (the stand-in's counts graphs)
        self.graph_calls: list[tuple[str, int, int]] = []  # (variant, batch, tokens) of every graph call
        rope = next(iter(self.modules.values())).ROPE
        from .inputs import ROPE_CACHE_KEY, rope_cache

        # fp32 keys stay fp32; merged q/k/v, gate/up and pre-transposed experts built once here
        self.W = load_time_weights(cast_weights(weights, spec.family, self.dtype, self.device), self.modules.values())
        self.W[ROPE_CACHE_KEY] = rope_cache(rope, max_model_len(spec), device=self.device, dtype=self.dtype)
        mod = next(iter(self.modules.values()))
        # the connector's cache in the NPU modules' layout: views, same memory
        self.kv = [tuple(t.view(t.shape[0], *s) for t, s in zip(layer, mod.KV_SHAPES)) for layer in cache]
        self.commits = None
        if any(m.META["saves"] for m in self.modules.values()):
            from .inputs import kv_buffers

            if standin:  # the copy stream and events modelled on CPU (a host thread); host rows pageable
                from ..standin.streams import ModelledStreams

                streams = ModelledStreams()
            else:
                streams = NpuStreams()
            # every cache layer: the MTP draft's save copies the MTP layers' too
            bufs = [kv_buffers(mod, spec.kv_layers, 0, staging_rows=self.buckets.save_rows,
                               device=self.device)[1] for _ in range(npu.staging_buffers)]
            self.commits = CommitPath(StagingRing(CommitPath.slots(bufs, streams)), streams, binding=self.binding)

    def _load(self, sources: dict) -> dict:
        import contextlib

        from ...lower.compile import compile_variant, mode_dir
        from .compile import load_module, source_hash

        tags = self._standin_mod.fresh_tags() if self.standin else contextlib.nullcontext()
        mods = {}
        with tags:  # reduce-overhead modules create tagged events at import (once per process)
            for v in self.spec.variants:
                src = sources.get(v) or compile_variant(self.spec, v, "npu", mode=self.mode)
                self.source_hashes[v] = source_hash(src)
                mods[v] = load_module(Path(f"<{self.spec.name}>/npu/{mode_dir(self.mode)}/{v}.py"), src)
                if self.groups is not None:  # the HCCL groups its collectives name, from the layout's table
                    bind_process_groups(mods[v], process_group_names(self.groups))
        return mods

    # ---- the runner interface (as CpuModelRunner) ------------------------------------------------
    def saves(self, variant: str) -> bool:
        return bool(self.modules[variant].META["saves"])

    def compiled(self, variant: str):
        """The compiled forward of ``variant`` (compiled on first use; one graph per bucket; with a
        ``cache_dir``, each bucket's graph is an entry of the on-disk compile cache under its `CacheKey`)."""
        if variant not in self._compiled:
            from .compile import CacheKey, compile_module, layout_name

            mod = self.modules[variant]
            cells = self.grid.count() if mod.META.get("history") and mod.META["phase"] == "prefill" else 0
            if mod.META["phase"] == "decode" and self.k:  # decode rows of 1 and of K + 1 tokens
                cells = self.buckets.count("decode")
            cache = None if self.cache_dir is None else CacheKey(
                self.spec.name, self.mode, variant, self.source_hashes[variant], self.rank, self.world,
                layout_name(getattr(self.spec, "parallel", None))
            ).directory(self.cache_dir)
            target, backend = compile_module(mod, self.mode, cache, use_standin=self.standin,
                                             buckets=self.buckets.count(mod.META["phase"]) + cells)
            self._compiled[variant], self.backends[variant] = target, backend
        return self._compiled[variant]

    def cache_uses(self, variant: str) -> list:
        """One `compile.EntryUse` per bucket of ``variant`` called so far (torchair entry and GE model found
        or not), in order; none without a compile cache."""
        fwd = getattr(self._compiled.get(variant), "forward", None)
        return list(getattr(getattr(fwd, "compiled", None), "uses", ()))

    def warm_up(self, out=None) -> int:
        """Compile (or load from the compile cache) every graph now, not on first use mid-serving:
        `graphgen.npu.run.warmup.warm_up` (largest first, one line per graph on ``out``, progress
        reported). Returns the number of graphs."""
        from .warmup import warm_up

        return warm_up(self, out)

    def submit(self, plan: StepPlan, *, background: bool = False) -> StepFuture:
        """Run ``plan`` (graph calls queued on the device: ``background`` changes nothing), each saving
        call's copies issued and its save handed off (`CommitPath.save_call`); no rows: nothing runs."""
        self.binding.ensure()
        fut = StepFuture(plan, None)
        if plan.rows:
            slot_of, held = acquire_lora(self.lora_slots, plan)
            fut.lora_slots = held
            try:
                t0 = time.perf_counter()
                fut.handles = self._run(plan, slot_of)
                fut.span = (t0, time.perf_counter())
            except BaseException:
                release_lora(self.lora_slots, fut)
                raise
        return fut

    def collect(self, fut: StepFuture) -> StepOutput:
        """The `StepOutput`: row logits ``[1, vocab]`` (``[0, vocab]``: a chunk that samples nothing); the
        plan's saves from the cache are made now, through the ring (`save_filled`: audit 3 N8)."""
        self.binding.ensure()
        plan = fut.plan
        release_lora(self.lora_slots, fut)  # its graph calls are queued before a slot can be reloaded (one queue)
        pinned = list(plan.save_block_ids) if plan.rows and plan.saves else []
        saves = self.save_report(pinned + self.save_from_cache(*plan.cache_saves()))
        if not plan.rows:
            return StepOutput(saves=saves)
        logits, hidden = fut.handles
        logits = tuple(torch.split(logits, [len(row.logits_positions) for row in plan.rows]))
        if hidden is not None:
            hidden = tuple(torch.split(hidden, [row.num_tokens for row in plan.rows]))
        return StepOutput(logits, hidden, saves, spans=(("forward", *fut.span),))

    def save_filled(self, block_ids, keys) -> None:  # through the ring, as a graph call's save
        if self.commits is None:
            return super().save_filled(block_ids, keys)
        self.commits.save_filled(self.connector, block_ids, keys, self.kv)

    def _run(self, plan: StepPlan, lora_slot_of: Optional[dict] = None):
        variant = plan.variant
        mod = self.modules[variant]
        saves = bool(mod.META["saves"])
        if plan.saves != saves:
            raise ValueError(f"{variant}: a plan saves exactly when its module saves "
                             f"(module saves={saves}, plan saves={plan.saves})")
        for row in plan.rows:  # a chunk before a prompt's last asks for none; a verify row (decode) for each token
            every = row.decode and tuple(row.logits_positions) == tuple(range(row.num_tokens))
            if tuple(row.logits_positions) not in ((), (row.num_tokens - 1,)) and not every:
                raise ValueError("the NPU modules return the last position's logits of each sequence (a verify row's: "
                                 f"each position's) only; a row asked for positions {row.logits_positions}")
        phase = mod.META["phase"]
        if self.split is not None and phase != "decode":  # a CP rank: its head-tail pieces (decode: whole, replicated)
            from .context_parallel import run_cp_step

            return run_cp_step(self, plan, mod, phase, saves, _sequence)
        seqs = [_sequence(row, self.block_size) for row in plan.rows]
        if plan.prev_hidden is not None:  # the MTP graph's input: each row's previous hidden states, in row order
            for s, h in zip(seqs, torch.split(plan.prev_hidden, [row.num_tokens for row in plan.rows])):
                s["hidden"] = h
        for i, sq in enumerate(seqs):
            sq["lora"] = (lora_slot_of or {}).get(i, 0)
        history = bool(mod.META.get("history"))
        cell = self._mixed_cell(plan, seqs) if history and self.call_padding is None else None
        chunks = [seqs] if cell is not None else self._chunks(phase, seqs)
        target = self.compiled(variant)
        logits, hidden, offset = [], [], 0
        for chunk in chunks:
            if self.call_padding is not None:  # every DP rank runs this call at one bucket (data_parallel.py)
                per_row = max(len(s["ids"]) for s in chunk) if phase == "decode" else 1  # verify rows: K' + 1
                cell = self.call_padding(phase, len(chunk), sum(len(s["ids"]) for s in chunk), per_row)
            b, n_save = self._step_inputs(mod, chunk, pad=cell)
            self.graph_calls.append((variant, b.block_tables.shape[0], b.input_ids.shape[0]))
            self._first_use(variant, b)

            def graph(staging, b=b, chunk=chunk):
                with torch.no_grad(), self._limits():
                    if history:  # eager, before the graph (see the generated module's load())
                        mod.load(b, self.kv, self._chunk_loads(mod, chunk))
                    return target.forward(self.W, b, self.kv, staging)

            if saves:  # this call's blocks are plan.save_block_ids[offset:offset + n_save], in row order
                out = self.commits.save_call(self.connector, plan.save_block_ids[offset:offset + n_save],
                                             plan.save_keys[offset:offset + n_save], graph)
                offset += n_save
            else:
                out = graph(())
            lg, h = out if isinstance(out, tuple) else (out, None)  # a spec with MTP: (logits, hidden [T, H])
            logits.append(lg.index_select(0, b.real_logits).float())
            if h is not None:
                hidden.append(h[:sum(len(s["ids"]) for s in chunk)].float())
        current_progress().stepping()  # a graph compiled on first use is done: the step deadline again
        return torch.cat(logits), (torch.cat(hidden) if hidden else None)

    def close(self) -> None:
        try:
            if self.commits is not None:
                self.commits.close()
                self.commits = None
        finally:
            self.close_saves()

    # ---- internals --------------------------------------------------------------------------
    def _first_use(self, variant: str, b) -> None:
        """A graph compiled on first use (no warm-up, or a shape warm-up did not cover) can take
        minutes: the process reports the ``warmup`` phase, whose deadline then holds instead of the step
        deadline (`graphgen.runtime.progress`), until the step's next graph or its end."""
        from .compile import bucket_entry

        key = (variant, bucket_entry(b))
        report = current_progress()
        if key in self.seen:
            report.stepping()
            return
        self.seen.add(key)
        report.phase("warmup")
        report.advance(1, note=variant)

    def _limits(self):
        import contextlib

        return self._standin_mod.enforce_limits(self.check_limits) if self.standin else contextlib.nullcontext()

    def _mixed_cell(self, plan: StepPlan, seqs: list):
        """The mixed grid's padding for a mixed plan that fits one cell (decode rows first, then 1 to
        ``prefill_seqs`` chunks, within the largest token and decode-row buckets), else None: such a
        plan runs through the prefill buckets in several calls instead."""
        if not plan.mixed:
            return None
        kinds = [row.decode for row in plan.rows]
        n_d = sum(kinds)
        if kinds != [True] * n_d + [False] * (len(kinds) - n_d):
            return None
        rows = [(s["seq_len"] - len(s["ids"]), len(s["ids"])) for s in seqs]
        try:
            return self.grid.padding(MixedStep(tuple(rows[:n_d]), tuple(rows[n_d:])), self.pad_block)
        except ValueError:
            return None

    def _chunks(self, phase: str, seqs: list) -> list[list]:
        bk = self.buckets
        if phase == "decode":
            if len(seqs) > bk.decode_batch[-1]:
                raise ValueError(f"decode batch {len(seqs)} > the largest decode bucket {bk.decode_batch[-1]}")
            return [seqs]
        chunks, cur, tokens = [], [], 0
        for s in seqs:  # the padded batch is prefill_seqs + 1: each padding sequence takes >= 1 token
            q = len(s["ids"])
            if cur and (len(cur) == bk.prefill_seqs or tokens + q + bk.prefill_seqs + 1 - (len(cur) + 1)
                        > bk.prefill_tokens[-1]):
                chunks.append(cur)
                cur, tokens = [], 0
            cur.append(s)
            tokens += q
        return chunks + [cur]

    def _chunk_loads(self, mod, chunk: list) -> list:
        """The loaded blocks of the chunk's sequences (their plan rows carry them), in the module's
        layout, padded with zero rows to the bucket's ``save_rows`` (padding rows scatter into the
        pad block). A sequence's `LoadedBlocks` run is copied as one slice per layer and component
        (a 2048-token hit: 12 copies, not 127 x 12); other loaded blocks one by one."""
        runs = [s["loaded"] for s in chunk if len(s["loaded"])]
        views = [run.layers() if isinstance(run, LoadedBlocks) else None for run in runs]
        out = []
        for layer in range(self.spec.dims.num_hidden_layers):
            comps = []
            for i, shape in enumerate(mod.KV_SHAPES):
                t = torch.zeros(self.buckets.save_rows, *shape, dtype=self.dtype, device=self.device)
                j = 0
                for run, view in zip(runs, views):
                    n = len(run)
                    if view is not None:   # rows of one staging: [n, *block shape], strided by a block
                        t[j:j + n].view(n, -1).copy_(view[layer][i].flatten(1))
                    else:
                        for k, blk in enumerate(run):
                            t[j + k].copy_(blk[layer][i].view(*shape))
                    j += n
                comps.append(t)
            out.append(tuple(comps))
        return out

    def _step_inputs(self, mod, chunk: list, pad=None, rows: Optional[list] = None):
        """The chunk's inputs for module ``mod``, padded to ``pad`` (a mixed batch's cell) or to its bucket;
        the gather rows only when the module reads them (``STEP_READS``: audit 3 N9). ``rows``: the sequences
        whose blocks the call saves and loads (default the chunk's; a CP rank's pieces: their whole rows)."""
        from .inputs import npu_step_inputs

        phase, saves, history = mod.META["phase"], bool(mod.META["saves"]), bool(mod.META.get("history"))
        rows = chunk if rows is None else rows
        per_row = max(len(s["ids"]) for s in chunk)
        if phase == "decode" and per_row > 1:  # verify rows: every row K + 1 tokens (the decode module's S = T / B)
            chunk = [_widened(s, per_row, self.pad_block, self.block_size) for s in chunk]
        ids = [t for s in chunk for t in s["ids"]]
        qlens = [len(s["ids"]) for s in chunk]
        save = [b for s in rows for b in s["save"]] if saves else None
        # the logits rows: each row's last token, a verify row's every real token; the decode module's every token
        starts = [sum(qlens[:i]) for i in range(len(chunk))]
        real = [st + j for s, st in zip(chunk, starts) for j in s.get("logits", (len(s["ids"]) - 1,))]
        idx = list(range(len(ids))) if phase == "decode" and per_row > 1 else real
        if pad is None:
            pad = self.buckets.padding(phase, len(chunk), len(ids), self.pad_block)
            if phase == "decode" and per_row > 1:
                pad = UniformPadding(pad.batch, pad.batch * per_row, pad.max_blocks, pad.pad_block, pad.save_rows,
                                     per_row=per_row)
            elif len(idx) > len(chunk):
                raise ValueError(f"{len(idx) - len(chunk)} more logits rows than sequences outside the mixed grid's "
                                 f"cells (verify rows batched with more chunks than prefill_seqs); lower "
                                 f"max_num_batched_tokens")
        prev = None
        if phase == "mtp":
            h = torch.cat([s["hidden"] for s in chunk]).to(self.dtype)
            prev = torch.zeros(pad.tokens, h.shape[-1], dtype=self.dtype)
            prev[:h.shape[0]] = h
        b = npu_step_inputs(input_ids=ids, positions=[p for s in chunk for p in s["pos"]],
                            slot_mapping=[x for s in chunk for x in s["slots"]],
                            block_tables=[s["table"] for s in chunk], seq_lens=[s["seq_len"] for s in chunk],
                            query_lens=qlens, logits_indices=idx,
                            block_size=self.block_size, save_block_ids=save,
                            load_block_ids=[b for s in rows for b in s["load"]] if history else None,
                            decode=phase == "decode", device=self.device, pad=pad, prev_hidden=prev,
                            gather="kv_gather_rows" in getattr(mod, "STEP_READS", ("kv_gather_rows",)))
        # the module's logits rows that are real rows' (in row order): positions in its logits_indices
        pos_of = {t: i for i, t in enumerate(idx)}
        b.real_logits = torch.tensor([pos_of[t] for t in real], dtype=torch.int64)
        if "lora_sel" in getattr(mod, "STEP_READS", ()):
            add_lora_inputs(b, [s.get("lora", 0) for s in chunk for _ in s["ids"]], self.lora_slots.views())
        return b, len(save or ())


def _sequence(row, block_size: int) -> dict:
    """One plan row as the NPU inputs want it: tokens, positions, slots, its block table (trimmed to
    its length), the blocks it saves and loads (and the loaded blocks' staging); a row asking for more
    than its last position's logits (a verify row) names them (``logits``). A CP rank's piece of a row:
    `context_parallel.piece_sequence`."""
    table = list(row.block_table[:-(-row.seq_len // block_size)])
    extra = {} if tuple(row.logits_positions) in ((), (row.num_tokens - 1,)) else \
        {"logits": tuple(row.logits_positions)}
    if not row.logits_positions:
        extra = {"logits": ()}
    return {**extra, "ids": list(row.token_ids), "pos": list(row.positions),
            "slots": slot_mapping(table, row.start, row.seq_len, block_size).tolist(),
            "table": table, "seq_len": row.seq_len, "save": list(row.save_block_ids),
            "load": list(row.load_block_ids),
            "loaded": row.loaded if isinstance(row.loaded, LoadedBlocks) else list(row.loaded)}


def _widened(s: dict, per_row: int, pad_block: int, block_size: int) -> dict:
    """A decode row of fewer than ``per_row`` tokens (a verify row with fewer drafts, a plain decode row) widened
    to ``per_row``: the decode module takes S = T / B tokens a row. The extra tokens come after the real ones
    (the causal mask keeps every real token from reading them), write their KV into the pad block only and
    ask for no logits; the row's KV length grows with them (its table padded with the pad block)."""
    n = per_row - len(s["ids"])
    if n == 0:
        return s
    last = s["pos"][-1]
    pos = list(range(last + 1, last + 1 + n))
    return {**s, "ids": s["ids"] + [0] * n, "pos": s["pos"] + pos,
            "slots": s["slots"] + [pad_block * block_size + p % block_size for p in pos],
            "seq_len": s["seq_len"] + n, "logits": s.get("logits", tuple(range(len(s["ids"]))))}
