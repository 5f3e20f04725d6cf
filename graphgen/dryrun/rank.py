"""One rank's dry run (see the package doc): what a launch allocates, in a launch's order, on a ledger."""

from __future__ import annotations

import dataclasses
import resource
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from ..families.parallel import rank_kv_components
from ..ir.weights import graph_weight_names
from ..lower.compile import compile_spec
from ..passes.memory import DEFAULT_NUM_BLOCKS, GIB, NPU_MEMORY, communicator_bytes
from ..runtime.checkpoint.hf import check_config
from ..runtime.checkpoint.plan import RankSlicing
from ..runtime.checkpoint.stream import CheckpointWeights, SliceReader
from ..runtime.core.device_memory import kv_blocks_that_fit
from ..runtime.core.kvcache import PagedKVCache
from ..runtime.core.weights import load_time_weights, place_weights, source_constants
from .ledger import Ledger

__all__ = ["RankReport", "dry_run_rank", "graph_list"]


@dataclass(frozen=True)
class RankReport:
    """One rank: the JSON row of ``graphgen dry-run`` (bytes, seconds), and its budget."""
    rank: int
    device_peak_bytes: int
    device_final_bytes: int
    host_peak_bytes: int
    bytes_read: int
    load_s: float
    graphs: int
    kv_blocks: int
    budget_bytes: Optional[int] = None   # utilization x the device (None: no budget)

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.device_peak_bytes <= self.budget_bytes

    def row(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "budget_bytes"}

    def line(self) -> str:
        budget = f" of {self.budget_bytes / GIB:.2f} GiB" if self.budget_bytes is not None else ""
        return (f"rank {self.rank}: device peak {self.device_peak_bytes / GIB:.2f} GiB{budget}, final "
                f"{self.device_final_bytes / GIB:.2f} GiB, host peak {self.host_peak_bytes / GIB:.2f} GiB, read "
                f"{self.bytes_read / GIB:.2f} GiB in {self.load_s:.1f} s, {self.kv_blocks} KV blocks, "
                f"{self.graphs} graphs" + ("" if self.fits else " -- does not fit"))


def graph_list(spec, mode: str) -> list[str]:
    """The graphs a launch's warm-up compiles in ``mode``: one per bucket of each variant (its phase's
    buckets), and on a history prefill variant one per mixed-grid cell (`NpuModelRunner.compiled`)."""
    from ..npu.run.bucketing import Buckets
    from ..npu.run.mixed_grid import MixedGrid

    b = Buckets.from_spec(spec)
    out = []
    for name, v in spec.variants.items():
        if v.phase == "decode":
            out += [f"{name} [{mode}] batch={n}" for n in b.decode_batch]
            continue
        out += [f"{name} [{mode}] batch={b.prefill_seqs + 1} tokens={t}" for t in b.prefill_tokens]
        if v.history and v.phase == "prefill" and spec.parallel.dp == 1:  # DP runs no mixed cell (warmup.py)
            out += [f"{name} [{mode}] mixed tokens={c.tokens} decode_rows={c.decode_rows}"
                    for c in MixedGrid.from_buckets(b).cells()]
    return out


_CONSTANTS = ("LOAD_TIME_WEIGHTS", "META", "KV_SHAPES", "KV_DTYPE", "ROPE")


def _modules(spec, target: str, mode: Optional[str]):
    """(the modules' constants, as namespaces, the graph weight names they read), compiled as the launch
    compiles them (the constants read from the sources, nothing executed)."""
    compiled = compile_spec(spec, targets=[target], modes=[mode] if target == "npu" else None, check=False)
    mods = [SimpleNamespace(**source_constants(t, _CONSTANTS)) for c in compiled for t in c.sources.values()]
    return mods, graph_weight_names(c.graph for c in compiled)


def dry_run_rank(spec, weights_dir, rank: int, *, target: str = "npu", device_memory_gib: Optional[float] = None,
                 num_blocks: Optional[int] = DEFAULT_NUM_BLOCKS, utilization: Optional[float] = None,
                 mode: Optional[str] = None, old_order: bool = False,
                 progress: Optional[Callable[[int, int], None]] = None) -> RankReport:
    """World rank ``rank`` of ``spec``'s layout over the checkpoint in ``weights_dir``. ``num_blocks``: the
    launch's ``--num-blocks`` (the NPU adds its padding block), or with ``utilization`` the KV cache is
    sized from what the weights left. ``device_memory_gib``: the device (default: the spec's, else the NPU
    target's 64 GiB; the CPU target: no limit). ``old_order``: the negative control, the load order before
    the streaming loader (KV cache first, every source slice placed, then every recipe built while all
    sources are held). ``progress(placed, total)``: bytes of weights placed so far."""
    npu = target == "npu"
    if npu and spec.targets.npu is None:
        raise ValueError(f"spec {spec.name} has no NPU target (targets.npu): use --target cpu")
    check_config(spec, weights_dir)
    mode = mode or (spec.targets.npu.compile_modes[0] if npu else None)
    sources, names = _modules(spec, target, mode)
    weights = CheckpointWeights(str(weights_dir), frozenset(names), RankSlicing.of(spec.parallel, rank), spec.mtp_layers)
    gib = device_memory_gib or (spec.targets.npu.device_memory_gib or NPU_MEMORY.device_memory_gib if npu else None)
    # what the device gives torch (mem_get_info's total): the device less its runtime's own
    device = None if gib is None else int(gib * GIB) - (int(NPU_MEMORY.runtime_gib * GIB) if npu else 0)
    util = utilization or (NPU_MEMORY.utilization if npu else 1.0)
    ledger = Ledger(device)
    comm = communicator_bytes(spec.parallel) if npu else 0
    dtype = getattr(torch, spec.targets.npu.dtype if npu else spec.kv_cache.dtype)
    kv_dtype = getattr(torch, spec.kv_cache.dtype)
    shapes = {n: (spec.kv_cache.block_size, *s) for n, s in
              rank_kv_components(spec.family, dataclasses.asdict(spec.dims), spec.parallel.tp)}
    block_bytes = spec.kv_layers * sum(torch.Size(s).numel() for s in shapes.values()) * kv_dtype.itemsize
    module = sources[0]  # KV_SHAPES / KV_DTYPE: every variant's are the same
    saves = npu and any(m.META["saves"] for m in sources)
    rows, n_rings = _rings(spec) if saves else (0, 0)
    pad = 1 if npu else 0
    # the warm-up graphs' activations and the allocator's reserve: not tensors the dry run builds (it runs no
    # graph), held on the ledger as the same figures validate counts (graphgen.passes.activations)
    from ..passes.activations import allocator_reserve_bytes, peak_activation

    act = peak_activation(spec) if npu else None
    act_bytes = (0 if act is None else act.bytes) + (allocator_reserve_bytes(device) if npu else 0)
    meta = torch.device("meta")
    reader = SliceReader()
    with ledger:
        ledger.hold(comm, "communicator buffers")
        keep = []
        if old_order:  # the KV cache first, at the launch's default
            blocks = (num_blocks or DEFAULT_NUM_BLOCKS) + pad
            keep.append(PagedKVCache(spec.kv_layers, shapes, blocks, kv_dtype, device=meta))
        t0 = time.perf_counter()
        W = place_weights(weights, [] if old_order else sources, family=spec.family, dtype=dtype, device=meta,
                          reader=reader, progress=progress)
        if old_order:  # every recipe built while every source is still held (sources dropped at the end)
            W = load_time_weights(W, sources)
        load_s = time.perf_counter() - t0
        reader.close()
        if npu:
            from ..npu.run.bucketing import max_model_len
            from ..npu.run.inputs import rope_cache

            W["rope"] = rope_cache(module.ROPE, max_model_len(spec), device=meta, dtype=dtype)
        if not old_order:
            if utilization is not None:  # what the weights left (the launch's size_kv: the rings and buffers to come)
                blocks = kv_blocks_that_fit(ledger.live - comm, device, block_bytes, utilization=util,
                                            after_bytes=n_rings * rows * block_bytes + comm + act_bytes)
            else:
                blocks = num_blocks + pad
            keep.append(PagedKVCache(spec.kv_layers, shapes, blocks, kv_dtype, device=meta))
        if saves:
            from ..npu.run.inputs import kv_buffers

            keep += [kv_buffers(module, spec.kv_layers, 0, staging_rows=rows, device=meta)[1] for _ in range(n_rings)]
        if act_bytes:
            ledger.hold(act_bytes, f"activations of {act.graph} ({act.largest}) and the allocator reserve")
        final = ledger.live
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return RankReport(rank, ledger.peak, final, host, reader.bytes_read, round(load_s, 2),
                      len(graph_list(spec, mode)) if npu else 0, blocks,
                      None if device is None else int(util * device))


def _rings(spec) -> tuple[int, int]:
    """(rows per staging buffer, buffers) of the NPU runner's staging ring."""
    from ..npu.run.bucketing import Buckets

    return Buckets.from_spec(spec).save_rows, spec.targets.npu.staging_buffers
