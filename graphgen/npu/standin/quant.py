"""CPU and meta reference kernels of the W8A8 (dynamic) ops: ``npu_dynamic_quant``, ``npu_quant_matmul``, and
``npu_grouped_matmul`` in its per-token quantized mode.

Written from the torch-npu 2.14.0 wheel's kernel docs (``torch_npu/_op_plugin_docs.py``), NOT from
``graphgen/runtime/core/quant.py`` (the CPU target's emulation): comparing an NPU module run through these
with the CPU target proves the lowering's wiring under our reading of the docs, not the kernels' meaning.
The documented limits are rows of ``graphgen/npu/check/limits.py`` (``quant.*``, ``gmm.*``), checked by
``graphgen.npu.standin.oplib`` before these run.  Nothing here runs on an NPU.

Our reading, where the docs leave a choice: ``round`` is half to even; a row of zeros (rowMax 0: the
formula divides by zero) quantizes to zeros with scale 0; the int32 sums are exact (computed in float64,
exact for int8 products: |sum| <= K x 128^2 < 2^53).
"""
from __future__ import annotations

import torch

from ..check.limits import value as _int

_INT8_MAX = 127.0  # DTYPE_MAX of int8 (:4664)
# torch's ScalarType numbers, what an ``int? output_dtype`` argument carries (torch-npu's meta registrations
# map them back the same way: op_plugin/meta/_meta_registrations.py TORCH_DTYPE_ENUM_VALUE_TO_SCALAR_TYPE_MAP)
_SCALAR_TYPES = {1: torch.int8, 3: torch.int32, 5: torch.float16, 6: torch.float32, 15: torch.bfloat16}


def _out_dtype(output_dtype) -> torch.dtype:
    if output_dtype is None:
        raise NotImplementedError("stand-in quantized matmuls model an explicit output_dtype only (None: int8 output)")
    return output_dtype if isinstance(output_dtype, torch.dtype) else _SCALAR_TYPES[_int(output_dtype)]


def _unmodelled(op: str, **args) -> None:
    given = [k for k, v in args.items() if v is not None]
    if given:
        raise NotImplementedError(f"stand-in {op} does not model {', '.join(given)}")


def _dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken", dst_type_max=0.0):
    """:4654-4683: per token (a row of the last dim), scale = rowMax(|x|) / 127, y = round(x / scale), int8;
    scale float32, x's shape without its last dim."""
    _unmodelled("npu_dynamic_quant", smooth_scales=smooth_scales, group_index=group_index)
    if quant_mode != "pertoken" or dst_type not in (None, 1):
        raise NotImplementedError("stand-in npu_dynamic_quant models per-token int8 only")
    xf = x.float()
    scale = xf.abs().amax(-1) / _INT8_MAX
    y = torch.round(xf / scale.unsqueeze(-1))
    y = torch.where(scale.unsqueeze(-1) > 0, y, torch.zeros_like(y))
    return y.clamp(-_INT8_MAX - 1, _INT8_MAX).to(torch.int8), scale


def _dynamic_quant_meta(x, *, dst_type=None, **kw):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _exact(a, b):
    """int8 a [.., m, k] x int8 b [k, n]: the int32 sums, exact, as float64."""
    return a.double() @ b.double()


def _quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, x1_dtype=None,
                  x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None, y_scale=None):
    """:4952-5030 in the A2/A3 row int8 x int8 with pertoken_scale (row 3 of :5020-5027): x1 [m, k], x2 [k, n],
    y = (x1 . x2) x scale[n] x pertoken_scale[m] (the per-token form of the GMM's formula 3, :5808-5812),
    in output_dtype."""
    _unmodelled("npu_quant_matmul", offset=offset, bias=bias, x1_dtype=x1_dtype, x2_dtype=x2_dtype,
                pertoken_scale_dtype=pertoken_scale_dtype, scale_dtype=scale_dtype, group_sizes=group_sizes,
                y_scale=y_scale)
    if pertoken_scale is None:
        raise NotImplementedError("stand-in npu_quant_matmul models the per-token form (pertoken_scale) only")
    y = _exact(x1, x2).float() * scale.float() * pertoken_scale.float().unsqueeze(-1)
    return y.to(_out_dtype(output_dtype))


def _quant_matmul_meta(x1, x2, scale, *, output_dtype=None, **kw):
    return x1.new_empty(*x1.shape[:-1], x2.shape[-1], dtype=_out_dtype(output_dtype))


def grouped_matmul_per_token(x, weight, *, scale, per_token_scale, group_list, group_list_type=0, split_item=0,
                             output_dtype=None):
    """npu_grouped_matmul's per-token quantized form (:5808-5812 formula 3, :5960-5969): group g of the rows
    (group_list: cumulative ends when group_list_type 0, else counts) of int8 x[0] [M, K] times int8
    weight[0][g] [K, N], times scale[0][g] [N] and per_token_scale[0] [M], in output_dtype, one output
    (split_item 2/3). Rows past the last group are not computed: NaN (undefined)."""
    xs, w, s, ts = x[0], weight[0], scale[0], per_token_scale[0]
    ends = group_list.long()
    counts = ends if group_list_type == 1 else torch.diff(ends, prepend=ends.new_zeros(1))
    used = int(counts.sum())
    out = torch.full((xs.shape[0], w.shape[-1]), float("nan"), dtype=_out_dtype(output_dtype))
    start = 0
    for g, n in enumerate(counts.tolist()):
        rows = slice(start, start + n)
        y = _exact(xs[rows], w[g]).float() * s[g].float() * ts[rows].float().unsqueeze(-1)
        out[rows] = y.to(out.dtype)
        start += n
    assert start == used
    return [out]
