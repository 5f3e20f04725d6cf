"""Pass 2 of 8, ``shard``: the single-device forward -> the graph every tensor/expert-parallel rank runs.

Megatron-style and op-level (no family names: what a family splits is ``graphgen.families.parallel``):

- q/k/v (and MLA's ``q_b``, ``kv_b``) and gate/up are **column-parallel**: each rank holds a slice
  of the output rows, so heads and MLP width are divided by ``tp``; KV heads are replicated when
  ``tp`` exceeds them; the MLA latent (``kv_a``) is replicated (the same on every rank);
- o_proj and down are **row-parallel**: each rank's product is a partial sum, followed by an
  ``all_reduce`` and then the residual add (the fused ``*_residual`` ops become ``o_proj`` /
  ``swiglu_mlp`` / ``moe`` + ``all_reduce`` + ``residual_add``);
- the embedding is **vocab-parallel** (masked lookup + all_reduce) and the LM head computes local
  logits, then an ``all_gather`` over the vocabulary;
- MoE: ``ep > 1`` (= tp) gives each rank ``num_experts/ep`` whole experts, run for all tokens with
  the replicated routing, the reduction being the same all_reduce; ``ep == 1`` slices every expert's
  width like an MLP;
- DP attention (``dp > 1``, ``ep = dp × tp``): attention, dense MLPs, embedding and LM head are split
  over the ``tp`` ranks of one DP group as above (not at all when ``tp == 1``); each MoE all-gathers the
  tokens of every DP group (group ``dp``), runs the rank's ``num_experts/ep`` experts and ``1/ep`` of the
  shared experts' width on all of them, reduce-scatters the partial sums over group ``ep`` and
  all-gathers the rank's own group's tokens over ``tp`` (the runner pads every DP group's step to the
  same token count, a multiple of ``tp``; an idle group runs a dummy step).
  (An all-to-all dispatch would send each token only to the ranks of its top-k experts: less expert
  compute per rank for large batches, at the price of two all-to-alls.)

Sharded weights are named by their slice: ``<checkpoint key>[d<dim>/<parts>]`` is the checkpoint
tensor cut along ``dim`` into ``parts`` equal chunks (the last zero-padded when it does not divide),
of which rank ``r`` of ``tp`` holds chunk ``r * parts // tp`` (for expert weights under DP attention,
``r = dp_rank × tp + tp_rank`` of ``ep``). Nothing in the graph depends on the
rank: every rank runs the same graph (rank-symmetric by construction; ``verify_parallel`` checks it).
With ``tp == ep == dp == 1`` the pass changes nothing. Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from ..families import FAMILIES
from ..families.parallel import PLANS
from ..ir.graph import MAIN_STREAM, Graph, Node
from ..ir.ops import check_node
from ..ir.weights import parse_shard, shard_index, shard_name  # noqa: F401  (the pass names sharded weights)
from .base import Pass, PassContext

if TYPE_CHECKING:
    from ..modelspec.model import ModelSpec

GROUP = "tp"  # the TP group (EP reuses it when dp == 1)
DP_GROUP = "dp"  # the ranks with the same TP rank in every DP group (the MoE's token all-gather)
EP_GROUP = "ep"  # every rank of the DP groups (dp × tp): the MoE's experts under DP attention


def parallel_of(spec: ModelSpec) -> tuple[int, int]:
    par = getattr(spec, "parallel", None)
    return (par.tp, par.ep) if par is not None else (1, 1)


def dp_of(spec: ModelSpec) -> int:
    par = getattr(spec, "parallel", None)
    return getattr(par, "dp", 1) if par is not None else 1


class Shard(Pass):
    name = "shard"

    def requires(self, graph: Graph, ctx: PassContext) -> list[str]:
        tp, ep = parallel_of(ctx.spec)
        problems = [f"node {n.id} ({n.op}) is already a parallel op" for n in graph.nodes
                    if n.op in ("all_reduce", "all_gather", "embedding_shard", "residual_add")]
        if tp > 1 and graph.meta["family"] not in PLANS:
            problems.append(f"family {graph.meta['family']} has no parallel plan")
        return problems

    def run(self, graph: Graph, ctx: PassContext) -> None:
        tp, ep = parallel_of(ctx.spec)
        dp = dp_of(ctx.spec)
        if tp == 1 and ep == 1 and dp == 1:
            return
        family = FAMILIES[graph.meta["family"]]
        plan = PLANS[family.name]
        dims = family.dims_of(ctx.spec.dims)
        kv_parts = min(tp, getattr(dims, plan.kv_heads)) if plan.kv_heads else 1
        graph.meta.update({"tp": tp, "ep": ep, **({"dp": dp} if dp > 1 else {})})
        ranks = _RankGraph(graph, tp, ep, dp, dims, family.kv_widths(plan.rank_dims(dims, tp)), kv_parts)
        for n in graph.nodes:
            ranks.shard(n)
        graph.replace_nodes(ranks.out)

    def ensures(self, graph: Graph, ctx: PassContext) -> list[str]:
        from .verify_parallel import parallel_problems

        tp, ep = parallel_of(ctx.spec)
        if tp == 1 and ep == 1 and dp_of(ctx.spec) == 1:
            return [f"node {n.id} ({n.op}) in a single-rank graph" for n in graph.nodes
                    if n.op in ("all_reduce", "all_gather", "reduce_scatter", "embedding_shard")]
        return parallel_problems(graph)


@dataclass
class _RankGraph:
    """The rank graph being built by one `Shard.run`: the layout, the family's dims (``dims``: whole,
    ``widths``: one rank's KV components), how many ways the KV heads split, and the nodes so far."""

    graph: Graph
    tp: int
    ep: int
    dp: int
    dims: Any
    widths: Any
    kv_parts: int
    out: list[Node] = field(default_factory=list)

    @property
    def coll(self) -> dict[str, Any]:
        return {"group": GROUP, "size": self.tp}

    def col(self, w: str) -> str:
        return shard_name(w, 0, self.tp)  # output rows split

    def row(self, w: str) -> str:
        return shard_name(w, 1, self.tp)  # input columns split

    def new(self, node: Node) -> Node:
        problems = check_node(node, self.graph.names)
        if problems:
            raise ValueError("; ".join(problems))
        self.out.append(node)
        return node

    def shard(self, n: Node) -> None:
        """Emit ``n`` as every rank runs it: unchanged, with rank-local attributes, or split into
        a partial op and its collective."""
        a = dict(n.attrs)
        if n.op == "moe_residual" and self.dp > 1:
            self.dp_moe(n, a)
        elif self.tp == 1:  # pure DP attention: only the MoE crosses ranks
            self.new(Node(n.id, n.op, n.stream, n.reads, n.writes, a, n.layer))
        elif n.op in self._SPLIT:
            self._SPLIT[n.op](self, n, a)
        else:
            self.local_attrs(n.op, a)
            self.new(Node(n.id, n.op, n.stream, n.reads, n.writes, a, n.layer))

    def local_attrs(self, op: str, a: dict[str, Any]) -> None:
        """The attributes of an op that runs on every rank as it is, on its slice (heads, KV widths)."""
        tp, widths = self.tp, self.widths
        if op == "qwen3_attn_prolog":
            a.update(w_q=self.col(a["w_q"]), w_k=shard_name(a["w_k"], 0, self.kv_parts),
                     w_v=shard_name(a["w_v"], 0, self.kv_parts), num_heads=a["num_heads"] // tp,
                     num_kv_heads=max(1, a["num_kv_heads"] // tp))
        elif op == "paged_attention":
            a.update(num_heads=a["num_heads"] // tp, num_kv_heads=max(1, a["num_kv_heads"] // tp), widths=widths)
        elif op == "kv_write":
            a.update(widths=widths)
        elif op == "mla_prolog":
            a.update(w_q_b=self.col(a["w_q_b"]), num_heads=a["num_heads"] // tp)
        elif op == "mla_attention":
            a.update(w_kv_b=self.col(a["w_kv_b"]), num_heads=a["num_heads"] // tp, widths=widths)

    def embedding(self, n: Node, a: dict[str, Any]) -> None:
        """Vocab-parallel: a masked lookup of this rank's rows, summed over the ranks."""
        h = n.writes[0]
        partial = self.graph.declare(f"{h}.partial", "value")
        self.new(Node(n.id, "embedding_shard", MAIN_STREAM, reads=n.reads, writes=(partial,),
                      attrs={"w_embed": self.col(a["w_embed"]), "vocab_size": self.dims.vocab_size, **self.coll}))
        self.new(Node(f"{n.id}.all_reduce", "all_reduce", MAIN_STREAM, reads=(partial,), writes=(h,),
                      attrs={**self.coll, "reduce": "sum"}))

    def o_proj(self, n: Node, a: dict[str, Any]) -> None:
        self.reduce_then(n, "o_proj", (n.input("attn"),), {"w_o": self.row(a["w_o"])}, n.input("residual"))

    def swiglu_mlp(self, n: Node, a: dict[str, Any]) -> None:
        self.reduce_then(n, "swiglu_mlp", (n.input("x"),), {"w_gate": self.col(a["w_gate"]), "w_up": self.col(a["w_up"]),
                                                           "w_down": self.row(a["w_down"])}, n.input("residual"))

    def moe(self, n: Node, a: dict[str, Any]) -> None:
        ep, tp = self.ep, self.tp
        if ep > 1:  # whole experts per rank: stacked [E, ...] cut along the experts
            experts = {k: shard_name(a[k], 0, ep) for k in
                       ("w_experts_gate", "w_experts_up", "w_experts_down")}
        else:  # every expert's width: gate/up [E, I, H] rows, down [E, H, I] columns
            experts = {"w_experts_gate": shard_name(a["w_experts_gate"], 1, tp),
                       "w_experts_up": shard_name(a["w_experts_up"], 1, tp),
                       "w_experts_down": shard_name(a["w_experts_down"], 2, tp)}
        shared = {k: (None if a.get(k) is None else f(a[k])) for k, f in
                  (("w_shared_gate", self.col), ("w_shared_up", self.col), ("w_shared_down", self.row))}
        self.reduce_then(n, "moe", (n.input("x"),), {**a, **experts, **shared, "ep": ep}, n.input("residual"))

    def lm_head(self, n: Node, a: dict[str, Any]) -> None:
        """Local logits of this rank's vocabulary slice, gathered over the vocabulary."""
        logits = n.writes[0]
        partial = self.graph.declare(f"{logits}.partial", "value")
        self.new(Node(n.id, "lm_head", MAIN_STREAM, reads=n.reads, writes=(partial,),
                      attrs={**a, "w_head": self.col(a["w_head"])}))
        self.new(Node(f"{n.id}.all_gather", "all_gather", MAIN_STREAM, reads=(partial,), writes=(logits,),
                      attrs={**self.coll, "dim": -1, "length": self.dims.vocab_size}))

    # the ops a rank cannot run alone: split into a partial op and a collective
    _SPLIT: ClassVar[dict[str, Callable[[_RankGraph, Node, dict[str, Any]], None]]] = {
        "embedding": embedding, "o_proj_residual": o_proj, "swiglu_mlp_residual": swiglu_mlp,
        "moe_residual": moe, "lm_head": lm_head}

    def reduce_then(self, n: Node, partial_op: str, x_reads: tuple[str, ...], attrs: dict[str, Any],
                    residual: str) -> None:
        """A row-parallel fused ``*_residual`` op: its partial product, the sum over ranks, the residual add."""
        graph, h = self.graph, n.writes[0]
        partial, total = graph.declare(f"{h}.partial", "value"), graph.declare(f"{h}.sum", "value")
        self.new(Node(n.id, partial_op, MAIN_STREAM, reads=x_reads, writes=(partial,), attrs=attrs, layer=n.layer))
        self.new(Node(f"{n.id}.all_reduce", "all_reduce", MAIN_STREAM, reads=(partial,), writes=(total,),
                      attrs={**self.coll, "reduce": "sum"}, layer=n.layer))
        self.new(Node(f"{n.id}.residual", "residual_add", MAIN_STREAM, reads=(total, residual), writes=(h,),
                      layer=n.layer))

    def dp_moe(self, n: Node, a: dict[str, Any]) -> None:
        """DP attention + EP: gather every DP group's tokens, run this rank's experts (and its width
        slice of the shared experts) on all of them, reduce-scatter the partial sums over the EP group
        (each rank gets 1/tp of its own group's tokens), all-gather them inside the TP group."""
        graph, tp, ep = self.graph, self.tp, self.ep
        h, x = n.writes[0], n.input("x")
        gathered, partial = graph.declare(f"{h}.dp_tokens", "value"), graph.declare(f"{h}.partial", "value")
        mine = graph.declare(f"{h}.sum" if tp == 1 else f"{h}.tp_tokens", "value")
        self.new(Node(f"{n.id}.dp_gather", "all_gather", MAIN_STREAM, reads=(x,), writes=(gathered,),
                      attrs={"group": DP_GROUP, "size": self.dp, "dim": 0, "length": None}, layer=n.layer))
        experts = {k: shard_name(a[k], 0, ep) for k in ("w_experts_gate", "w_experts_up", "w_experts_down")}
        shared = {k: (None if a.get(k) is None else shard_name(a[k], d, ep)) for k, d in
                  (("w_shared_gate", 0), ("w_shared_up", 0), ("w_shared_down", 1))}
        self.new(Node(n.id, "moe", MAIN_STREAM, reads=(gathered,), writes=(partial,),
                      attrs={**a, **experts, **shared, "ep": ep}, layer=n.layer))
        self.new(Node(f"{n.id}.reduce_scatter", "reduce_scatter", MAIN_STREAM, reads=(partial,), writes=(mine,),
                      attrs={"group": EP_GROUP, "size": ep, "reduce": "sum", "dim": 0}, layer=n.layer))
        total = mine
        if tp > 1:
            total = graph.declare(f"{h}.sum", "value")
            self.new(Node(f"{n.id}.tp_gather", "all_gather", MAIN_STREAM, reads=(mine,), writes=(total,),
                          attrs={**self.coll, "dim": 0, "length": None}, layer=n.layer))
        self.new(Node(f"{n.id}.residual", "residual_add", MAIN_STREAM, reads=(total, n.input("residual")),
                      writes=(h,), layer=n.layer))
