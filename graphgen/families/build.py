"""The builder: one variant of a spec -> the forward graph on stream ``main`` (no save, no events).

Not a pass: it starts from nothing. Its output is what the passes after it require, the first being
``shard`` (``insert_kv_load``'s and ``insert_kv_save``'s ``requires`` check the shape of it): the whole
forward on ``main`` (embedding, RoPE tables, per
layer: norms, attention or MLA, one ``Lxx.kv_write`` into ``kv_cache.Lxx``, MLP or MoE; then the LM
head); the attention op's ``mode`` is prefill, splitfuse (history from the pool) or decode.
Pure Python, no torch.
"""

from __future__ import annotations

from typing import Any

from . import FAMILIES
from ..ir.graph import Graph
from .mtp import add_hidden_output
from .nodes import attention_mode


def build_graph(spec: Any, variant_name: str, spec_file: str = "") -> Graph:
    """The forward graph of ``spec``'s variant ``variant_name`` (meta records what it was built from).
    ``spec``: a `graphgen.modelspec.model.ModelSpec` (Any here: modelspec imports families)."""
    v = spec.variants[variant_name]
    graph = Graph(name=f"{spec.name}.{variant_name}")
    graph.meta.update({
        "spec": spec_file or f"{spec.name}.yaml",
        "model": spec.name,
        "variant": variant_name,
        "family": spec.family,
        "phase": v.phase,
        "history": v.history,
        "layers": spec.dims.num_hidden_layers,
        "block_size": spec.kv_cache.block_size,
        "kv_dtype": spec.kv_cache.dtype,
    })
    quant = getattr(getattr(spec, "quantization", None), "method", "none")
    if quant != "none":  # the linear layers multiply in int8 (graphgen.ir.quant); absent: nothing quantized
        graph.meta["quant"] = quant
    family = FAMILIES[spec.family]
    layout = {"block_size": spec.kv_cache.block_size, "kv_dtype": spec.kv_cache.dtype}
    if v.phase == "mtp":  # the MTP draft layer alone (graphgen.families.mtp; docs/mtp.md)
        assert family.build_mtp is not None, f"family {family.name} has no MTP layers"  # the loader refuses the variant
        graph.meta["mtp_layer"] = spec.dims.num_hidden_layers
        family.build_mtp(graph, spec.dims, 0, attention_mode("prefill", True), **layout)
        return graph
    family.build(graph, spec.dims, attention_mode(v.phase, v.history), **layout)
    if spec.mtp is not None:  # the MTP layer drafts from the target's last hidden state
        add_hidden_output(graph, spec.dims.rms_norm_eps)
    return graph
