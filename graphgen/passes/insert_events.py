"""Pass 3 — insert record/wait events where streams share a buffer.

requires: every node placed on its stream; cross-stream accesses to buffers not yet ordered.
ensures:  for every access ``c`` to a buffer that conflicts (one of the two writes) with earlier
          accesses from another stream ``s``, the *latest* such access ``p`` on ``s`` gets a
          ``record`` right after it (event ``ev.<p>``) and ``c`` a ``wait`` on that event right before
          it — unless an earlier wait of ``c``'s stream already covers ``p`` (program order makes one
          event per boundary enough). Event names derive from the producing node's id, so they are
          unique per graph and never positional (the seed's ring-of-events defect). With layer
          granularity this yields one record/wait per layer boundary; with forward granularity one
          for the bulk save; plus one save→host event for the pool commit.
"""

from __future__ import annotations

from ..ir.graph import BUFFER_KINDS, Node
from .base import Pass


class InsertEvents(Pass):
    name = "insert_events"

    def run(self, graph, ctx) -> None:
        pos: dict[str, int] = {}
        counters: dict[str, int] = {}
        for n in graph.nodes:  # program position of each data node on its stream
            counters[n.stream] = counters.get(n.stream, 0) + 1
            pos[n.id] = counters[n.stream]
        accesses: dict[str, list[tuple[str, str, bool]]] = {}  # buffer -> [(node id, stream, is_write)]
        covered: dict[tuple[str, str], int] = {}  # (src stream, dst stream) -> position already waited for
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
            for s in sorted(need):
                pid = need[s]
                if covered.get((s, c.stream), 0) >= pos[pid]:
                    continue
                event = f"ev.{pid}"
                if event not in graph.events:
                    graph.events[event] = (s, c.stream)
                    records_after.setdefault(pid, []).append(Node(f"{pid}.record", "record", s, attrs={"event": event}))
                elif graph.events[event][1] != c.stream:
                    raise ValueError(f"event {event} would be waited on by two streams")
                wid = f"{c.id}.wait" if len(need) == 1 else f"{c.id}.wait.{s}"
                waits_before.setdefault(c.id, []).append(Node(wid, "wait", c.stream, attrs={"event": event}))
                covered[(s, c.stream)] = pos[pid]
            for name, is_write in [(r, False) for r in c.reads] + [(w, True) for w in c.writes]:
                if graph.names.get(name) in BUFFER_KINDS:
                    accesses.setdefault(name, []).append((c.id, c.stream, is_write))
        graph.splice(before=waits_before, after=records_after)
