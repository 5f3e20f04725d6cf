"""W8A8 (dynamic) quantization: what it quantizes, and how the quantized weights are named (a spec's
``quantization: {method: w8a8_dynamic}``, docs/spec.md "Quantization").

The graph builder records the spec's method in ``graph.meta["quant"]``; every target then multiplies the
linear layers' weights (the ``linear`` attributes of the op schemas, `graphgen.ir.ops`) in int8: the
weight int8 with one scale per output channel, made at load from the checkpoint; the activation
quantized per token in the graph. Everything else (embedding, norms, router and its bias, lm_head, MLA's
``kv_b_proj`` -- its absorbed halves are einsum'd, not a linear layer -- and the MTP ``eh_proj``) stays
in the compute dtype, as MindIE and vllm-ascend keep them. Here, in ``ir``, because the builder, the
lowering, the memory budget and the loader all read the same rule. Pure Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from .ops import OPS

if TYPE_CHECKING:
    from .graph import Graph, Node

__all__ = ["W8A8", "NONE", "SCALE_SUFFIX", "scale_name", "scale_dtype", "quant_of", "quantized_attrs",
           "quantized_weight_names", "linear_weight_names"]

NONE = "none"
W8A8 = "w8a8_dynamic"
SCALE_SUFFIX = ":scale"  # W[name + SCALE_SUFFIX]: the per-output-channel scales of the int8 weight W[name]


def scale_name(name: str) -> str:
    """The key of an int8 weight's scales."""
    return name + SCALE_SUFFIX


def scale_dtype(compute_dtype: str) -> str:
    """The scales' dtype for a compute dtype: bfloat16 under bfloat16 (npu_quant_matmul and
    npu_grouped_matmul with per-token scales take a bfloat16 scale for a bfloat16 output: torch-npu 2.14.0
    _op_plugin_docs.py:5020-5027, 5960-5969; vllm-ascend keeps weight_scale in the params dtype), float32
    otherwise (float16 outputs take a float32 scale there; the CPU target computes in float32)."""
    return "bfloat16" if compute_dtype == "bfloat16" else "float32"


def quant_of(graph: "Graph") -> str:
    """The graph's quantization method (``none`` unless the spec's ``quantization.method`` says otherwise)."""
    return str(graph.meta.get("quant", NONE))


def quantized_attrs(node: "Node", quant: str) -> tuple[str, ...]:
    """The weight attributes of ``node`` that are int8 under ``quant`` (present ones only)."""
    if quant != W8A8:
        return ()
    return tuple(a for a in OPS[node.op].linear if node.attrs.get(a) is not None)


def linear_weight_names(graphs: Iterable["Graph"]) -> set[str]:
    """Every weight name (``key[d<dim>/<parts>]``) the graphs read as a linear layer's weight."""
    return {n.attrs[a] for g in graphs for n in g.nodes for a in quantized_attrs(n, W8A8)}


def quantized_weight_names(graphs: Iterable["Graph"]) -> set[str]:
    """Every weight name the graphs read as int8 + scales (none unless their method is W8A8)."""
    return {n.attrs[a] for g in graphs for n in g.nodes for a in quantized_attrs(n, quant_of(g))}
