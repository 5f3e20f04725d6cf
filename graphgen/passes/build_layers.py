"""Pass 1 — build the layer stack of the model family.

requires: an empty graph for one (spec, variant).
ensures:  the whole forward on stream ``main`` (embedding, RoPE tables, per layer: norms, attention
          or MLA, one ``Lxx.kv_write`` into ``kv_cache.Lxx``, MLP or MoE; then the LM head); the
          attention op's ``mode`` is prefill, splitfuse (history from the pool) or decode.
"""

from __future__ import annotations

from ..families import FAMILIES
from ..ir.models import attention_mode
from .base import Pass


class BuildLayers(Pass):
    name = "build_layers"

    def run(self, graph, ctx) -> None:
        spec, v = ctx.spec, ctx.variant
        if graph.nodes:
            raise ValueError("build_layers expects an empty graph")
        graph.meta.update({
            "spec": ctx.spec_file or f"{spec.name}.yaml",
            "model": spec.name,
            "variant": ctx.variant_name,
            "family": spec.family,
            "phase": v.phase,
            "history": v.history,
            "layers": spec.dims.num_hidden_layers,
            "block_size": spec.kv_cache.block_size,
            "kv_dtype": spec.kv_cache.dtype,
        })
        FAMILIES[spec.family].build(graph, spec.dims, attention_mode(v.phase, v.history),
                                     block_size=spec.kv_cache.block_size, kv_dtype=spec.kv_cache.dtype)
