"""NPU calls shared by the single-device and the parallel-rank emitters (`graphgen.lower.npu`,
`graphgen.lower.npu_parallel`) that read load-time weights (`graphgen.lower.render.load_time_weight`;
built by `graphgen.npu.run.weights`): the dense/shared SwiGLU MLP and the MoE."""

from __future__ import annotations

from ..ir.graph import Node
from .render import EmitContext, load_time_weight, moe_kwargs, weight


def swiglu_mlp_call(n: Node, ctx: EmitContext) -> str:
    """``_swiglu_mlp(x, W[gate|up], W[down])``: gate and up merged at load into one weight (one matmul,
    whose output is already the ``[gate | up]`` npu_swiglu takes)."""
    gate_up = load_time_weight(n, ctx.loaded, ("w_gate", "w_up"), dim=0)
    return f"_swiglu_mlp({ctx.ref(n.input('x'))}, {gate_up}, {weight(n, 'w_down')})"


def moe_call(n: Node, ctx: EmitContext, residual: str, *extra: str) -> str:
    """``_moe_residual(...)`` with the load-time expert layouts: gate/up stacked ``[E, I, H]`` merged and
    transposed once into ``[E, H, 2I]``, down ``[E, H, I]`` transposed once into ``[E, I, H]`` (what
    npu_grouped_matmul multiplies by, no per-step transpose; audit 2 row 10), the shared expert's gate/up
    merged as in the dense MLP. The router weight and score bias stay the checkpoint's float32 tensors.
    ``extra``: more keyword arguments (the expert-parallel ``ep=``/``ep_rank=``)."""
    lw = ctx.loaded
    args = [ctx.ref(n.input("x")), weight(n, "w_router"), weight(n, "w_bias"),
            load_time_weight(n, lw, ("w_experts_gate", "w_experts_up"), dim=1, transpose12=True),
            load_time_weight(n, lw, ("w_experts_down",), dim=0, transpose12=True),
            load_time_weight(n, lw, ("w_shared_gate", "w_shared_up"), dim=0), weight(n, "w_shared_down"),
            residual, *moe_kwargs(n.attrs), f"num_experts={n.attrs['num_experts']}", *extra]
    return f"_moe_residual({', '.join(args)})"
