"""The NPU model runner: the step driver for the NPU target, on the runtime's scheduler and KV connector.

`NpuModelRunner` has the CPU runner's interface (``saves(variant)``, ``execute(variant, inputs, staging)
-> StepHandles``, ``close()``), so `LLMEngine` drives it unchanged.  The runtime's `Scheduler` schedules
the steps, its `KVConnector` looks the pool up, loads hits into the cache, pins saved blocks and
commits after the save; this module adapts at the runner boundary:

* **bucketing**: a scheduled step (runtime `StepInputs`) becomes `NpuStepInputs` padded to the spec's
  buckets (`Buckets.from_spec`, `StepPadding`); a prefill with more sequences than ``prefill_seqs``
  (the scheduler batches by tokens, not sequences) runs as several graph calls, one per chunk;
* **the compile cache**: one compiled module per variant (in one compile mode), compiled lazily with
  ``compile_module(..., buckets=N)``: one graph per bucket, never per step;
* **the KV cache in the NPU layout**: the connector's `PagedKVCache` (CPU layout ``[NB, BS, Hkv, D]``,
  what the pool (de)serialises) is handed to the NPU module as views in its layout (``KV_SHAPES``,
  ``[NB, BS, Hkv*D]``): the same memory, so pool loads land where the kernels read;
* **commits off the critical path**: a saving step writes into a buffer of a `StagingRing` (persistent
  buffers, never one whose commit is in flight); a `Committer` thread waits for the step's save event
  (on an NPU: an event recorded after the graph), copies the saved rows into the connector's staging
  and frees the buffer; the connector then puts the blocks (inline for sync, host stream for async).
  ``execute`` returns without waiting for any of it.

`NpuEngine` is the runtime `Engine` assembled with this runner.  ``standin=True`` runs everything on
CPU through graphgen's torchair stand-in (tests; never an NPU result); without it, torch_npu must
import (`NpuUnavailable` otherwise).  The real-device parts (``device="npu"``, the NPU event after
the forward) have never run on an NPU.
"""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Optional

import torch

from ...runtime.engine.facade import Engine
from ...runtime.pool import DEFAULT_POOL_BYTES
from ...runtime.engine.runner import StepHandles
from .bucketing import Buckets, max_model_len
from .staging import Committer, StagingExhausted, StagingRing

__all__ = ["NpuModelRunner", "NpuEngine"]


class _SaveHandle:
    """One step's commit copies (one per graph call) as the connector sees them: ``exception()``
    (the save job) and ``wait()`` (the save event), both blocking until every copy is done."""

    def __init__(self, parts: int):
        self._left, self._errors = parts, []
        self._cv = threading.Condition()

    def _part_done(self, error: Optional[BaseException] = None) -> None:
        with self._cv:
            self._left -= 1
            if error is not None:
                self._errors.append(error)
            self._cv.notify_all()

    def done(self) -> bool:
        with self._cv:
            return self._left == 0

    def wait(self, timeout: Optional[float] = None) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._left == 0, timeout):
                raise TimeoutError("NPU save commit not done in time")
        if self._errors:
            raise self._errors[0]

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        with self._cv:
            self._cv.wait_for(lambda: self._left == 0, timeout)
            return self._errors[0] if self._errors else None


class NpuModelRunner:
    """Runs the generated NPU modules of ``spec`` (one compile mode) on the connector's ``cache``.

    ``weights``: checkpoint-name tensors (cast to ``targets.npu.dtype`` here).  ``pad_block``: a
    cache block no sequence owns (`NpuEngine` reserves it from the allocator); padding tokens write
    and read only it.  ``sources``: {variant: module source} (default: generated in memory)."""

    def __init__(self, spec, weights, cache, *, pad_block: int, mode: Optional[str] = None, standin: bool = False,
                 sources: Optional[dict] = None, check_limits: bool = True):
        from .compile import _import_torchair

        npu = spec.targets.npu
        if npu is None:
            raise ValueError(f"spec {spec.name} has no NPU target (targets.npu)")
        self.mode = mode or npu.compile_modes[0]
        if self.mode not in npu.compile_modes:
            raise ValueError(f"compile mode {self.mode} is not generated for {spec.name}: {list(npu.compile_modes)}")
        self.spec, self.cache, self.pad_block = spec, cache, pad_block
        self.standin, self.check_limits = standin, check_limits
        self.buckets = Buckets.from_spec(spec)
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
        self.dtype = getattr(torch, npu.dtype)
        self.modules = self._load(sources or {})
        self._compiled: dict[str, object] = {}  # the compile cache: variant -> compiled target
        rope = next(iter(self.modules.values())).ROPE
        from .inputs import ROPE_CACHE_KEY, rope_cache

        self.W = {k: v.to(device=self.device, dtype=self.dtype) for k, v in weights.items()}
        self.W[ROPE_CACHE_KEY] = rope_cache(rope, max_model_len(spec), device=self.device, dtype=self.dtype)
        mod = next(iter(self.modules.values()))
        # the connector's cache in the NPU modules' layout: views, same memory
        self.kv = [tuple(t.view(t.shape[0], *s) for t, s in zip(layer, mod.KV_SHAPES)) for layer in cache]
        self.ring = self.committer = None
        if any(m.META["saves"] for m in self.modules.values()):
            from .inputs import kv_buffers

            bufs = [kv_buffers(mod, spec.dims.num_hidden_layers, 0, staging_rows=self.buckets.save_rows,
                               device=self.device)[1] for _ in range(npu.staging_buffers)]
            self.ring = StagingRing(bufs)
            self.committer = Committer(self.ring)
        self._inflight: list[_SaveHandle] = []

    def _load(self, sources: dict) -> dict:
        import contextlib

        from ...lower.compile import compile_variant, mode_dir
        from .compile import load_module

        tags = self._standin_mod.fresh_tags() if self.standin else contextlib.nullcontext()
        mods = {}
        with tags:  # reduce-overhead modules create tagged events at import (once per process)
            for v in self.spec.variants:
                src = sources.get(v) or compile_variant(self.spec, v, "npu", mode=self.mode)
                mods[v] = load_module(Path(f"<{self.spec.name}>/npu/{mode_dir(self.mode)}/{v}.py"), src)
        return mods

    # ---- the runner interface (as CpuModelRunner) ------------------------------------------------
    def saves(self, variant: str) -> bool:
        return bool(self.modules[variant].META["saves"])

    def compiled(self, variant: str):
        """The compiled forward of ``variant`` (compiled on first use; one graph per bucket)."""
        if variant not in self._compiled:
            from .compile import compile_module

            mod = self.modules[variant]
            target, _ = compile_module(mod, self.mode, use_standin=self.standin,
                                       buckets=self.buckets.count(mod.META["phase"]))
            self._compiled[variant] = target
        return self._compiled[variant]

    def execute(self, variant: str, inputs, staging=None, loads=()) -> StepHandles:
        """``loads``: the step's loaded history blocks per layer (`KVConnector.take_loads`), row j for
        cache block ``inputs.load_block_ids[j]``; each graph call gets its sequences' rows, padded."""
        mod = self.modules[variant]
        saves = bool(mod.META["saves"])
        if (staging is None) == saves:
            raise ValueError(f"{variant}: a staging area is needed exactly when the module saves "
                             f"(saves={saves}, staging given: {staging is not None})")
        phase = mod.META["phase"]
        seqs = _sequences(inputs, self.block_size)
        chunks = self._chunks(phase, seqs)
        handle = _SaveHandle(len(chunks)) if saves else None
        target = self.compiled(variant)
        logits, offset = [], 0
        history = bool(mod.META.get("history"))
        for chunk in chunks:
            b, n_save = self._step_inputs(phase, chunk, saves, history)
            idx, buf = self._acquire() if saves else (None, ())
            with torch.no_grad(), self._limits():
                if history:  # eager, before the graph (see the generated module's load())
                    mod.load(b, self.kv, self._chunk_loads(mod, chunk, loads))
                out = target.forward(self.W, b, self.kv, buf)
            logits.append(out[:len(chunk)].float())
            if saves:
                self.committer.submit(self._save_event(), idx, self._copy_out(staging, offset, n_save, handle))
                offset += n_save
        if saves:
            self._inflight.append(handle)
        return StepHandles(torch.cat(logits), handle, handle)

    def close(self) -> None:
        if self.committer is not None:
            self.committer.close()
            self.committer = None

    # ---- internals --------------------------------------------------------------------------
    def _limits(self):
        import contextlib

        return self._standin_mod.enforce_limits(self.check_limits) if self.standin else contextlib.nullcontext()

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

    def _chunk_loads(self, mod, chunk: list, loads) -> list:
        """The loaded rows of the chunk's sequences, in the module's layout, padded with zero rows
        to the bucket's ``save_rows`` (padding rows scatter into the pad block)."""
        rows = torch.tensor([j for s in chunk for j, _ in s["load"]], dtype=torch.long)
        out = []
        for layer in range(self.spec.dims.num_hidden_layers):
            comps = []
            for i, shape in enumerate(mod.KV_SHAPES):
                t = torch.zeros(self.buckets.save_rows, *shape, dtype=self.dtype, device=self.device)
                if rows.numel():
                    src = loads[layer][i].index_select(0, rows)
                    t[:rows.numel()].copy_(src.view(rows.numel(), *shape))
                comps.append(t)
            out.append(tuple(comps))
        return out

    def _step_inputs(self, phase: str, chunk: list, saves: bool, history: bool = False):
        from .inputs import npu_step_inputs

        ids = [t for s in chunk for t in s["ids"]]
        qlens = [len(s["ids"]) for s in chunk]
        save = [b for s in chunk for b in s["save"]] if saves else None
        pad = self.buckets.padding(phase, len(chunk), len(ids), self.pad_block)
        b = npu_step_inputs(input_ids=ids, positions=[p for s in chunk for p in s["pos"]],
                            slot_mapping=[x for s in chunk for x in s["slots"]],
                            block_tables=[s["table"] for s in chunk], seq_lens=[s["seq_len"] for s in chunk],
                            query_lens=qlens, logits_indices=[sum(qlens[:i + 1]) - 1 for i in range(len(chunk))],
                            block_size=self.block_size, save_block_ids=save,
                            load_block_ids=[b for s in chunk for _, b in s["load"]] if history else None,
                            decode=phase == "decode", device=self.device, pad=pad)
        return b, len(save or ())

    def _acquire(self):
        while True:
            try:
                return self.ring.acquire()
            except StagingExhausted:
                # more commits in flight than staging_buffers - 1: wait for the oldest (never
                # happens with enough buffers; on the CPU stand-in commits finish at once)
                self._inflight = [h for h in self._inflight if not h.done()]
                if not self._inflight:
                    raise
                self._inflight[0].wait()

    def _save_event(self):
        """What the commit waits for: the graph's save done.  Stand-in: the forward ran synchronously.
        NPU: an event recorded on the current stream after the graph (unverified on hardware)."""
        if self.standin:
            return lambda: None
        ev = torch.npu.Event()  # type: ignore[attr-defined]  (torch_npu registers torch.npu)
        ev.record(torch.npu.current_stream())  # type: ignore[attr-defined]
        return ev.synchronize

    def _copy_out(self, staging, offset: int, n: int, handle: _SaveHandle):
        """The commit of one graph call: its saved rows, ring buffer -> the connector's staging."""
        def commit(buf):
            try:
                for dst_layer, src_layer in zip(staging, buf):
                    for dst, src in zip(dst_layer, src_layer):
                        dst[offset:offset + n].copy_(src[:n].view(n, *dst.shape[1:]))
            except BaseException as e:  # the connector counts it (save_failures); nothing is put
                handle._part_done(e)
                return
            handle._part_done()
        return commit


def _sequences(x, block_size: int) -> list[dict]:
    """Per sequence of a runtime step: its tokens, positions, slots, block table (trimmed to its
    length: the scheduler pads tables with block 0, a real block here), the blocks it saves and the
    blocks it loads (with their rows in the step's load staging)."""
    qlens, seq_lens = x.query_lens.tolist(), x.seq_lens.tolist()
    ids, pos, slots = x.input_ids.tolist(), x.positions.tolist(), x.slot_mapping.tolist()
    save_ids = x.save_block_ids.tolist()
    load_ids = list(enumerate(x.load_block_ids.tolist()))
    out, t = [], 0
    for i, (q, n) in enumerate(zip(qlens, seq_lens)):
        table = x.block_tables[i, :-(-n // block_size)].tolist()
        owned = set(table)
        out.append({"ids": ids[t:t + q], "pos": pos[t:t + q], "slots": slots[t:t + q], "table": table,
                    "seq_len": n, "save": [b for b in save_ids if b in owned],
                    "load": [(j, b) for j, b in load_ids if b in owned]})
        t += q
    return out


class NpuEngine(Engine):
    """The runtime `Engine` (scheduler, connector, `LLMEngine`, ``generate``) with `NpuModelRunner`.

    Differences from the CPU engine: the cache and the weights are in the NPU dtypes; one extra cache
    block is reserved for padding; the scheduler's limits come from the buckets (``max_num_seqs`` <= the
    largest decode bucket, ``max_num_batched_tokens`` <= the largest prefill bucket - prefill_seqs)."""

    def __init__(self, spec, weights: dict, *, spec_file: str = "", pool="host",
                 pool_capacity_bytes: int = DEFAULT_POOL_BYTES, num_blocks: int = 512, faults=None,
                 collect_logits: bool = False, max_num_seqs: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None, async_scheduling: bool = False,
                 standin: bool = False, mode: Optional[str] = None, sources: Optional[dict] = None, **_ignored):
        from ...runtime.core import ops
        from ...runtime.engine.connector import KVConnector
        from ...runtime.core.kvcache import BlockAllocator, PagedKVCache
        from ...runtime.engine.step_loop import LLMEngine
        from ...runtime.engine.scheduler import Scheduler

        if spec.targets.npu is None:
            raise ValueError(f"spec {spec.name} has no NPU target (targets.npu)")
        if not standin:  # before anything is put on the device: NpuUnavailable, one sentence
            from .compile import _import_torchair

            _import_torchair(False)
        self._setup(spec, faults, collect_logits, pool, pool_capacity_bytes)
        shapes = ops.kv_cache_shapes(spec.family, dataclasses.asdict(spec.dims), num_blocks + 1, self.block_size)
        device = "cpu" if standin else "npu"
        self.cache = PagedKVCache(spec.dims.num_hidden_layers, {k: tuple(s[1:]) for k, s in shapes.items()},
                                  num_blocks + 1, self.dtype, device=device)
        self.alloc = BlockAllocator(num_blocks + 1)
        (pad_block,) = self.alloc.alloc(1)  # never freed: padding tokens' block
        self.runner = NpuModelRunner(spec, weights, self.cache, pad_block=pad_block, mode=mode, standin=standin,
                                     sources=sources)
        self.rt = self.runner  # Engine.close() closes it (the commit thread)
        self.connector = KVConnector(self.pool, self.cache, self.alloc, model=spec.name, write=self.write)
        bk = self.runner.buckets
        self.max_model_len = max_model_len(spec)
        self.scheduler = Scheduler(spec, self.alloc, self.connector, reclaim=self.connector.wait_oldest,
                                   max_num_seqs=min(max_num_seqs or bk.decode_batch[-1], bk.decode_batch[-1]),
                                   max_num_batched_tokens=min(max_num_batched_tokens or 1 << 30,
                                                              bk.prefill_tokens[-1] - bk.prefill_seqs))
        self.llm = LLMEngine(self.scheduler, self.connector, self.runner, vocab_size=spec.dims.vocab_size,
                             async_scheduling=async_scheduling, collect_logits=collect_logits)

    def generate(self, prompts, max_new_tokens: int = 16, **kw):
        for p in prompts:
            if len(p) + max_new_tokens > self.max_model_len:
                raise ValueError(f"prompt of {len(p)} tokens + {max_new_tokens} new tokens exceeds max_model_len "
                                 f"{self.max_model_len} (targets.npu.max_model_len)")
        return super().generate(prompts, max_new_tokens, **kw)
