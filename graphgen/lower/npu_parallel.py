"""NPU emitters of the parallel-rank ops (``graphgen.passes.shard``, ``sequence_parallel``), merged into ``npu.EMIT``.

Collectives are torch.distributed *functional* collectives, spelled as the ops they trace to
(``torch.ops._c10d_functional.all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` +
``wait_tensor``, what ``torch.distributed._functional_collectives`` emits): torchair converts each to an
HCCL collective inside the captured graph (every one has a real GE converter, ``ge_converters.json``).
They are torch ops, not torch-npu ones, so the torch-npu manifest does not list them; the tests check
them against the installed torch's op registry.

Groups: a collective whose group spans every rank (the TP group when ``dp = cp = 1``; the EP group under
DP attention) runs on the world group, ``torch.distributed.group.WORLD.group_name``; any other (the TP and
DP groups under DP attention) on ``PROCESS_GROUPS['<group>']``, a module-level dict of HCCL group names
that ``graphgen.npu.run.groups.bind_process_groups`` fills on each rank before the first call (docs/npu.md,
"Process groups under DP attention"). The rank (vocabulary slice of the embedding, a rank's experts) is
``torch.distributed.get_rank()``, a constant when each rank traces its own graph.

Token collectives (sequence parallel's reduce-scatter and all-gather around the norms; DP attention's
MoE gathers) cut dim 0 into equal shards, so every step's token count must be a multiple of the group
size (``tp``): the NPU runner pads every call to a bucket that is (``Buckets.from_spec`` keeps only those under
sequence parallel and DP attention at tp > 1), unlike the CPU ranks, which take short shards. Context parallel's
KV gather (group ``cp``, before each prefill layer's KV write) is the same token all-gather: every CP rank runs
each prefill call padded to one bucket (the runner pads its head-tail pieces to the largest rank's,
`graphgen.npu.run.context_parallel`), so the gathered rows are every rank's padded tokens, rank-major, and the
step's ``kv_index`` lists their slots in that order (padding rows: the pad block).

Expert-parallel MoE (``ep > 1``): the rank's ``E/ep`` experts through ``npu_moe_init_routing_v2``'s
``active_expert_range`` (``_moe_residual(..., ep=, ep_rank=)``), a partial sum like the TP-sliced MoE
(``ep == 1``: every expert's width slice, the single-device chain with a zero residual).
"""

from __future__ import annotations

from typing import Iterable

from ..ir.graph import Node
from .npu_calls import moe_call, o_proj_call, swiglu_mlp_call
from .render import Emitter, LoweringError, RankEmitContext, weight

WORLD_GROUP = "torch.distributed.group.WORLD.group_name"
PROCESS_GROUPS = "PROCESS_GROUPS"  # the generated module's dict: group kind -> HCCL group name


def _out(n: Node, ctx: RankEmitContext) -> str:
    return ctx.ref.all(n.writes)


def named_groups(nodes: Iterable[Node], world: int) -> list[str]:
    """The groups the module's collectives need by name (every group not spanning the ``world``), sorted."""
    return sorted({n.attrs["group"] for n in nodes if n.op in COLLECTIVES and n.attrs["size"] != world})


def _group(n: Node, ctx: RankEmitContext) -> str:
    a = n.attrs
    return WORLD_GROUP if a["size"] == ctx.world else f"{PROCESS_GROUPS}[{a['group']!r}]"


def _wait(call: str) -> str:
    return f"torch.ops._c10d_functional.wait_tensor({call})"


def _all_reduce(n: Node, ctx: RankEmitContext) -> list[str]:
    if n.attrs["reduce"] != "sum":
        raise LoweringError(f"node {n.id}: no NPU lowering for all_reduce {n.attrs['reduce']!r}")
    x = ctx.ref(n.input("x"))
    call = f"torch.ops._c10d_functional.all_reduce({x}, 'sum', {_group(n, ctx)})"
    return [f"{_out(n, ctx)} = {_wait(call)}"]


def _token_dim(n: Node) -> None:
    if n.attrs["dim"] != 0:
        raise LoweringError(f"node {n.id}: {n.op} over the tokens must cut dim 0, got dim {n.attrs['dim']}")


def _reduce_scatter(n: Node, ctx: RankEmitContext) -> list[str]:
    """Rank i of the group gets rows [i*T/size, (i+1)*T/size) of the sum (reduce_scatter_tensor, dim 0)."""
    a, x = n.attrs, ctx.ref(n.input("x"))
    _token_dim(n)
    if a["reduce"] != "sum":
        raise LoweringError(f"node {n.id}: no NPU lowering for reduce_scatter {a['reduce']!r}")
    call = f"torch.ops._c10d_functional.reduce_scatter_tensor({x}.contiguous(), 'sum', {a['size']}, {_group(n, ctx)})"
    return [f"{_out(n, ctx)} = {_wait(call)}"]


def _all_gather(n: Node, ctx: RankEmitContext) -> list[str]:
    a, x = n.attrs, ctx.ref(n.input("x"))
    call = f"torch.ops._c10d_functional.all_gather_into_tensor({x}.contiguous(), {a['size']}, {_group(n, ctx)})"
    gathered = _wait(call)
    if a["length"] is None:  # the tokens: the group's equal shards, rank-major along dim 0
        _token_dim(n)
        return [f"{_out(n, ctx)} = {gathered}"]
    # gathered along dim 0 (rank-major), then moved to the attribute's dim and cut to its length
    return [f"{_out(n, ctx)} = torch.cat({gathered}.chunk({a['size']}, dim=0), dim={a['dim']})"
            f".narrow({a['dim']}, 0, {a['length']})"]


def _embedding_shard(n: Node, ctx: RankEmitContext) -> list[str]:
    w, ids = weight(n, "w_embed"), ctx.ref(n.input("input_ids"))
    # the vocabulary slice of this rank's TP rank (= the world rank % tp: TP is innermost, docs/parallel.md)
    return [f"_ids = {ids} - torch.distributed.get_rank() % {ctx.tp} * {w}.shape[0]",
            f"{_out(n, ctx)} = F.embedding(_ids.clamp(0, {w}.shape[0] - 1), {w}) * "
            f"((_ids >= 0) & (_ids < {w}.shape[0])).unsqueeze(-1).to({w}.dtype)"]


def _o_proj(n: Node, ctx: RankEmitContext) -> list[str]:
    return [f"{_out(n, ctx)} = {o_proj_call(n, ctx)}"]


def _swiglu_mlp(n: Node, ctx: RankEmitContext) -> list[str]:
    return [f"{_out(n, ctx)} = {swiglu_mlp_call(n, ctx)}"]


def _moe(n: Node, ctx: RankEmitContext) -> list[str]:
    a, x = n.attrs, ctx.ref(n.input("x"))
    ep = [f"ep={a['ep']}", f"ep_rank=torch.distributed.get_rank() % {a['ep']}"] if a["ep"] > 1 else []
    return [f"{_out(n, ctx)} = {moe_call(n, ctx, 'torch.zeros_like(' + x + ')', *ep)}"]


def _residual_add(n: Node, ctx: RankEmitContext) -> list[str]:
    return [f"{_out(n, ctx)} = {ctx.ref(n.input('residual'))} + {ctx.ref(n.input('x'))}"]


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
EMIT_PARALLEL: dict[str, Emitter] = {
    "all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
    "embedding_shard": _embedding_shard,
    "o_proj": _o_proj, "swiglu_mlp": _swiglu_mlp, "moe": _moe, "residual_add": _residual_add,
}
