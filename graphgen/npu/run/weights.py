"""Load-time weight layouts of the NPU modules (audit 2 rows 10, 18; issue 15 item 6).

Each generated NPU module declares ``LOAD_TIME_WEIGHTS`` (lowering: `graphgen.lower.render.load_time_weight`):
``{key: {"cat": (checkpoint keys...), "dim": d, "transpose12": bool}}``. `load_time_weights` (one home for
both targets: `graphgen.runtime.core.weights`, re-exported here) builds each once, when the weights are
loaded, instead of every forward:

* **merged projections**: q/k/v into one ``[q; k; v]`` weight and gate/up into one ``[gate; up]``
  (dense MLP, shared expert): one matmul each, split (q/k/v) or fed whole to ``npu_swiglu`` (gate/up);
* **MoE experts in npu_grouped_matmul's layout**: stacked gate/up ``[E, I, H]`` merged and transposed to
  ``[E, H, 2I]``, down ``[E, H, I]`` to ``[E, I, H]``, contiguous (torchair folds a transposed view into
  GMM's ``transpose_weight`` for fp8/mxfp4 only, so a bf16 view would be a per-step Transpose in GE).

The sources are dropped (the modules read only the built keys), so the device holds each weight
once; from a checkpoint each source slice is copied straight into its place in the built tensor
(`graphgen.runtime.checkpoint.plan`), and `load_first` puts the weights on the device before the KV
cache (`npu_engine`). Rank weights are sliced first (``rank_weights``), so a rank merges its own slices: the merged
column-parallel weight of the rank. Float32 keys (router weight, score bias) are never sources: they
stay the checkpoint's float32 tensors (`graphgen.runtime.core.weights.cast_weights`).
"""
from __future__ import annotations

import torch

from ...runtime.core.weights import build_load_time_weight, load_time_weights

__all__ = ["load_time_weights", "build_load_time_weight", "load_first"]


def load_first(spec, weights, mode, sources, standin: bool, utilization, save_rows: int):
    """What `npu_engine` hands `build_engine` so that the weights come before the KV cache:
    ``(load_weights, placed, size_kv, sources)``. ``load_weights()`` places them into ``placed["W"]``
    through the runtime's one loader (`place_weights`: a checkpoint folder streamed in its dtype, each
    load-time weight built in place); ``size_kv`` (with ``utilization``) sizes the cache from what they
    left (`kv_blocks_that_fit`; the staging rings and the communicators' buffers still to come, as
    `graphgen.passes.memory` counts them); ``sources``: the modules, compiled once here."""
    from ...lower.compile import compile_variant
    from ...passes.memory import communicator_bytes
    from ...runtime import CheckpointWeights
    from ...runtime.core.device_memory import kv_blocks_that_fit
    from ...runtime.core.weights import place_weights

    npu = spec.targets.npu
    if not isinstance(weights, dict) and not hasattr(weights, "place"):  # a checkpoint folder
        weights = CheckpointWeights.whole(weights, spec)
    mode = mode or npu.compile_modes[0]
    sources = sources or {v: compile_variant(spec, v, "npu", mode=mode) for v in spec.variants}
    device = torch.device("cpu") if standin else torch.device("npu")
    mem = None if utilization is None or standin else torch.npu.mem_get_info  # type: ignore[attr-defined]
    if utilization is not None and standin:
        raise ValueError("--device-memory-utilization sizes the KV cache from an NPU's free memory; with "
                         "--standin give --num-blocks")
    start = mem() if mem is not None else None
    placed: dict = {}

    def load_weights():
        placed["W"] = place_weights(weights, sources.values(), family=spec.family, dtype=getattr(torch, npu.dtype),
                                    device=device)

    def size_kv(block_bytes: int) -> int:
        from ...passes.activations import allocator_reserve_bytes, peak_activation

        free, total = mem()
        act = peak_activation(spec)  # the warm-up graphs' activations and the allocator's reserve come after
        return kv_blocks_that_fit(start[0] - free, total, block_bytes, utilization=utilization,
                                  after_bytes=npu.staging_buffers * save_rows * block_bytes
                                  + communicator_bytes(spec.parallel) + (0 if act is None else act.bytes)
                                  + allocator_reserve_bytes(total))

    return load_weights, placed, (size_kv if mem is not None else None), sources
