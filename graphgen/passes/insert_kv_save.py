"""Pass 6 of 8, `insert_kv_save` — insert the KV save.

requires: the forward as the builder makes it (:mod:`graphgen.families.build`): every node on ``main``
          (but the loads ``insert_kv_load`` put on ``kv_load``), one ``Lxx.kv_write`` per layer
          writing ``kv_cache.Lxx``, no save, no events, race-free but for the loads.
ensures:  if the variant saves (prefill and pool.write != off):
          - ``sync``: the save runs on ``main``; ``async``: on the ``kv_save`` stream;
          - granularity ``layer``: one ``Lxx.kv_save`` per layer (reads ``kv_cache.Lxx``, writes
            ``pool_staging.Lxx``), issued right after that layer's KV write, so it can start as soon
            as the layer's KV exists; granularity ``forward``: one bulk ``save.kv_save`` of every layer,
            issued after the last layer's KV write (the seed's non-layered mode);
          - at ``cp > 1`` (KV replicated over the CP ranks) the save and the commit carry
            ``writers=cp0``: only CP rank 0's ranks save;
          - ``host.pool_put`` on the ``host`` stream reads every ``pool_staging.Lxx``: the host commits
            the blocks to the pool only after the save has completed.
          No events are inserted here: without ``insert_events`` the async graph is racy (only racy), and the
          sync one races only between the save and the host commit; ``verify`` says so.
          Otherwise the graph is unchanged; meta records write mode, granularity and ``saves``.
"""

from __future__ import annotations

from ..ir.graph import HOST_STREAM, LOAD_STREAM, MAIN_STREAM, SAVE_STREAM, SYNC_OPS, Graph, Node, layer_tags, saved_layer_tags
from ..ir.graph import SAVE_INPUTS
from .base import Pass, PassContext
from .verify import check


def _load_race(problem: str) -> bool:
    """A race of a load (``insert_kv_load``) with its layer's cache: ``insert_events`` orders it."""
    return problem.startswith("race on kv_cache") and ".kv_load (kv_load," in problem


class InsertKvSave(Pass):
    name = "insert_kv_save"

    def requires(self, graph: Graph, ctx: PassContext) -> list[str]:
        problems = [f"node {n.id} is on stream {n.stream}, the builder puts everything on {MAIN_STREAM}"
                    for n in graph.nodes if n.stream != MAIN_STREAM and n.op != "kv_load"]
        problems += [f"node {n.id} ({n.op}) exists before the save is inserted"
                     for n in graph.nodes if n.op in (*SYNC_OPS, "kv_save", "pool_put")]
        if graph.events:
            problems.append(f"events declared before the save is inserted: {', '.join(graph.events)}")
        writes = {n.id: n for n in graph.nodes if n.op == "kv_write"}
        for t in layer_tags(graph):
            w = writes.pop(f"{t}.kv_write", None)
            if w is None or w.output("cache") != f"kv_cache.{t}":
                problems.append(f"layer {t} has no {t}.kv_write writing kv_cache.{t}")
        problems += [f"kv_write {nid} belongs to no layer" for nid in writes]
        return problems + [p for p in check(graph) if not _load_race(p)]

    def run(self, graph: Graph, ctx: PassContext) -> None:
        spec, v = ctx.spec, ctx.variant
        saves = spec.variant_saves(v)
        gran = spec.variant_granularity(v)
        graph.meta.update({"saves": saves, "write": spec.pool.write if saves else "off",
                           "granularity": gran if saves else "none"})
        if not saves:
            return
        stream = SAVE_STREAM if spec.pool.write == "async" else MAIN_STREAM
        # KV replicated over the CP ranks (context_parallel): CP rank 0's ranks are its one writer
        owner = {"writers": "cp0"} if graph.meta.get("cp", 1) > 1 else {}
        graph.add_stream(stream)
        graph.add_stream(HOST_STREAM)
        for name in SAVE_INPUTS:
            graph.declare(name, "input")
        tags = saved_layer_tags(graph)
        staging = [graph.declare(f"pool_staging.{t}", "pool_staging") for t in tags]
        caches = [graph.declare(f"kv_cache.{t}", "kv_cache") for t in tags]
        if gran == "layer":
            graph.splice(after={f"{t}.kv_write": [Node(f"{t}.kv_save", "kv_save", stream, layer=i,
                                                         reads=(caches[i], "save_block_ids"), writes=(staging[i],),
                                                         attrs=dict(owner))]
                                for i, t in enumerate(tags)})
        else:
            graph.add(Node("save.kv_save", "kv_save", stream, reads=(*caches, "save_block_ids"),
                           writes=tuple(staging), attrs=dict(owner)), after=f"{tags[-1]}.kv_write")
        graph.add(Node("host.pool_put", "pool_put", HOST_STREAM, reads=tuple(staging), attrs=dict(owner)))

    def ensures(self, graph: Graph, ctx: PassContext) -> list[str]:
        m = graph.meta
        problems = [f"node {n.id} ({n.op}) inserted: this pass adds no events" for n in graph.nodes if n.op in SYNC_OPS]
        saves = [n for n in graph.nodes if n.op == "kv_save"]
        puts = [n for n in graph.nodes if n.op == "pool_put"]
        races = [p for p in check(graph) if not _load_race(p)]
        if not m.get("saves"):
            if saves or puts or [s for s in graph.streams if s != LOAD_STREAM] != [MAIN_STREAM]:
                problems.append("a variant that saves nothing got a save, a pool commit or another stream")
            return problems + races
        stream = SAVE_STREAM if m["write"] == "async" else MAIN_STREAM
        tags = saved_layer_tags(graph)
        index = {n.id: i for i, n in enumerate(graph.nodes)}
        groups = [[t] for t in tags] if m["granularity"] == "layer" else [tags]
        if len(saves) != len(groups):
            problems.append(f"{len(saves)} kv_save node(s), expected {len(groups)} ({m['granularity']} granularity)")
        for node, group in zip(saves, groups):
            want = (tuple(f"kv_cache.{t}" for t in group), tuple(f"pool_staging.{t}" for t in group))
            if node.stream != stream or (node.input("caches"), node.output("staging")) != want:
                problems.append(f"{node.id} on {node.stream} saves {node.input('caches')} into "
                                f"{node.output('staging')}; expected {want[0]} into {want[1]} on {stream}")
            if index[node.id] != index[f"{group[-1]}.kv_write"] + 1:
                problems.append(f"{node.id} is not issued right after {group[-1]}.kv_write")
        if len(puts) != 1 or puts[0].stream != HOST_STREAM or \
                puts[0].input("staging") != tuple(f"pool_staging.{t}" for t in tags):
            problems.append(f"expected one pool_put on {HOST_STREAM} reading every layer's pool staging")
        if stream == SAVE_STREAM and not races:
            problems.append("the async save is already ordered: no race for insert_events to fix")
        prefix = "race on" if stream == SAVE_STREAM else "race on pool_staging"
        return problems + [f"unexpected problem: {p}" for p in races if not p.startswith(prefix)]
