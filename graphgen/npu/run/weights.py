"""Load-time weight layouts of the NPU modules (audit 2 rows 10, 18; issue 15 item 6).

Each generated NPU module declares ``LOAD_TIME_WEIGHTS`` (lowering: `graphgen.lower.render.load_time_weight`):
``{key: {"cat": (checkpoint keys...), "dim": d, "transpose12": bool}}``. `load_time_weights` builds each
once, when the weights are loaded, instead of every forward:

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

from typing import Iterable, Mapping

import torch

__all__ = ["load_time_weights", "build_load_time_weight"]


def build_load_time_weight(sources: list, *, dim: int, transpose12: bool) -> torch.Tensor:
    """One recipe: ``cat(sources, dim)``, then ``transpose(1, 2)`` made contiguous when ``transpose12``."""
    w = sources[0] if len(sources) == 1 else torch.cat(sources, dim=dim)
    return w.transpose(1, 2).contiguous() if transpose12 else w.contiguous()


def load_time_weights(W: Mapping[str, torch.Tensor], modules: Iterable) -> dict[str, torch.Tensor]:
    """``W`` with every module's ``LOAD_TIME_WEIGHTS`` built (each once, however many modules share it)
    and their sources removed. A source missing from ``W`` is a ``KeyError`` naming the recipe."""
    recipes: dict = {}
    for mod in modules:
        for key, r in getattr(mod, "LOAD_TIME_WEIGHTS", {}).items():
            if recipes.setdefault(key, r) != r:
                raise ValueError(f"modules disagree on load-time weight {key!r}: {recipes[key]} vs {r}")
    out = dict(W)
    for key, r in recipes.items():
        if key in out:
            continue  # already built (W given twice)
        missing = [s for s in r["cat"] if s not in W]
        if missing:
            raise KeyError(f"load-time weight {key!r} needs {missing}, which the weights do not have")
        out[key] = build_load_time_weight([W[s] for s in r["cat"]], dim=r["dim"], transpose12=r["transpose12"])
    for r in recipes.values():
        for s in r["cat"]:
            out.pop(s, None)
    return out
