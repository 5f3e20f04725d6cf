"""W8A8 (dynamic) on the CPU target: the NPU's int8 arithmetic, emulated exactly (docs/spec.md, "Quantization").

A spec's ``quantization: {method: w8a8_dynamic}`` makes every linear layer's weight int8 with one scale per
output channel (`quantize_rows`, at load: `graphgen.runtime.core.weights`) and quantizes the activation per
token before each product (`dynamic_quant`). The product is int8 x int8 summed in int32 (``torch._int_mm``:
exact), then scaled by the token's scale and the channel's scale, and rounded to the compute dtype
(`w8a8_matmul`). This is what the NPU lowering asks of ``npu_dynamic_quant`` + ``npu_quant_matmul`` /
``npu_grouped_matmul`` (per-token mode), as our reading of torch-npu 2.14.0's docs gives it
(_op_plugin_docs.py:4654-4676: scale = rowMax(|x|) / 127, y = round(x / scale); :5808-5812 and
:4959-5027: y = (x1 . x2) x scale x pertoken_scale). The stand-in's kernels (`graphgen.npu.standin`) are written
from the same docs, separately: comparing the two proves the NPU module's wiring, not the kernels' meaning.

Where the docs say nothing we choose, and the stand-in chooses the same: rounding half to even
(``torch.round``), and a row of zeros quantizes to zeros with scale 0 (the formula divides by zero there:
the NPU runner pads steps with zero rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor

__all__ = ["Int8Weight", "w8a8", "quantize_rows", "dynamic_quant", "w8a8_matmul", "INT8_MAX"]

INT8_MAX = 127.0


@dataclass(frozen=True)
class Int8Weight:
    """A linear layer's W8A8 weight: ``q`` int8 (``[in, out]`` for `matmul_t`, ``[.., out, in]`` in checkpoint
    layout for `linear`, as its unquantized twin) and ``scale`` [.., out] (the compute dtype's scale dtype,
    `graphgen.ir.quant.scale_dtype`). Indexing picks experts of a stack (``[E, out, in]``)."""
    q: Tensor
    scale: Tensor

    def __getitem__(self, i) -> "Int8Weight":
        return Int8Weight(self.q[i], self.scale[i])

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype


def w8a8(q: Tensor, scale: Tensor) -> Int8Weight:
    """``rt.w8a8(W[k], W[k + ':scale'])`` in a generated CPU module."""
    return Int8Weight(q, scale)


def quantize_rows(w: Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """(int8 ``w``, its scales ``w.shape[:-1]`` in ``scale_dtype``): one symmetric scale per row (an output
    channel of a ``[.., out, in]`` weight), max |w| / 127, in float32. The int8 values are taken against the
    scale as stored (rounded to ``scale_dtype``), so ``q x scale`` is the weight as well as that dtype allows."""
    w = w.float()
    scale = (w.abs().amax(-1) / INT8_MAX).to(scale_dtype)
    return _round_to_int8(w, scale.float()), scale


def _round_to_int8(x: Tensor, scale: Tensor) -> Tensor:
    q = torch.round(x / scale.unsqueeze(-1))
    q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))  # a zero row: 0/0
    return q.clamp_(-INT8_MAX - 1, INT8_MAX).to(torch.int8)


def dynamic_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token symmetric int8 quantization of ``x`` [T, K]: (int8 [T, K], float32 scales [T])."""
    xf = x.float()
    scale = xf.abs().amax(-1) / INT8_MAX
    return _round_to_int8(xf, scale), scale


def w8a8_matmul(x: Tensor, w: Int8Weight, *, transposed: bool) -> Tensor:
    """``x @ W^T`` with W8A8: ``x`` [T, K] quantized per token, int8 products summed in int32, then
    ``x token scale x channel scale`` in float32, rounded to ``x``'s dtype. ``transposed``: ``w.q`` is
    ``[in, out]`` (else ``[out, in]``)."""
    lead = x.shape[:-1]
    xq, xs = dynamic_quant(x.reshape(-1, x.shape[-1]))
    wq = w.q if transposed else w.q.t()
    acc = _int_mm(xq, wq)
    y = acc.float() * w.scale.float() * xs.unsqueeze(-1)
    return y.to(x.dtype).reshape(*lead, y.shape[-1])


def _int_mm(a: Tensor, b: Tensor) -> Tensor:
    """int8 [M, K] x int8 [K, N] -> int32 [M, N], exact (torch's int8 GEMM; every sum fits: |sum| <= K x 128^2)."""
    if a.shape[0] == 0:
        return torch.zeros(0, b.shape[1], dtype=torch.int32)
    return torch._int_mm(a.contiguous(), b.contiguous())
