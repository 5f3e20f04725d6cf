"""Pass 5 of 8, `insert_kv_load` — insert the KV load (history blocks from the pool into the cache,
on the ``kv_load`` stream).

requires: the forward as the builder makes it: every node on ``main``, one ``Lxx.kv_write`` per layer
          writing ``kv_cache.Lxx``, no load, no save, no events.
ensures:  if the variant has ``history`` (a prefill over blocks loaded from the pool):
          - input ``load_block_ids`` (the cache blocks the loaded blocks go to), buffers
            ``pool_load.Lxx`` (per-layer load staging the host fills before the graph starts, like an
            input: nothing in the graph writes it) and the ``kv_load`` stream are declared;
          - granularity ``layer``: one ``Lxx.kv_load`` per layer (reads ``pool_load.Lxx`` and
            ``load_block_ids``, writes ``kv_cache.Lxx``), all issued at the start of the graph in layer
            order, so layer i's load runs while layers < i compute; granularity ``forward``: one bulk
            ``load.kv_load`` of every layer at the start.
          No events are inserted here: each load races with its layer's KV write until
          ``insert_events`` adds a record after the load and a wait before the first main-stream
          access of that layer's cache. Otherwise the graph is unchanged (meta ``history`` says which).
"""

from __future__ import annotations

from ..ir.graph import LOAD_STREAM, MAIN_STREAM, SYNC_OPS, Graph, Node, layer_tags
from ..ir.graph import LOAD_INPUTS
from .base import Pass, PassContext
from .verify import check


class InsertKvLoad(Pass):
    name = "insert_kv_load"

    def requires(self, graph: Graph, ctx: PassContext) -> list[str]:
        problems = [f"node {n.id} is on stream {n.stream}, the builder puts everything on {MAIN_STREAM}"
                    for n in graph.nodes if n.stream != MAIN_STREAM]
        problems += [f"node {n.id} ({n.op}) exists before the load is inserted"
                     for n in graph.nodes if n.op in (*SYNC_OPS, "kv_load", "kv_save", "pool_put")]
        if graph.events:
            problems.append(f"events declared before the load is inserted: {', '.join(graph.events)}")
        writes = {n.id for n in graph.nodes if n.op == "kv_write"}
        problems += [f"layer {t} has no {t}.kv_write" for t in layer_tags(graph) if f"{t}.kv_write" not in writes]
        return problems + check(graph)

    def run(self, graph: Graph, ctx: PassContext) -> None:
        if not ctx.variant.history:
            return
        gran = ctx.spec.variant_granularity(ctx.variant)
        graph.add_stream(LOAD_STREAM)
        for name in LOAD_INPUTS:
            graph.declare(name, "input")
        tags = layer_tags(graph)
        staged = [graph.declare(f"pool_load.{t}", "pool_load") for t in tags]
        caches = [f"kv_cache.{t}" for t in tags]
        if gran == "layer":
            nodes = [Node(f"{t}.kv_load", "kv_load", LOAD_STREAM, layer=i, reads=(staged[i], "load_block_ids"),
                          writes=(caches[i],)) for i, t in enumerate(tags)]
        else:
            nodes = [Node("load.kv_load", "kv_load", LOAD_STREAM, reads=(*staged, "load_block_ids"),
                          writes=tuple(caches))]
        graph.splice(before={graph.nodes[0].id: nodes})

    def ensures(self, graph: Graph, ctx: PassContext) -> list[str]:
        loads = [n for n in graph.nodes if n.op == "kv_load"]
        races = check(graph)
        if not ctx.variant.history:
            if loads or LOAD_STREAM in graph.streams:
                return [f"a variant without history got a load or the {LOAD_STREAM} stream"] + races
            return races
        tags = layer_tags(graph)
        layered = ctx.spec.variant_granularity(ctx.variant) == "layer"
        groups = [[t] for t in tags] if layered else [tags]
        problems = []
        if len(loads) != len(groups):
            problems.append(f"{len(loads)} kv_load node(s), expected {len(groups)}")
        for i, (node, group) in enumerate(zip(loads, groups)):
            want = (tuple(f"pool_load.{t}" for t in group), tuple(f"kv_cache.{t}" for t in group))
            if node.stream != LOAD_STREAM or (node.input("loads"), node.output("caches")) != want:
                problems.append(f"{node.id} on {node.stream} loads {node.input('loads')} into "
                                f"{node.output('caches')}; expected {want[0]} into {want[1]} on {LOAD_STREAM}")
            if graph.nodes[i] is not node:
                problems.append(f"{node.id} is not issued at the start of the graph, in layer order")
        if not races:
            problems.append("the load is already ordered: no race for insert_events to fix")
        return problems + [f"unexpected problem: {p}" for p in races if not p.startswith("race on kv_cache")]
