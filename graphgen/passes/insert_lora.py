"""Pass 1 of 8, `insert_lora` — give the projections an adapter can target their LoRA operands (docs/lora.md).

requires: the forward as the builder makes it: no ``lora_index`` input, no ``lora_slots`` buffer, no node with
          LoRA operands.
ensures:  without a ``lora:`` section the graph is unchanged. With one:
          - input ``lora_index`` (each token's adapter slot; slot 0 is the base model) is declared, and one
            buffer ``lora_slots.<weight>`` per adapted checkpoint weight (`graphgen.lora.lora_weight_keys`:
            the spec's ``lora.targets`` among the dense projections of the decoder layers);
          - every node whose op lists such a weight as a linear layer reads ``lora_index`` and that weight's
            slots (attribute ``lora``: the adapted weight attributes, in the order of the slot buffers;
            ``lora_widths``: (attribute, output width) of each of its linear layers), and
            every adapted weight is read by exactly one node;
          - no node writes a ``lora_slots`` buffer and only the forward stream reads them: the host fills the
            slots between steps (`graphgen.runtime.lora.slots` never overwrites one a running step holds), so
            the race check (``verify``: ``lora_slots`` is a buffer kind) has nothing in a graph to order --
            a node that wrote a slot, on any stream, would be a race or a contract violation here.
          ``meta["lora"]`` records max_loras and max_lora_rank (the slots' shape).
"""

from __future__ import annotations

from ..families import FAMILIES
from ..ir.graph import MAIN_STREAM, Graph, Node
from ..ir.ops import opdef
from ..lora import LORA_INDEX, SLOT_KIND, lora_weight_keys, slot_buffer
from .base import Pass, PassContext


def _lora_operands(node: Node) -> tuple[str, ...]:
    d = opdef(node.op)
    if not any(r.role == "lora" for r in d.inputs):
        return ()
    return tuple(node.input("lora"))


class InsertLora(Pass):
    name = "insert_lora"

    def requires(self, graph: Graph, ctx: PassContext) -> list[str]:
        problems = [f"{name} ({kind}) is declared before LoRA is inserted"
                    for name, kind in graph.names.items() if kind == SLOT_KIND or name == LORA_INDEX]
        problems += [f"node {n.id} has LoRA operands before LoRA is inserted" for n in graph.nodes if _lora_operands(n)]
        return problems

    def run(self, graph: Graph, ctx: PassContext) -> None:
        spec = ctx.spec
        if spec.lora is None or graph.meta.get("mtp_layer") is not None:  # the MTP layer takes no adapter
            return
        keys = lora_weight_keys(spec)
        layout = FAMILIES[spec.family].checkpoint_layout(spec.dims)
        graph.meta["lora"] = {"max_loras": spec.lora.max_loras, "max_lora_rank": spec.lora.max_lora_rank}
        graph.declare(LORA_INDEX, "input")
        nodes = []
        for n in graph.nodes:
            d = opdef(n.op)
            adapted = tuple(w for w in d.linear if n.attrs.get(w) in keys) if any(
                r.role == "lora" for r in d.inputs) else ()
            if not adapted:
                nodes.append(n)
                continue
            bufs = tuple(graph.declare(slot_buffer(n.attrs[w]), SLOT_KIND) for w in adapted)
            # every linear layer's output width, so a target that merges projections (q/k/v, gate/up) knows
            # where each adapted one's columns start
            widths = tuple((w, layout[n.attrs[w]][0]) for w in d.linear if n.attrs.get(w) is not None)
            nodes.append(Node(n.id, n.op, n.stream, (*n.reads, LORA_INDEX, *bufs), n.writes,
                              {**n.attrs, "lora": adapted, "lora_widths": widths}, n.layer))
        graph.replace_nodes(nodes)

    def ensures(self, graph: Graph, ctx: PassContext) -> list[str]:
        spec = ctx.spec
        problems = []
        if spec.lora is None or graph.meta.get("mtp_layer") is not None:
            if LORA_INDEX in graph.names or any(_lora_operands(n) for n in graph.nodes):
                problems.append("a graph without LoRA got LoRA operands")
            return problems
        want = {slot_buffer(k) for k in lora_weight_keys(spec)}
        readers: dict[str, list[str]] = {}
        for n in graph.nodes:
            ops = _lora_operands(n)
            if ops:
                adapted = tuple(n.attrs.get("lora") or ())
                if ops[0] != LORA_INDEX or len(ops) != len(adapted) + 1:
                    problems.append(f"node {n.id}: LoRA operands {ops} do not match its lora attribute {adapted}")
                for w, buf in zip(adapted, ops[1:]):
                    if buf != slot_buffer(n.attrs[w]):
                        problems.append(f"node {n.id}: {w} reads slots {buf}, not {slot_buffer(n.attrs[w])}")
                    readers.setdefault(buf, []).append(n.id)
                if n.stream != MAIN_STREAM:
                    problems.append(f"node {n.id} reads LoRA slots on {n.stream}, not {MAIN_STREAM}")
            for w in n.writes:
                if graph.names.get(w) == SLOT_KIND:
                    problems.append(f"node {n.id} writes LoRA slots {w}: only the host fills them, between steps")
        for buf in sorted(want):
            if len(readers.get(buf, ())) != 1:
                problems.append(f"{buf} is read by {len(readers.get(buf, ()))} node(s), expected 1")
        extra = sorted(set(readers) - want)
        if extra:
            problems.append(f"slots of weights that take no adapter are read: {', '.join(extra)}")
        return problems
