"""CPU emitters of the parallel-rank ops (``graphgen.passes.shard``), merged into ``cpu.EMIT``.

Collectives call ``rt.all_reduce`` / ``rt.all_gather``: the rank runtime
(``graphgen.runtime.parallel.collectives.CollectiveRuntime``) runs them on torch.distributed (gloo). Ops whose
slice depends on the rank (the vocabulary slice of the embedding, a rank's experts) take the rank
from ``rt`` at run time, so the generated module is the same for every rank.
"""

from __future__ import annotations

from ..ir.graph import Node
from .render import MOE_WEIGHTS, EmitContext, Emitter, linear_weight, moe_kwargs, weight

# a W8A8 weight on the CPU target: its int8 values and scales as one `graphgen.runtime.core.quant.Int8Weight`,
# which `linear`/`matmul_t` multiply as the NPU's kernels do (int8 products, int32 sums, then the scales)
CPU_PAIR = "rt.w8a8({w}, {scale})"


def projection(n: Node, ctx: EmitContext, *attrs: str) -> str:
    """The CPU layout of a dense projection: the load-time weight of ``attrs`` stored ``[in, out]``
    (several: merged along the output dim). Here, not in ``cpu``, because both tables use it; a rank
    merges and transposes its own slices (``key[d<dim>/<parts>]`` names). Under W8A8 the same layout in int8."""
    return linear_weight(n, ctx, attrs, pair=CPU_PAIR, dim=0, transpose01=True)


def raw_linear(n: Node, ctx: EmitContext, attr: str) -> str:
    """A linear layer's weight in checkpoint layout ``[out, in]`` (MLA's projections, the experts): the
    checkpoint tensor, or under W8A8 its int8 copy and scales."""
    return linear_weight(n, ctx, (attr,), pair=CPU_PAIR)


def moe_weights(n: Node, ctx: EmitContext) -> list[str]:
    """The MoE op's weights in argument order (router and bias as stored; the experts' projections in
    checkpoint layout, int8 under W8A8)."""
    return [raw_linear(n, ctx, w) if w.startswith(("w_experts", "w_shared")) else weight(n, w) for w in MOE_WEIGHTS]


def _call(n: Node, ctx: EmitContext, fn: str, *args: str) -> list[str]:
    return [f"{ctx.ref.all(n.writes)} = rt.{fn}({', '.join(args)})"]


def _all_reduce(n: Node, ctx: EmitContext) -> list[str]:
    a = n.attrs
    return _call(n, ctx, "all_reduce", ctx.ref(n.input("x")), f"group={a['group']!r}", f"size={a['size']}",
                 f"reduce={a['reduce']!r}")


def _all_gather(n: Node, ctx: EmitContext) -> list[str]:
    a = n.attrs
    return _call(n, ctx, "all_gather", ctx.ref(n.input("x")), f"group={a['group']!r}", f"size={a['size']}",
                 f"dim={a['dim']}", f"length={a['length']}")


def _reduce_scatter(n: Node, ctx: EmitContext) -> list[str]:
    a = n.attrs
    return _call(n, ctx, "reduce_scatter", ctx.ref(n.input("x")), f"group={a['group']!r}", f"size={a['size']}",
                 f"reduce={a['reduce']!r}", f"dim={a['dim']}")


def _embedding_shard(n: Node, ctx: EmitContext) -> list[str]:
    return _call(n, ctx, "embedding_shard", weight(n, "w_embed"), ctx.ref(n.input("input_ids")),
                 f"vocab_size={n.attrs['vocab_size']}")


def _o_proj(n: Node, ctx: EmitContext) -> list[str]:
    return _call(n, ctx, "o_proj", ctx.ref(n.input("attn")), projection(n, ctx, "w_o"))


def _swiglu_mlp(n: Node, ctx: EmitContext) -> list[str]:
    return _call(n, ctx, "swiglu_mlp", ctx.ref(n.input("x")), projection(n, ctx, "w_gate", "w_up"),
                 projection(n, ctx, "w_down"))


def _moe(n: Node, ctx: EmitContext) -> list[str]:
    a = n.attrs
    return _call(n, ctx, "moe", ctx.ref(n.input("x")), *moe_weights(n, ctx), *moe_kwargs(a),
                 f"num_experts={a['num_experts']}", f"ep={a['ep']}")


def _residual_add(n: Node, ctx: EmitContext) -> list[str]:
    return _call(n, ctx, "residual_add", ctx.ref(n.input("x")), ctx.ref(n.input("residual")))


EMIT_PARALLEL: dict[str, Emitter] = {
    "all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
    "embedding_shard": _embedding_shard,
    "o_proj": _o_proj, "swiglu_mlp": _swiglu_mlp, "moe": _moe, "residual_add": _residual_add,
}
