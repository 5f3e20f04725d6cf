"""DeepSeek-V3's multi-token-prediction (MTP) layers: checkpoint layout and names (docs/mtp.md).

MTP layer ``k`` is stored as ``model.layers.{num_hidden_layers + k}`` (DeepSeek-V3's published layout):
``enorm`` / ``hnorm`` (RMSNorm over the embedding of token t+1 and the target's last hidden state at
t), ``eh_proj`` (``[H, 2H]`` over their concatenation, embedding first), one decoder layer (MLA + MoE:
MTP layers are always MoE, as transformers' ``get_mtp_config`` sets ``first_k_dense_replace: 0``) and
``shared_head.norm``; ``embed_tokens`` and ``shared_head.head`` are copies of the target's embedding
and LM head in published checkpoints, and a checkpoint may leave them out: the loader then shares
the target's tensors (:data:`SHARED_WITH_TARGET`). Pure Python, no torch.
"""

from __future__ import annotations

from typing import Any, Callable

from ..ir.graph import HIDDEN, PREV_HIDDEN, Graph, Node
from .nodes import layer_prefix

__all__ = ["HIDDEN", "PREV_HIDDEN", "SHARED_WITH_TARGET", "mtp_prefix", "mtp_layout", "shared_keys",
           "add_hidden_output", "add_mtp_tail"]  # PREV_HIDDEN: the builder reads it here

# MTP key suffix -> the target's key it duplicates (shared when the checkpoint omits the MTP copy)
SHARED_WITH_TARGET = {"embed_tokens.weight": "model.embed_tokens.weight",
                      "shared_head.head.weight": "lm_head.weight"}


def mtp_prefix(dims: Any, k: int) -> str:
    """Checkpoint key prefix of MTP layer ``k`` (it follows the decoder layers)."""
    return layer_prefix(dims.num_hidden_layers + k)


def mtp_layout(dims: Any, num_layers: int, decoder_layer_layout: Callable[..., None], *,
               stacked: bool = False) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of ``num_layers`` MTP layers; ``decoder_layer_layout(out, dims, index,
    stacked=)`` adds one decoder layer's keys (the family's; ``stacked``: experts as the runtime holds them)."""
    H, V = dims.hidden_size, dims.vocab_size
    out: dict[str, tuple[int, ...]] = {}
    for k in range(num_layers):
        p = mtp_prefix(dims, k)
        out.update({f"{p}.enorm.weight": (H,), f"{p}.hnorm.weight": (H,), f"{p}.eh_proj.weight": (H, 2 * H),
                    f"{p}.shared_head.norm.weight": (H,), f"{p}.shared_head.head.weight": (V, H),
                    f"{p}.embed_tokens.weight": (V, H)})
        decoder_layer_layout(out, dims, dims.num_hidden_layers + k, stacked=stacked)
    return out


def shared_keys(dims: Any, num_layers: int) -> dict[str, str]:
    """MTP key -> the target key it may share (for every MTP layer)."""
    return {f"{mtp_prefix(dims, k)}.{suffix}": target for k in range(num_layers)
            for suffix, target in SHARED_WITH_TARGET.items()}


# ---- the graphs (docs/mtp.md) ----------------------------------------------------------------
# HIDDEN: the target's last hidden state after the final norm (what transformers'
# ``output_hidden_states[-1]`` and vLLM hand the MTP layer); PREV_HIDDEN: the MTP graph's input of it.


def add_hidden_output(g: Graph, eps: float) -> None:
    """Make a target graph also return its last hidden state: the final norm over every row (the LM
    head norms only the rows of ``logits_indices``), so the MTP layer can draft from any row."""
    head = g.node("lm_head")
    g.add(Node("final_norm", "rms_norm", "main", reads=(head.input("h"),), writes=(g.declare(HIDDEN, "value"),),
               attrs={"w_norm": head.attrs["w_norm"], "eps": eps}))


def add_mtp_tail(g: Graph, h: str, dims: Any, k: int) -> None:
    """The MTP layer's shared head over its decoder output ``h``: ``shared_head.norm`` gives the
    hidden state the next draft step reads (``HIDDEN``, every row; transformers' ``post_norm``), and
    the logits at ``logits_indices`` use the same norm and ``shared_head.head``."""
    p = mtp_prefix(dims, k)
    norm_w, eps = f"{p}.shared_head.norm.weight", dims.rms_norm_eps
    g.add(Node("mtp.shared_norm", "rms_norm", "main", reads=(h,), writes=(g.declare(HIDDEN, "value"),),
               attrs={"w_norm": norm_w, "eps": eps}))
    g.add(Node("lm_head", "lm_head", "main", reads=(h, "logits_indices"), writes=(g.declare("logits", "value"),),
               attrs={"w_norm": norm_w, "eps": eps, "w_head": f"{p}.shared_head.head.weight"}))
