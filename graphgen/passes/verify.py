"""Pass 8 of 8, `verify` — prove the schedule has no race, and that every event is used correctly.

requires: any graph (also one parsed from a hand-edited golden file).
ensures:  raises :class:`VerificationError` listing *every* problem found:
  - schemas: every node against its op's schema (:func:`graphgen.ir.ops.check_node`: arity,
    operand kinds, required and unknown attributes) — a graph built through ``Graph.add`` cannot
    fail this, one edited by other means can;
  - structure: unknown streams, events declared with other streams than the nodes using them,
    sync nodes without an event, values written twice, values read on another stream than the one
    that wrote them (values cannot cross streams; use a buffer and an event), values read before
    being written;
  - events: a wait with no record (it would block forever, or — as in the seed's misspelt key —
    silently pass), a record nobody waits on (a missing wait);
  - cycles in happens-before (a deadlock), named node by node;
  - races: two accesses to the same buffer from different streams, at least one a write, with no
    happens-before path between them. Happens-before = data edges ∪ per-stream program order ∪
    record→wait. The message names both nodes and the missing event.

Linear time: one topological order (issue order when it is one), then vector clocks (one entry per stream) and, per buffer and
stream, only the last read and last write (FastTrack-style): program order makes earlier accesses
of the same stream covered by the last one.
"""

from __future__ import annotations

from typing import Optional

import networkx as nx

from ..ir.graph import BUFFER_KINDS, Graph
from ..ir.ops import COLLECTIVE_OPS, check_node
from .base import Pass, PassContext
from .verify_parallel import parallel_problems


class VerificationError(Exception):
    def __init__(self, graph_name: str, problems: list[str]):
        self.graph_name, self.problems = graph_name, problems
        super().__init__(f"{graph_name}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


def check(graph: Graph) -> list[str]:
    problems: list[str] = []
    streams = set(graph.streams)
    writer: dict[str, str] = {}
    writer_stream: dict[str, str] = {}
    records: dict[str, list[str]] = {}
    waits: dict[str, list[str]] = {}
    for n in graph.nodes:
        problems.extend(check_node(n, graph.names))
        if n.stream not in streams:
            problems.append(f"node {n.id} is on undeclared stream '{n.stream}'")
        for r in n.reads:
            if graph.names.get(r) != "value":
                continue
            if r not in writer:
                problems.append(f"node {n.id} reads value {r} before any node writes it")
            elif writer_stream[r] != n.stream:
                problems.append(f"value {r} crosses streams ({writer[r]} on {writer_stream[r]} -> {n.id} on "
                                f"{n.stream}); pass data between streams through a buffer and an event")
        for w in n.writes:
            if graph.names.get(w) == "value":
                if w in writer:
                    problems.append(f"value {w} is written twice ({writer[w]} and {n.id})")
                writer[w], writer_stream[w] = n.id, n.stream
        if n.op in ("record", "wait"):
            ev = n.attrs.get("event")
            if not ev:
                problems.append(f"{n.op} node {n.id} names no event")
                continue
            decl = graph.events.get(ev)
            if decl is None:
                problems.append(f"{n.op} node {n.id} uses undeclared event {ev}")
            else:
                side = decl[0] if n.op == "record" else decl[1]
                if n.stream != side:
                    problems.append(f"{n.op} of {ev} is on stream {n.stream}, but {ev} is declared "
                                    f"{decl[0]}->{decl[1]}")
            (records if n.op == "record" else waits).setdefault(ev, []).append(n.id)
    for ev in graph.events:
        if ev not in records and ev not in waits:
            problems.append(f"event {ev} is declared but never recorded or waited on")
    for ev, ws in waits.items():
        if ev not in records:
            problems.append(f"wait {', '.join(ws)} on {ev} has no record: nothing ever signals it "
                            f"(dangling wait; restore the record of {ev})")
    for ev, rs in records.items():
        if ev not in waits:
            problems.append(f"record {', '.join(rs)} of {ev} has no wait: nobody waits on it "
                            f"(dangling record; a consumer of what it guards is unordered)")
    hb = graph.to_networkx()
    index = {n.id: i for i, n in enumerate(graph.nodes)}
    try:
        # Vector clocks accept any topological order; issue order is one for every graph graphgen
        # generates (checked in O(E)), and it orients race reports the way a reader expects
        # (producer first). Otherwise fall back to a sort that stays as close to issue order as it can.
        if all(index[u] < index[v] for u, v in hb.edges):
            order = [n.id for n in graph.nodes]
        else:
            order = list(nx.lexicographical_topological_sort(hb, key=index.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(hb)
        path = " -> ".join(u for u, _ in cycle) + f" -> {cycle[0][0]}"
        problems.append(f"happens-before has a cycle (deadlock): {path}")
        return problems
    problems.extend(_races(graph, hb, order))
    if "tp" in graph.meta or "cp" in graph.meta or any(n.op in COLLECTIVE_OPS for n in graph.nodes):
        problems.extend(parallel_problems(graph))
    return problems


def _races(graph: Graph, hb: nx.DiGraph[str], order: list[str]) -> list[str]:
    sidx = {s: i for i, s in enumerate(graph.streams)}
    by_id = {n.id: n for n in graph.nodes}
    clock: dict[str, list[int]] = {}
    progress = [0] * len(graph.streams)
    epoch: dict[str, int] = {}
    # last[buffer][stream] = {"r": node id, "w": node id}
    last: dict[str, dict[str, dict[str, str]]] = {}
    problems, reported = [], set()
    for nid in order:
        n = by_id[nid]
        c = [0] * len(graph.streams)
        for p in hb.predecessors(nid):
            pc = clock[p]
            for i, v in enumerate(pc):
                if v > c[i]:
                    c[i] = v
        s = sidx[n.stream]
        progress[s] += 1
        c[s] = progress[s]
        epoch[nid] = progress[s]
        clock[nid] = c
        for name, is_write in [(r, False) for r in n.reads] + [(w, True) for w in n.writes]:
            if graph.names.get(name) not in BUFFER_KINDS:
                continue
            per_stream = last.setdefault(name, {})
            for other, acc in per_stream.items():
                if other == n.stream:
                    continue
                for kind in ("w", "r") if is_write else ("w",):
                    pid = acc.get(kind)
                    if pid is None or c[sidx[other]] >= epoch[pid]:
                        continue
                    key = (name, pid, nid)
                    if key in reported:
                        continue
                    reported.add(key)
                    problems.append(
                        f"race on {name}: {pid} ({other}, {'write' if kind == 'w' else 'read'}) and {nid} "
                        f"({n.stream}, {'write' if is_write else 'read'}) are unordered; missing event: "
                        f"record ev.{pid} on {other} after {pid} and wait on it on {n.stream} before {nid}")
            per_stream.setdefault(n.stream, {})["w" if is_write else "r"] = nid
    return problems


class Verify(Pass):
    name = "verify"

    def run(self, graph: Graph, ctx: Optional[PassContext] = None) -> None:
        problems = check(graph)
        if problems:
            raise VerificationError(graph.name, problems)
