"""NPU calls shared by the single-device and the parallel-rank emitters (`graphgen.lower.npu`,
`graphgen.lower.npu_parallel`) that read load-time weights (`graphgen.lower.render.load_time_weight`;
built by `graphgen.npu.run.weights`): the dense projections, the dense/shared SwiGLU MLP and the MoE, each
in int8 under W8A8 (`graphgen.ir.quant`)."""

from __future__ import annotations

from ..ir.graph import Node
from .render import EmitContext, linear_weight, lora_segments, moe_kwargs, weight

# a W8A8 weight in an NPU module: the (int8 weight, scales) pair the helpers' _linear / _grouped_linear take
NPU_PAIR = "({w}, {scale})"


def dense_weight(n: Node, ctx: EmitContext, *attrs: str) -> str:
    """A dense projection's weight (``attrs`` merged along the output dim): ``[out, in]`` for F.linear, or
    under W8A8 the int8 ``[in, out]`` npu_quant_matmul takes as x2 (k, n) and its scales; for a node the
    ``insert_lora`` pass gave LoRA operands, that weight wrapped with the slots of the projections it adapts
    (`lora_weight`)."""
    return lora_weight(n, ctx, linear_weight(n, ctx, attrs, pair=NPU_PAIR, dim=0, quant_transpose01=True), attrs)


def lora_weight(n: Node, ctx: EmitContext, expr: str, merged: tuple[str, ...]) -> str:
    """``expr`` (the weight of the projections ``merged``, concatenated along the output) as the helpers'
    ``_linear`` takes a LoRA-adapted one: ``{"base": W, "sel": b.lora_sel, "segs": ((offset, b.lora[key]),
    ...)}``, each adapted projection at the offset of its output columns (``b.lora_sel``: each token's one-hot
    slot, `graphgen.npu.run.inputs`); ``expr`` itself when the node adapts none of them (the CPU target's
    twin: `graphgen.lower.cpu._lora`)."""
    segs = lora_segments(n, ctx, merged)
    if segs is None:
        return expr
    return f'{{"base": {expr}, "sel": b.lora_sel, "segs": {segs}}}'


def swiglu_mlp_call(n: Node, ctx: EmitContext) -> str:
    """``_swiglu_mlp(x, W[gate|up], W[down])``: gate and up merged at load into one weight (one matmul,
    whose output is already the ``[gate | up]`` npu_swiglu takes)."""
    return (f"_swiglu_mlp({ctx.ref(n.input('x'))}, {dense_weight(n, ctx, 'w_gate', 'w_up')}, "
            f"{dense_weight(n, ctx, 'w_down')})")


def o_proj_call(n: Node, ctx: EmitContext) -> str:
    """The output projection of the attention's heads (flattened): F.linear, or under W8A8 ``_linear``."""
    x, w = ctx.ref(n.input("attn")), dense_weight(n, ctx, "w_o")
    fn = "_linear" if w.startswith(("(", "{")) else "F.linear"  # a W8A8 pair or a LoRA-adapted weight
    return f"{fn}({x}.reshape({x}.shape[0], -1), {w})"


def moe_call(n: Node, ctx: EmitContext, residual: str, *extra: str) -> str:
    """``_moe_residual(...)`` with the load-time expert layouts: gate/up stacked ``[E, I, H]`` merged and
    transposed once into ``[E, H, 2I]``, down ``[E, H, I]`` transposed once into ``[E, I, H]`` (what
    npu_grouped_matmul multiplies by, no per-step transpose; audit 2 row 10), the shared expert's gate/up
    merged as in the dense MLP. The router weight and score bias stay the checkpoint's float32 tensors.
    ``extra``: more keyword arguments (the expert-parallel ``ep=``/``ep_rank=``)."""
    args = [ctx.ref(n.input("x")), weight(n, "w_router"), weight(n, "w_bias"),
            linear_weight(n, ctx, ("w_experts_gate", "w_experts_up"), pair=NPU_PAIR, dim=1, transpose12=True),
            linear_weight(n, ctx, ("w_experts_down",), pair=NPU_PAIR, dim=0, transpose12=True),
            dense_weight(n, ctx, "w_shared_gate", "w_shared_up"), dense_weight(n, ctx, "w_shared_down"),
            residual, *moe_kwargs(n.attrs), f"num_experts={n.attrs['num_experts']}", *extra]
    return f"_moe_residual({', '.join(args)})"
