"""The CPU target's matrix products: which library multiplies (MKL or oneDNN), in one place.

`matmul_t` takes a load-time weight stored ``[in, out]`` (merged q/k/v, gate/up, o_proj, down_proj:
``runtime/core/weights.py``), `linear` a weight in checkpoint layout ``[out, in]`` (MLA, MoE experts,
lm_head, the MTP ``eh_proj``). Both split on one predicate, `_onednn_takes`: several rows of a big
float32 weight go to oneDNN where it is chosen (`_onednn_chosen`), everything else to MKL. The two
libraries differ in summation order only (float rounding: within 1e-4 of transformers either way,
``tests/runtime/test_ops_vs_hf.py``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..lora.delta import LoraWeight, apply as _lora_apply
from .quant import Int8Weight, w8a8_matmul

Tensor = torch.Tensor

__all__ = ["linear", "matmul_t"]


def _onednn_op():
    try:   # an ATen op of CPU builds with oneDNN (what inductor's CPU linear fusions call)
        return torch.ops.mkldnn._linear_pointwise if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


def _onednn_chosen(choice: str, capability: str) -> bool:
    """Whether several-row products go to oneDNN. ``GRAPHGEN_CPU_MATMUL``: ``auto`` (default) takes it
    only where torch runs its AVX-512 kernels — measured faster there (Zen 4: 6-15 % for prefill
    GEMMs, 1.2-2.5x for 2-16 rows) and about 2x *slower* for the wide gate/up weight on an AVX2-only
    CPU (Zen 3: prefill 1.19-1.34x transformers' with it, 0.83-0.99x without); ``onednn`` or ``mkl``
    force one (benchmarks/bench_matmul_libs.py per shape, bench_cpu_kernels.py per model;
    BENCHMARKS.md, issue 17 (d), sessions 25-26)."""
    if choice not in ("auto", "onednn", "mkl"):
        raise ValueError(f"GRAPHGEN_CPU_MATMUL={choice!r}: expected auto, onednn or mkl")
    return choice == "onednn" or (choice == "auto" and capability.startswith("AVX512"))


_ONEDNN_OP = _onednn_op()
_ONEDNN_LINEAR = (_ONEDNN_OP if _onednn_chosen(os.environ.get("GRAPHGEN_CPU_MATMUL", "auto"),
                                               torch.backends.cpu.get_cpu_capability()) else None)
# several rows of a weight this big go to oneDNN (below: MKL's); issue 17 (d), benchmarks/bench_cpu_kernels.py
_ONEDNN_MIN_ROWS, _ONEDNN_MIN_WEIGHT = 2, 1 << 17


def _onednn_takes(x: Tensor, w: Tensor) -> bool:
    # several rows of a big float32 weight on the CPU, no autograd (oneDNN's op has no derivative)
    return (_ONEDNN_LINEAR is not None and x.dim() == 2 and x.shape[0] >= _ONEDNN_MIN_ROWS
            and w.numel() >= _ONEDNN_MIN_WEIGHT and x.dtype == w.dtype == torch.float32
            and x.device.type == "cpu" and not (x.requires_grad or w.requires_grad))


def linear(x: Tensor, w) -> Tensor:
    """``x @ w.T``, ``w`` in checkpoint layout ``[out, in]`` (MLA, MoE experts, lm_head): as `matmul_t`. A W8A8
    weight (`graphgen.runtime.core.quant.Int8Weight`) multiplies in int8 (`w8a8_matmul`)."""
    if isinstance(w, LoraWeight):  # the base product, then each token's adapter delta (graphgen.runtime.lora)
        return _lora_apply(x, w, linear)
    if isinstance(w, Int8Weight):
        return w8a8_matmul(x, w, transposed=False)
    return _ONEDNN_LINEAR(x, w, None, "none", [], "") if _onednn_takes(x, w) else F.linear(x, w)


def matmul_t(x: Tensor, w_t) -> Tensor:
    """``x @ w_t`` for a weight stored ``[in, out]`` (a load-time weight). One row (a lone decode
    step): MKL's GEMV streams the ``[in, out]`` rows (``torch.mm``; 1.2-1.4x ``F.linear``'s). Several
    rows of a big enough float32 weight on an AVX-512 CPU (`_onednn_chosen`): oneDNN's matmul on the
    same memory viewed ``[out, in]`` — 6-15 % faster than MKL's for prefill GEMMs there and 1.2-2.5x
    for 2-16 rows (MKL's small-M path), with no second copy of the weight; for one row it is 1.3-1.8x
    slower, hence the split. Elsewhere ``torch.mm``.
    The two differ in summation order only (float rounding: within 1e-4 of transformers either way).
    A W8A8 weight (`Int8Weight`, ``[in, out]`` int8) multiplies in int8 (`w8a8_matmul`)."""
    if isinstance(w_t, LoraWeight):
        return _lora_apply(x, w_t, matmul_t)
    if isinstance(w_t, Int8Weight):
        return w8a8_matmul(x, w_t, transposed=True)
    if _onednn_takes(x, w_t):
        return _ONEDNN_LINEAR(x, w_t.t(), None, "none", [], "")
    return torch.mm(x, w_t)
