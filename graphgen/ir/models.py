"""Model builders: the forward of each family as IR nodes on the ``main`` stream.

One function per family emits, per layer, the same node ids across families where the role is
the same (``Lxx.attn_norm``, ``Lxx.kv_write``, ``Lxx.attn``, ``Lxx.o_proj``, ``Lxx.mlp_norm``,
``Lxx.mlp`` / ``Lxx.moe``), so golden diffs line up. Weight names are Hugging Face checkpoint
keys (attributes ``w_*``), so a reviewer can see exactly which tensor each op uses. Pure Python:
no torch on the build path.
"""

from __future__ import annotations

import math

from .graph import Graph, Node, layer_tag

# Per-step inputs the host fills before a graph runs (see runtime StepInputs).
STEP_INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_lens",
               "logits_indices")
SAVE_INPUTS = ("save_block_ids",)



def attention_mode(phase: str, history: bool) -> str:
    if phase == "decode":
        return "decode"
    return "splitfuse" if history else "prefill"


def _p(layer: int) -> str:
    return f"model.layers.{layer}"


def _common_head(g: Graph, rot_dim: int, theta: float, scaling) -> None:
    for name in STEP_INPUTS:
        g.declare(name, "input")
    g.add(Node("embed", "embedding", "main", reads=("input_ids",), writes=(g.declare("h.embed", "value"),),
               attrs={"w_embed": "model.embed_tokens.weight"}))
    g.add(Node("rope", "rope_cos_sin", "main", reads=("positions",),
               writes=(g.declare("cos", "value"), g.declare("sin", "value")),
               attrs={"rot_dim": rot_dim, "theta": float(theta), "scaling": scaling}))


def _tail(g: Graph, h: str, eps: float, tied: bool) -> None:
    g.add(Node("lm_head", "lm_head", "main", reads=(h, "logits_indices"), writes=(g.declare("logits", "value"),),
               attrs={"w_norm": "model.norm.weight", "eps": eps,
                      "w_head": "model.embed_tokens.weight" if tied else "lm_head.weight"}))


def _norm(g: Graph, tag: str, layer: int, role: str, src: str, weight: str, eps: float) -> str:
    out = g.declare(f"x.{tag}.{role}", "value")
    g.add(Node(f"{tag}.{role}", "rms_norm", "main", reads=(src,), writes=(out,), layer=layer,
               attrs={"w_norm": weight, "eps": eps}))
    return out


def _swiglu(g: Graph, tag: str, layer: int, x: str, residual: str, prefix: str) -> str:
    out = g.declare(f"h.{tag}", "value")
    g.add(Node(f"{tag}.mlp", "swiglu_mlp_residual", "main", reads=(x, residual), writes=(out,), layer=layer,
               attrs={"w_gate": f"{prefix}.gate_proj.weight", "w_up": f"{prefix}.up_proj.weight",
                      "w_down": f"{prefix}.down_proj.weight"}))
    return out


def _kv_cache(g: Graph, tag: str) -> str:
    return g.declare(f"kv_cache.{tag}", "kv_cache")


def build_qwen3(g: Graph, dims, mode: str, *, block_size: int, kv_dtype: str) -> None:
    n = dims.num_hidden_layers
    eps = dims.rms_norm_eps
    _common_head(g, dims.head_dim, dims.rope_theta, None)
    width = dims.num_key_value_heads * dims.head_dim
    kv_layout = {"components": ("k", "v"), "widths": (width, width), "block_size": block_size, "kv_dtype": kv_dtype}
    h = "h.embed"
    for i in range(n):
        tag, p = layer_tag(i, n), _p(i)
        x = _norm(g, tag, i, "attn_norm", h, f"{p}.input_layernorm.weight", eps)
        q, k, v = (g.declare(f"{c}.{tag}", "value") for c in "qkv")
        g.add(Node(f"{tag}.qkv", "qwen3_attn_prolog", "main", reads=(x, "cos", "sin"), writes=(q, k, v), layer=i,
                   attrs={"w_q": f"{p}.self_attn.q_proj.weight", "w_k": f"{p}.self_attn.k_proj.weight",
                          "w_v": f"{p}.self_attn.v_proj.weight", "w_q_norm": f"{p}.self_attn.q_norm.weight",
                          "w_k_norm": f"{p}.self_attn.k_norm.weight", "num_heads": dims.num_attention_heads,
                          "num_kv_heads": dims.num_key_value_heads, "head_dim": dims.head_dim, "eps": eps}))
        cache = _kv_cache(g, tag)
        g.add(Node(f"{tag}.kv_write", "kv_write", "main", reads=(k, v, "slot_mapping"), writes=(cache,), layer=i,
                   attrs=kv_layout))
        o = g.declare(f"o.{tag}", "value")
        g.add(Node(f"{tag}.attn", "paged_attention", "main",
                   reads=(q, cache, "block_tables", "seq_lens", "query_lens"), writes=(o,), layer=i,
                   attrs={"mode": mode, "scale": dims.head_dim ** -0.5, "num_heads": dims.num_attention_heads,
                          "num_kv_heads": dims.num_key_value_heads, "head_dim": dims.head_dim, **kv_layout}))
        h_attn = g.declare(f"h.{tag}.attn", "value")
        g.add(Node(f"{tag}.o_proj", "o_proj_residual", "main", reads=(o, h), writes=(h_attn,), layer=i,
                   attrs={"w_o": f"{p}.self_attn.o_proj.weight"}))
        x2 = _norm(g, tag, i, "mlp_norm", h_attn, f"{p}.post_attention_layernorm.weight", eps)
        h = _swiglu(g, tag, i, x2, h_attn, f"{p}.mlp")
    _tail(g, h, eps, dims.tie_word_embeddings)


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(dims) -> float:
    scale = (dims.qk_nope_head_dim + dims.qk_rope_head_dim) ** -0.5
    rs = dims.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        m = yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale = scale * m * m
    return scale


def _scaling_attr(rs):
    if rs is None:
        return None
    return {"type": rs.type, "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim}


# transformers builds q_a_layernorm / kv_a_layernorm with its default eps, not rms_norm_eps.
MLA_NORM_EPS = 1e-6


def build_deepseek_v3(g: Graph, dims, mode: str, *, block_size: int, kv_dtype: str) -> None:
    n = dims.num_hidden_layers
    eps = dims.rms_norm_eps
    _common_head(g, dims.qk_rope_head_dim, dims.rope_theta, _scaling_attr(dims.rope_scaling))
    scale = mla_softmax_scale(dims)
    kv_layout = {"components": ("ckv", "kpe"), "widths": (dims.kv_lora_rank, dims.qk_rope_head_dim),
                 "block_size": block_size, "kv_dtype": kv_dtype}
    h = "h.embed"
    for i in range(n):
        tag, p = layer_tag(i, n), _p(i)
        a = f"{p}.self_attn"
        x = _norm(g, tag, i, "attn_norm", h, f"{p}.input_layernorm.weight", eps)
        q_nope, q_pe, c_kv, k_pe = (g.declare(f"{c}.{tag}", "value") for c in ("q_nope", "q_pe", "c_kv", "k_pe"))
        g.add(Node(f"{tag}.mla_prolog", "mla_prolog", "main", reads=(x, "cos", "sin"),
                   writes=(q_nope, q_pe, c_kv, k_pe), layer=i,
                   attrs={"w_q_a": f"{a}.q_a_proj.weight", "w_q_a_norm": f"{a}.q_a_layernorm.weight",
                          "w_q_b": f"{a}.q_b_proj.weight", "w_kv_a": f"{a}.kv_a_proj_with_mqa.weight",
                          "w_kv_a_norm": f"{a}.kv_a_layernorm.weight", "num_heads": dims.num_attention_heads,
                          "qk_nope_head_dim": dims.qk_nope_head_dim, "qk_rope_head_dim": dims.qk_rope_head_dim,
                          "kv_lora_rank": dims.kv_lora_rank, "eps": MLA_NORM_EPS,
                          "interleave": dims.rope_interleave}))
        cache = _kv_cache(g, tag)
        g.add(Node(f"{tag}.kv_write", "kv_write", "main", reads=(c_kv, k_pe, "slot_mapping"), writes=(cache,), layer=i,
                   attrs=kv_layout))
        o = g.declare(f"o.{tag}", "value")
        g.add(Node(f"{tag}.attn", "mla_attention", "main",
                   reads=(q_nope, q_pe, cache, "block_tables", "seq_lens", "query_lens"), writes=(o,), layer=i,
                   attrs={"mode": mode, "scale": scale, "w_kv_b": f"{a}.kv_b_proj.weight",
                          "num_heads": dims.num_attention_heads, "qk_nope_head_dim": dims.qk_nope_head_dim,
                          "v_head_dim": dims.v_head_dim, "kv_lora_rank": dims.kv_lora_rank,
                          "qk_rope_head_dim": dims.qk_rope_head_dim, **kv_layout}))
        h_attn = g.declare(f"h.{tag}.attn", "value")
        g.add(Node(f"{tag}.o_proj", "o_proj_residual", "main", reads=(o, h), writes=(h_attn,), layer=i,
                   attrs={"w_o": f"{a}.o_proj.weight"}))
        x2 = _norm(g, tag, i, "mlp_norm", h_attn, f"{p}.post_attention_layernorm.weight", eps)
        if i < dims.first_k_dense_replace:
            h = _swiglu(g, tag, i, x2, h_attn, f"{p}.mlp")
            continue
        h = g.declare(f"h.{tag}", "value")
        shared = dims.n_shared_experts > 0
        sp = f"{p}.mlp.shared_experts"
        g.add(Node(f"{tag}.moe", "moe_residual", "main", reads=(x2, h_attn), writes=(h,), layer=i,
                   attrs={"w_router": f"{p}.mlp.gate.weight", "w_bias": f"{p}.mlp.gate.e_score_correction_bias",
                          "w_experts_gate": f"{p}.mlp.experts.gate_proj.weight",
                          "w_experts_up": f"{p}.mlp.experts.up_proj.weight",
                          "w_experts_down": f"{p}.mlp.experts.down_proj.weight",
                          "w_shared_gate": f"{sp}.gate_proj.weight" if shared else None,
                          "w_shared_up": f"{sp}.up_proj.weight" if shared else None,
                          "w_shared_down": f"{sp}.down_proj.weight" if shared else None,
                          "top_k": dims.num_experts_per_tok, "n_group": dims.n_group,
                          "topk_group": dims.topk_group, "routed_scaling_factor": float(dims.routed_scaling_factor),
                          "norm_topk_prob": dims.norm_topk_prob, "num_experts": dims.n_routed_experts}))
    _tail(g, h, eps, dims.tie_word_embeddings)


BUILDERS = {"qwen3_dense": build_qwen3, "deepseek_v3": build_deepseek_v3}
