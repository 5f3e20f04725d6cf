"""Shared pieces of the model builders: the nodes every family emits the same way.

Each family's builder (``graphgen.families.<family>.build``) emits, per layer, the same node ids
across families where the role is the same (``Lxx.attn_norm``, ``Lxx.kv_write``, ``Lxx.attn``,
``Lxx.o_proj``, ``Lxx.mlp_norm``, ``Lxx.mlp`` / ``Lxx.moe``), so golden diffs line up. Weight names
are Hugging Face checkpoint keys (attributes ``w_*``), so a reviewer can see exactly which tensor
each op uses. Pure Python: no torch on the build path.
"""

from __future__ import annotations

from typing import Any, Optional

from ..ir.graph import STEP_INPUTS, Graph, Node



def attention_mode(phase: str, history: bool) -> str:
    if phase == "decode":
        return "decode"
    return "splitfuse" if history else "prefill"


def layer_prefix(layer: int) -> str:
    """Checkpoint key prefix of one decoder layer."""
    return f"model.layers.{layer}"


def kv_cache_name(tag: str) -> str:
    """Graph name of one layer's KV cache buffer."""
    return f"kv_cache.{tag}"


def common_head(g: Graph, rot_dim: int, theta: float, scaling: Optional[dict[str, Any]], dtype: str,
                w_embed: str = "model.embed_tokens.weight") -> None:
    """Step inputs, the token embedding and the RoPE tables (``dtype``: the model/KV dtype they are
    used in; ``w_embed``: the embedding, an MTP layer's own)."""
    for name in STEP_INPUTS:
        g.declare(name, "input")
    g.add(Node("embed", "embedding", "main", reads=("input_ids",), writes=(g.declare("h.embed", "value"),),
               attrs={"w_embed": w_embed}))
    g.add(Node("rope", "rope_cos_sin", "main", reads=("positions",),
               writes=(g.declare("cos", "value"), g.declare("sin", "value")),
               attrs={"rot_dim": rot_dim, "theta": float(theta), "scaling": scaling, "dtype": dtype}))


def tail(g: Graph, h: str, eps: float, tied: bool) -> None:
    """Final norm + LM head on the rows of ``logits_indices``."""
    g.add(Node("lm_head", "lm_head", "main", reads=(h, "logits_indices"), writes=(g.declare("logits", "value"),),
               attrs={"w_norm": "model.norm.weight", "eps": eps,
                      "w_head": "model.embed_tokens.weight" if tied else "lm_head.weight"}))


def norm(g: Graph, tag: str, layer: int, role: str, src: str, weight: str, eps: float) -> str:
    out = g.declare(f"x.{tag}.{role}", "value")
    g.add(Node(f"{tag}.{role}", "rms_norm", "main", reads=(src,), writes=(out,), layer=layer,
               attrs={"w_norm": weight, "eps": eps}))
    return out


def swiglu(g: Graph, tag: str, layer: int, x: str, residual: str, prefix: str) -> str:
    out = g.declare(f"h.{tag}", "value")
    g.add(Node(f"{tag}.mlp", "swiglu_mlp_residual", "main", reads=(x, residual), writes=(out,), layer=layer,
               attrs={"w_gate": f"{prefix}.gate_proj.weight", "w_up": f"{prefix}.up_proj.weight",
                      "w_down": f"{prefix}.down_proj.weight"}))
    return out
