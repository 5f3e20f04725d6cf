"""Pass 7 of 8, `insert_events` — insert record/wait events where streams share a buffer.

requires: every node placed on its stream; no record/wait node and no event yet.
ensures:  for every access ``c`` to a buffer that conflicts (one of the two writes) with earlier
          accesses from another stream ``s``, the *latest* such access ``p`` on ``s`` gets a
          ``record`` right after it (event ``ev.<p>``) and ``c`` a ``wait`` on that event right before
          it — unless an earlier wait of ``c``'s stream already covers ``p`` (program order makes one
          event per boundary enough). Event names derive from the producing node's id, so they are
          unique per graph and never positional (the seed's ring-of-events defect). With layer
          granularity this yields one record/wait per layer boundary; with forward granularity one
          for the bulk save; plus one save→host event for the pool commit. Checked: the graph
          verifies clean, every event is recorded once, right after the node it is named after, and
          every wait sits right before the node whose id it carries. "Already covered" is transitive
          (vector clocks over the waits placed so far): a history prefill's save waits for its layer's
          KV write only, which itself waited for that layer's load.
"""

from __future__ import annotations

from ..ir.graph import BUFFER_KINDS, SYNC_OPS, Graph, Node
from .base import Pass, PassContext
from .verify import check


class InsertEvents(Pass):
    name = "insert_events"

    def requires(self, graph: Graph, ctx: PassContext) -> list[str]:
        problems = [f"node {n.id} is on undeclared stream {n.stream}" for n in graph.nodes
                    if n.stream not in graph.streams]
        problems += [f"node {n.id} ({n.op}) exists before events are inserted" for n in graph.nodes
                     if n.op in SYNC_OPS]
        if graph.events:
            problems.append(f"events declared before events are inserted: {', '.join(graph.events)}")
        return problems

    def ensures(self, graph: Graph, ctx: PassContext) -> list[str]:
        problems = check(graph)
        nodes = graph.nodes
        recorded: dict[str, int] = {}
        for i, n in enumerate(nodes):
            if n.op == "record":
                recorded[n.event] = recorded.get(n.event, 0) + 1
                producer = n.event[len("ev."):]
                if n.id != f"{producer}.record" or i == 0 or nodes[i - 1].id != producer:
                    problems.append(f"record {n.id} of {n.event} is not right after {producer}")
            elif n.op == "wait":
                j = i
                while j < len(nodes) and nodes[j].op == "wait":  # several waits may guard one node
                    j += 1
                if j == len(nodes) or not n.id.startswith(f"{nodes[j].id}.wait") or nodes[j].stream != n.stream:
                    problems.append(f"wait {n.id} is not right before the node it guards")
        problems += [f"event {ev} is recorded {k} times" for ev, k in recorded.items() if k != 1]
        return problems

    def run(self, graph: Graph, ctx: PassContext) -> None:
        pos: dict[str, int] = {}
        counters: dict[str, int] = {}
        for n in graph.nodes:  # program position of each data node on its stream
            counters[n.stream] = counters.get(n.stream, 0) + 1
            pos[n.id] = counters[n.stream]
        accesses: dict[str, list[tuple[str, str, bool]]] = {}  # buffer -> [(node id, stream, is_write)]
        # Vector clocks: known[t][s] = the last position of stream s that stream t is already ordered
        # after (directly by a wait, or transitively through the waits of what it waited for);
        # seen[node] = its stream's clock right after it (what a wait on its event inherits).
        known: dict[str, dict[str, int]] = {}
        seen: dict[str, dict[str, int]] = {}
        records_after: dict[str, list[Node]] = {}
        waits_before: dict[str, list[Node]] = {}
        for c in graph.nodes:
            need: dict[str, str] = {}
            for name, is_write in [(r, False) for r in c.reads] + [(w, True) for w in c.writes]:
                if graph.names.get(name) not in BUFFER_KINDS:
                    continue
                for pid, s, p_write in accesses.get(name, ()):
                    if s != c.stream and (is_write or p_write):
                        if s not in need or pos[pid] > pos[need[s]]:
                            need[s] = pid
            # a producer that another needed producer is already ordered after needs no event of its own
            # (the save of a loaded layer waits for the KV write, which waited for the load)
            need = {s: pid for s, pid in need.items()
                    if not any(seen[q].get(s, 0) >= pos[pid] for t, q in need.items() if t != s)}
            clock = known.setdefault(c.stream, {})
            for s in sorted(need):
                pid = need[s]
                if clock.get(s, 0) >= pos[pid]:
                    continue
                event = f"ev.{pid}"
                if event not in graph.events:
                    graph.events[event] = (s, c.stream)
                    records_after.setdefault(pid, []).append(Node(f"{pid}.record", "record", s, attrs={"event": event}))
                elif graph.events[event][1] != c.stream:
                    raise ValueError(f"event {event} would be waited on by two streams")
                wid = f"{c.id}.wait" if len(need) == 1 else f"{c.id}.wait.{s}"
                waits_before.setdefault(c.id, []).append(Node(wid, "wait", c.stream, attrs={"event": event}))
                for t, p in seen[pid].items():
                    if p > clock.get(t, 0):
                        clock[t] = p
            clock[c.stream] = pos[c.id]
            seen[c.id] = dict(clock)
            for name, is_write in [(r, False) for r in c.reads] + [(w, True) for w in c.writes]:
                if graph.names.get(name) in BUFFER_KINDS:
                    accesses.setdefault(name, []).append((c.id, c.stream, is_write))
        graph.splice(before=waits_before, after=records_after)
