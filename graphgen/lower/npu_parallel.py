"""NPU emitters of the parallel-rank ops (``graphgen.passes.shard``), merged into ``npu.EMIT``.

Collectives are torch.distributed *functional* collectives, spelled as the ops they trace to
(``torch.ops._c10d_functional.all_reduce`` / ``all_gather_into_tensor`` + ``wait_tensor``, what
``torch.distributed._functional_collectives`` emits): torchair converts those to HCCL collectives
inside the captured graph, on the default (world) group — the TP group, since EP reuses the TP ranks.
They are torch ops, not torch-npu ones, so the torch-npu manifest does not list them; the tests
check them against the installed torch's op registry. The rank (vocabulary slice of the embedding)
is ``torch.distributed.get_rank()``, a constant when each rank traces its own graph.

Expert-parallel MoE (``ep > 1``) has no NPU lowering yet: ``npu_moe_init_routing_v2`` needs this
rank's ``active_expert_range`` and the grouped matmuls its local expert ids; a TP-sliced MoE
(``ep == 1``) reuses the single-device kernel chain with a zero residual.
"""

from __future__ import annotations

from .npu_calls import moe_call, swiglu_mlp_call
from .render import Emitter, LoweringError, weight

_GROUP = "torch.distributed.group.WORLD.group_name"


def _out(n, ctx) -> str:
    return ctx.ref.all(n.writes)


def _all_reduce(n, ctx):
    _tp_group_only(n)
    if n.attrs["reduce"] != "sum":
        raise LoweringError(f"node {n.id}: no NPU lowering for all_reduce {n.attrs['reduce']!r}")
    x = ctx.ref(n.input("x"))
    return [f"{_out(n, ctx)} = torch.ops._c10d_functional.wait_tensor("
            f"torch.ops._c10d_functional.all_reduce({x}, 'sum', {_GROUP}))"]


def _tp_group_only(n) -> None:
    """The NPU lowering knows one group, the world = the TP group: sequence parallel's token gathers and
    the dp/ep/cp groups (docs/parallel.md) are CPU-only so far (graphgen run/serve refuse them on npu)."""
    a = n.attrs
    if a["group"] != "tp" or (n.op == "all_gather" and a["length"] is None) or n.op == "reduce_scatter":
        raise LoweringError(f"node {n.id}: no NPU lowering for {n.op} in group {a['group']!r}"
                            f"{' over the tokens' if a.get('dim') == 0 else ''} (sequence, context and "
                            f"data-parallel layouts are CPU-only so far)")


def _reduce_scatter(n, ctx):
    _tp_group_only(n)


def _all_gather(n, ctx):
    _tp_group_only(n)
    a, x = n.attrs, ctx.ref(n.input("x"))
    # gathered along dim 0 (rank-major), then moved to the attribute's dim
    return [f"{_out(n, ctx)} = torch.cat(torch.ops._c10d_functional.wait_tensor("
            f"torch.ops._c10d_functional.all_gather_into_tensor({x}.contiguous(), {a['size']}, {_GROUP}))"
            f".chunk({a['size']}, dim=0), dim={a['dim']}).narrow({a['dim']}, 0, {a['length']})"]


def _embedding_shard(n, ctx):
    w, ids = weight(n, "w_embed"), ctx.ref(n.input("input_ids"))
    return [f"_ids = {ids} - torch.distributed.get_rank() * {w}.shape[0]",
            f"{_out(n, ctx)} = F.embedding(_ids.clamp(0, {w}.shape[0] - 1), {w}) * "
            f"((_ids >= 0) & (_ids < {w}.shape[0])).unsqueeze(-1).to({w}.dtype)"]


def _o_proj(n, ctx):
    x = ctx.ref(n.input("attn"))
    return [f"{_out(n, ctx)} = F.linear({x}.reshape({x}.shape[0], -1), {weight(n, 'w_o')})"]


def _swiglu_mlp(n, ctx):
    return [f"{_out(n, ctx)} = {swiglu_mlp_call(n, ctx)}"]


def _moe(n, ctx):
    if n.attrs["ep"] > 1:
        raise LoweringError(f"node {n.id}: no NPU lowering for expert-parallel MoE (ep={n.attrs['ep']}); "
                            f"use ep: 1 (experts sliced by width) for the npu target")
    return [f"{_out(n, ctx)} = {moe_call(n, ctx, 'torch.zeros_like(' + ctx.ref(n.input('x')) + ')')}"]


def _residual_add(n, ctx):
    return [f"{_out(n, ctx)} = {ctx.ref(n.input('residual'))} + {ctx.ref(n.input('x'))}"]


EMIT_PARALLEL: dict[str, Emitter] = {
    "all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
    "embedding_shard": _embedding_shard,
    "o_proj": _o_proj, "swiglu_mlp": _swiglu_mlp, "moe": _moe, "residual_add": _residual_add,
}
