"""The graph IR: nodes with stable ids, a stream each, and the names they read and write.

A :class:`Graph` is an ordered list of :class:`Node` (the *issue order*: the order a host would
enqueue the work; per stream it is that stream's program order) plus declarations of streams,
names and events. Edges are never hand-wired: :meth:`Graph.to_networkx` derives them

- **data edges** from *values* (SSA activations: one writer; readers depend on it),
- **program order** between consecutive nodes of the same stream,
- **event edges** from each ``record`` of an event to every ``wait`` on it.

*Buffers* (``kv_cache.Lxx``, ``pool_staging.Lxx``, ``pool_load.Lxx``) are mutable memory shared by streams; accessing
one creates no edge, so cross-stream accesses are ordered only by program order and events — which
is exactly what the verifier checks. ``pool_load.Lxx`` (the history blocks a prefill loads from
the pool) is filled by the host before the graph starts, like an input, and only read in the graph.
*Inputs* (``input_ids``, ``slot_mapping``…) are written by the
host before the graph starts and are readable from any stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

import networkx as nx

from .ops import check_node, opdef

# Stream names: the forward stream, the save stream (async writes), the load stream (history blocks
# from the pool into the cache) and the host (pool commit).
MAIN_STREAM = "main"
SAVE_STREAM = "kv_save"
LOAD_STREAM = "kv_load"
HOST_STREAM = "host"

# Per-step inputs the host fills before a graph runs (the runners build them from the step plan).
STEP_INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_lens",
               "logits_indices")
SAVE_INPUTS = ("save_block_ids",)
# The last hidden state (after the final norm) a graph of a spec with MTP layers also returns, and
# the MTP graph's input of the previous one (graphgen.families.mtp; docs/mtp.md).
HIDDEN = "hidden"
PREV_HIDDEN = "prev_hidden"
LOAD_INPUTS = ("load_block_ids",)

# lora_slots.<weight>: one projection's LoRA adapter slots, filled by the host between steps (the
# ``insert_lora`` pass; graphgen.lora): only read in a graph, and covered by the race check like every buffer
NAME_KINDS = ("input", "value", "kv_cache", "pool_staging", "pool_load", "lora_slots")
BUFFER_KINDS = ("kv_cache", "pool_staging", "pool_load", "lora_slots")
SYNC_OPS = ("record", "wait")


@dataclass(eq=False)  # identity equality: list.index() on nodes stays a fast C-level scan
class Node:
    id: str
    op: str
    stream: str
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    attrs: dict[str, Any] = field(default_factory=dict)
    layer: Optional[int] = None

    @property
    def event(self) -> str:
        """The event a ``record``/``wait`` node names ("" when it names none: its schema check reports
        that); ValueError on a node of any other op, which has no event."""
        if self.op not in SYNC_OPS:
            raise ValueError(f"node {self.id} ({self.op}) is no record or wait: it has no event")
        return str(self.attrs.get("event", ""))

    # Any: a name, or a tuple of names for a variadic role; the caller knows which from the op's schema.
    def input(self, role: str) -> Any:
        """The name(s) read in ``role`` (see :mod:`graphgen.ir.ops`); a tuple for a variadic role."""
        return self._bound("inputs", self.reads)[role]

    def output(self, role: str) -> Any:
        """The name(s) written in ``role``; a tuple for a variadic role."""
        return self._bound("outputs", self.writes)[role]

    def _bound(self, side: str, names: tuple[str, ...]) -> dict[str, Union[str, tuple[str, ...]]]:
        return opdef(self.op).bind(tuple(names), side)


class IRError(Exception):
    """A structural problem in a graph (unknown stream/name, duplicate id, ...)."""


@dataclass
class Graph:
    name: str  # "<model>.<variant>"
    meta: dict[str, Any] = field(default_factory=dict)
    streams: list[str] = field(default_factory=lambda: [MAIN_STREAM])
    names: dict[str, str] = field(default_factory=dict)  # name -> kind
    events: dict[str, tuple[str, str]] = field(default_factory=dict)  # event -> (from stream, to stream)
    nodes: list[Node] = field(default_factory=list)
    _by_id: dict[str, Node] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_id = {n.id: n for n in self.nodes}

    # ---- construction -------------------------------------------------------------------------
    def declare(self, name: str, kind: str) -> str:
        if kind not in NAME_KINDS:
            raise IRError(f"unknown kind {kind!r} for {name!r}")
        old = self.names.get(name)
        if old is not None and old != kind:
            raise IRError(f"{name!r} declared as {old} and as {kind}")
        self.names[name] = kind
        return name

    def add_stream(self, stream: str) -> None:
        if stream not in self.streams:
            self.streams.append(stream)

    def _admit(self, node: Node) -> None:
        if node.id in self._by_id:
            raise IRError(f"duplicate node id {node.id!r}")
        for name in (*node.reads, *node.writes):
            if name not in self.names:
                raise IRError(f"node {node.id!r} uses undeclared name {name!r}")
        if node.stream not in self.streams:
            raise IRError(f"node {node.id!r} is on undeclared stream {node.stream!r}")
        # Only nodes that match their op's schema enter a graph (O(operands + attrs) per node), so
        # lowering can bind operands by role; the verifier re-checks graphs edited by other means.
        problems = check_node(node, self.names)
        if problems:
            raise IRError("; ".join(problems))

    def splice(self, *, before: Optional[dict[str, list[Node]]] = None,
               after: Optional[dict[str, list[Node]]] = None) -> None:
        """Insert many nodes right before/after existing ones in one linear pass (passes use this:
        one positional insert per node would make them quadratic in the number of layers)."""
        before, after = before or {}, after or {}
        for anchor in (*before, *after):
            self.node(anchor)
        new = [*(x for xs in before.values() for x in xs), *(x for xs in after.values() for x in xs)]
        ids: set[str] = set()
        for n in new:  # admit all before changing anything: a rejected node leaves the graph as it was
            self._admit(n)
            if n.id in ids:
                raise IRError(f"duplicate node id {n.id!r}")
            ids.add(n.id)
        for n in new:
            self._by_id[n.id] = n
        out: list[Node] = []
        for n in self.nodes:
            out.extend(before.get(n.id, ()))
            out.append(n)
            out.extend(after.get(n.id, ()))
        self.nodes = out

    def add(self, node: Node, *, after: Optional[str] = None, before: Optional[str] = None) -> Node:
        """Append ``node`` (or insert it right after/before the node with the given id)."""
        self._admit(node)
        if after is not None:
            self.nodes.insert(self.index(after) + 1, node)
        elif before is not None:
            self.nodes.insert(self.index(before), node)
        else:
            self.nodes.append(node)
        self._by_id[node.id] = node
        return node

    def replace_nodes(self, nodes: Iterable[Node]) -> None:
        """Make ``nodes`` (in order) the graph's nodes, each admitted as :meth:`add` admits one (a
        pass that rebuilds the whole node list uses this); a rejected node leaves the graph as it was."""
        kept = self.nodes, self._by_id
        self.nodes, self._by_id = [], {}
        try:
            for n in nodes:
                self.add(n)
        except IRError:
            self.nodes, self._by_id = kept
            raise

    def index(self, node_id: str) -> int:
        return self.nodes.index(self.node(node_id))

    def node(self, node_id: str) -> Node:
        try:
            return self._by_id[node_id]
        except KeyError:
            raise IRError(f"no node {node_id!r}") from None

    def on_stream(self, stream: str) -> list[Node]:
        return [n for n in self.nodes if n.stream == stream]

    def copy(self) -> "Graph":
        return Graph(
            name=self.name,
            meta=dict(self.meta),
            streams=list(self.streams),
            names=dict(self.names),
            events=dict(self.events),
            nodes=[Node(n.id, n.op, n.stream, n.reads, n.writes, dict(n.attrs), n.layer) for n in self.nodes],
        )

    # ---- derived structure ----------------------------------------------------------------------
    def to_networkx(self) -> nx.DiGraph[str]:
        """Happens-before graph: data edges ∪ per-stream program order ∪ record→wait edges.

        Edge attribute ``kind`` is ``data``, ``program`` or ``event``.
        """
        g: nx.DiGraph[str] = nx.DiGraph()  # node ids
        for i, n in enumerate(self.nodes):
            g.add_node(n.id, index=i, stream=n.stream, op=n.op)
        last_on_stream: dict[str, str] = {}
        writer_of: dict[str, str] = {}
        records: dict[str, list[str]] = {}
        waits: dict[str, list[str]] = {}
        for n in self.nodes:
            prev = last_on_stream.get(n.stream)
            if prev is not None:
                g.add_edge(prev, n.id, kind="program")
            last_on_stream[n.stream] = n.id
            for r in n.reads:
                if self.names.get(r) == "value" and r in writer_of:
                    g.add_edge(writer_of[r], n.id, kind="data", name=r)
            for w in n.writes:
                if self.names.get(w) == "value":
                    writer_of[w] = n.id
            if n.op == "record":
                records.setdefault(n.event, []).append(n.id)
            elif n.op == "wait":
                waits.setdefault(n.event, []).append(n.id)
        for ev, recs in records.items():
            for r in recs:
                for w in waits.get(ev, ()):
                    g.add_edge(r, w, kind="event", event=ev)
        return g


def layer_tag(layer: int, num_layers: int) -> str:
    """``L03``: zero-padded so ids sort in layer order for any model size."""
    width = max(2, len(str(num_layers - 1)))
    return f"L{layer:0{width}d}"


def layer_tags(graph: "Graph") -> list[str]:
    """Every layer's tag of a built graph (``meta["layers"]`` layers), in layer order; an MTP graph
    (``meta["mtp_layer"]``, graphgen.families.mtp) holds that one layer, numbered after the decoder layers."""
    n = graph.meta["layers"]
    if graph.meta.get("mtp_layer") is not None:
        return [layer_tag(graph.meta["mtp_layer"], n)]
    return [layer_tag(i, n) for i in range(n)]


def saved_layer_tags(graph: "Graph") -> list[str]:
    """The layers a graph's save copies: its own, and for an MTP graph every layer up to its own --
    the MTP graph is the last to write a block's KV, so it saves the whole block (one pool object
    holds every layer, docs/mtp.md)."""
    if graph.meta.get("mtp_layer") is not None:
        return [layer_tag(i, graph.meta["layers"]) for i in range(graph.meta["mtp_layer"] + 1)]
    return layer_tags(graph)

