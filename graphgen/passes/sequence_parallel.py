"""Pass 3 of 8, ``sequence_parallel``: the TP graph -> its sequence-parallel form (``parallel.sp``).

vLLM's ``SequenceParallelismPass``, on graphgen's IR: between two row-parallel reductions the
residual stream and the norms are row-wise, so they need only 1/tp of the step's tokens per rank.

- every ``all_reduce`` of a partial sum (group ``tp``: embedding, o_proj, MLP, MoE) becomes a
  ``reduce_scatter`` along the tokens (dim 0): each rank gets the sum for its 1/tp of the tokens;
- the residual adds and the norms then run on that token shard;
- after each norm an ``all_gather`` (dim 0) restores every token for the column-parallel op that
  reads it (attention prolog, MLP, MoE), and the LM head's input is all-gathered before it (its
  final norm and the ``logits_indices`` rows need every token);
- under DP attention (``dp > 1``) the MoE's reduce-scatter over ``ep`` already leaves each rank 1/tp of
  its DP group's tokens (the same ``ceil(T/tp)`` cut): it stays, and the TP all-gather after it goes (the
  residual add takes the shard); the MoE's DP all-gather reads the TP-gathered norm, as without ``sp``;

so each layer's two all-reduces become two reduce-scatters and two all-gathers (the same bytes on
the wire, the norms and residual adds on 1/tp of the tokens, and 1/tp of the residual stream held).
The runner pads a step's tokens to a multiple of ``tp`` (meta ``sp=true`` says so).

requires: the graph after ``shard`` (meta ``tp`` > 1), no reduce-scatter over tp yet, every all_reduce in group tp.
ensures:  no all_reduce left; the parallel checks (``verify_parallel``: collectives in the order the
          layout asks for, no partial sum or token shard read before its collective) hold.
With ``sp`` false the pass changes nothing. Pure Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..ir.graph import MAIN_STREAM, Graph, Node
from .base import Pass, PassContext
from .shard import EP_GROUP, GROUP

if TYPE_CHECKING:
    from ..modelspec.model import ModelSpec


def _sp(spec: ModelSpec) -> bool:
    return bool(getattr(getattr(spec, "parallel", None), "sp", False))


class SequenceParallel(Pass):
    name = "sequence_parallel"

    def requires(self, graph: Graph, ctx: PassContext) -> list[str]:
        if not _sp(ctx.spec):
            return []
        problems = [] if graph.meta.get("tp", 1) > 1 else ["sequence parallel needs the sharded graph (meta tp > 1)"]
        problems += [f"node {n.id} is already a reduce_scatter over tp" for n in graph.nodes
                     if n.op == "reduce_scatter" and n.attrs.get("group") == GROUP]
        problems += [f"all_reduce {n.id} is in group {n.attrs.get('group')!r}, not {GROUP!r}"
                     for n in graph.nodes if n.op == "all_reduce" and n.attrs.get("group") != GROUP]
        return problems

    def run(self, graph: Graph, ctx: PassContext) -> None:
        if not _sp(ctx.spec):
            return
        tp = graph.meta["tp"]
        graph.meta["sp"] = True
        gather = {"group": GROUP, "size": tp, "dim": 0, "length": None}
        shard: set[str] = set()  # values holding this rank's 1/tp of the tokens
        renamed: dict[str, str] = {}  # a shard -> its all-gathered whole, for the ops that need every token
        out: list[Node] = []

        def all_tokens(name: str, node_id: str, layer: Optional[int]) -> str:
            if name not in renamed:
                whole = graph.declare(f"{name}.all", "value")
                out.append(Node(f"{node_id}.gather_tokens", "all_gather", MAIN_STREAM, reads=(name,), writes=(whole,),
                                attrs=dict(gather), layer=layer))
                renamed[name] = whole
            return renamed[name]

        alias: dict[str, str] = {}  # a dropped TP gather's output -> the shard it gathered
        for n in graph.nodes:
            if alias:
                n = Node(n.id, n.op, n.stream, tuple(alias.get(r, r) for r in n.reads), n.writes, n.attrs, n.layer)
            if n.op == "reduce_scatter" and n.attrs.get("group") == EP_GROUP:  # DP attention's MoE (tp > 1):
                out.append(n)               # each rank gets 1/tp of its DP group's tokens, SP's shard already
                shard.update(n.writes)
                continue
            if n.op == "all_gather" and n.attrs.get("group") == GROUP and n.reads[0] in shard:
                alias[n.writes[0]] = n.reads[0]  # ... so its TP gather goes: the residual add takes the shard
                continue
            if n.op == "all_reduce":
                base = n.id[:-len(".all_reduce")] if n.id.endswith(".all_reduce") else n.id
                out.append(Node(f"{base}.reduce_scatter", "reduce_scatter", n.stream, n.reads, n.writes,
                                {"group": GROUP, "size": tp, "reduce": "sum", "dim": 0}, n.layer))
                shard.update(n.writes)
                continue
            if n.op in ("residual_add", "rms_norm") and any(r in shard for r in n.reads):
                out.append(n)
                shard.update(n.writes)
                if n.op == "rms_norm":  # its reader (a column-parallel op) needs every token
                    all_tokens(n.writes[0], n.id, n.layer)
                continue
            if n.op == "lm_head" and n.input("h") in shard:
                all_tokens(n.input("h"), n.id, n.layer)
            reads = tuple(renamed.get(r, r) for r in n.reads)
            out.append(Node(n.id, n.op, n.stream, reads, n.writes, n.attrs, n.layer))
        graph.replace_nodes(out)

    def ensures(self, graph: Graph, ctx: PassContext) -> list[str]:
        if not _sp(ctx.spec):
            return []
        from .verify_parallel import parallel_problems

        left = [f"all_reduce {n.id} left in a sequence-parallel graph" for n in graph.nodes if n.op == "all_reduce"]
        return left + parallel_problems(graph)
