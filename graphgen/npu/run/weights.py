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
once. Rank weights are sliced first (``rank_weights``), so a rank merges its own slices: the merged
column-parallel weight of the rank. Float32 keys (router weight, score bias) are never sources: they
stay the checkpoint's float32 tensors (`graphgen.runtime.core.weights.cast_weights`).
"""
from __future__ import annotations

from ...runtime.core.weights import build_load_time_weight, load_time_weights

__all__ = ["load_time_weights", "build_load_time_weight"]
