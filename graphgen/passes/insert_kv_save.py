"""Pass 2 — insert the KV save.

requires: the forward built (one ``Lxx.kv_write`` per layer, on ``main``).
ensures:  if the variant saves (prefill and pool.write != off):
          - ``sync``: the save runs on ``main``; ``async``: on the ``kv_save`` stream;
          - granularity ``layer``: one ``Lxx.kv_save`` per layer (reads ``kv_cache.Lxx``, writes
            ``pool_staging.Lxx``), issued right after that layer's KV write, so it can start as soon
            as the layer's KV exists; granularity ``forward``: one bulk ``save.kv_save`` of every layer,
            issued after the last layer's KV write (the seed's non-layered mode);
          - ``host.pool_put`` on the ``host`` stream reads every ``pool_staging.Lxx``: the host commits
            the blocks to the pool only after the save has completed.
          No events are inserted here: without pass 3 the async graph is racy, and ``verify`` says so.
          Otherwise the graph is unchanged; meta records write mode, granularity and ``saves``.
"""

from __future__ import annotations

from ..ir.graph import Node, layer_tag
from ..ir.models import SAVE_INPUTS
from .base import Pass


class InsertKvSave(Pass):
    name = "insert_kv_save"

    def run(self, graph, ctx) -> None:
        spec, v = ctx.spec, ctx.variant
        saves = spec.variant_saves(v)
        gran = spec.variant_granularity(v)
        graph.meta.update({"saves": saves, "write": spec.pool.write if saves else "off",
                           "granularity": gran if saves else "none"})
        if not saves:
            return
        write = spec.pool.write
        stream = "kv_save" if write == "async" else "main"
        graph.add_stream(stream)
        graph.add_stream("host")
        for name in SAVE_INPUTS:
            graph.declare(name, "input")
        n = spec.dims.num_hidden_layers
        tags = [layer_tag(i, n) for i in range(n)]
        staging = [graph.declare(f"pool_staging.{t}", "pool_staging") for t in tags]
        caches = [f"kv_cache.{t}" for t in tags]
        if gran == "layer":
            graph.splice(after={f"{t}.kv_write": [Node(f"{t}.kv_save", "kv_save", stream, layer=i,
                                                         reads=(caches[i], "save_block_ids"), writes=(staging[i],))]
                                for i, t in enumerate(tags)})
        else:
            graph.add(Node("save.kv_save", "kv_save", stream, reads=(*caches, "save_block_ids"),
                           writes=tuple(staging)), after=f"{tags[-1]}.kv_write")
        graph.add(Node("host.pool_put", "pool_put", "host", reads=tuple(staging)))
