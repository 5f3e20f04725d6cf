"""Qwen3 dense: GQA attention with per-head q/k RMSNorm, SwiGLU MLP (Hugging Face ``Qwen3ForCausalLM``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import Any, Iterator

from ..ir.graph import Graph, Node, layer_tag
from .nodes import common_head, kv_cache_name, layer_prefix, norm, swiglu, tail
from .base import doc
from .base import DecoderDims, Family, Rule, common_layout, hf_config_base, mlp_layout

NAME = "qwen3_dense"


@dataclass(frozen=True, kw_only=True)
class Qwen3Dims(DecoderDims):
    """Dimensions of a Qwen3 dense model (names as in Hugging Face ``Qwen3Config``)."""

    num_key_value_heads: int = field(metadata=doc("KV heads (GQA); divides num_attention_heads.", minimum=1))
    head_dim: int = field(metadata=doc("Per-head dimension (even: RoPE rotates halves).", minimum=2))
    rope_theta: float = field(default=1000000.0, metadata=doc("RoPE base.", exclusive_minimum=0))


def dims_rules(d: Qwen3Dims) -> Iterator[Rule]:
    if d.num_attention_heads % d.num_key_value_heads:
        yield ("dims.num_key_value_heads",
               f"num_key_value_heads ({d.num_key_value_heads}) must divide num_attention_heads "
               f"({d.num_attention_heads})", "pick a divisor of num_attention_heads")
    if d.head_dim % 2:
        yield "dims.head_dim", f"head_dim ({d.head_dim}) must be even for RoPE", "use an even head_dim"


def kv_components(d: Qwen3Dims) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return (("k", (d.num_key_value_heads, d.head_dim)), ("v", (d.num_key_value_heads, d.head_dim)))


def checkpoint_layout(d: Qwen3Dims, *, stacked: bool = False) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape (``stacked`` changes nothing: a dense model has no experts)."""
    H, Hq, Hkv, D = d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim
    out = common_layout(d)
    for i in range(d.num_hidden_layers):
        p = layer_prefix(i)
        a = f"{p}.self_attn"
        out[f"{p}.input_layernorm.weight"] = (H,)
        out[f"{p}.post_attention_layernorm.weight"] = (H,)
        out.update({f"{a}.q_proj.weight": (Hq * D, H), f"{a}.k_proj.weight": (Hkv * D, H),
                    f"{a}.v_proj.weight": (Hkv * D, H), f"{a}.o_proj.weight": (H, Hq * D),
                    f"{a}.q_norm.weight": (D,), f"{a}.k_norm.weight": (D,)})
        mlp_layout(out, f"{p}.mlp", H, d.intermediate_size)
    return out


def build(g: Graph, dims: Qwen3Dims, mode: str, *, block_size: int, kv_dtype: str) -> None:
    n = dims.num_hidden_layers
    eps = dims.rms_norm_eps
    common_head(g, dims.head_dim, dims.rope_theta, None, kv_dtype)
    kv_layout = FAMILY.kv_layout_attrs(dims, block_size, kv_dtype)
    h = "h.embed"
    for i in range(n):
        tag, p = layer_tag(i, n), layer_prefix(i)
        x = norm(g, tag, i, "attn_norm", h, f"{p}.input_layernorm.weight", eps)
        q, k, v = (g.declare(f"{c}.{tag}", "value") for c in "qkv")
        g.add(Node(f"{tag}.qkv", "qwen3_attn_prolog", "main", reads=(x, "cos", "sin"), writes=(q, k, v), layer=i,
                   attrs={"w_q": f"{p}.self_attn.q_proj.weight", "w_k": f"{p}.self_attn.k_proj.weight",
                          "w_v": f"{p}.self_attn.v_proj.weight", "w_q_norm": f"{p}.self_attn.q_norm.weight",
                          "w_k_norm": f"{p}.self_attn.k_norm.weight", "num_heads": dims.num_attention_heads,
                          "num_kv_heads": dims.num_key_value_heads, "head_dim": dims.head_dim, "eps": eps}))
        cache = g.declare(kv_cache_name(tag), "kv_cache")
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
        x2 = norm(g, tag, i, "mlp_norm", h_attn, f"{p}.post_attention_layernorm.weight", eps)
        h = swiglu(g, tag, i, x2, h_attn, f"{p}.mlp")
    tail(g, h, eps, dims.tie_word_embeddings)


_HF_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
            "max_position_embeddings")


def hf_config(d: Qwen3Dims, dtype: str) -> dict[str, Any]:
    cfg = hf_config_base(FAMILY, d, dtype, _HF_KEYS)
    cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=d.num_hidden_layers,
               layer_types=["full_attention"] * d.num_hidden_layers)
    return cfg


def hf_checks(cfg: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    types_ = cfg.get("layer_types")
    if isinstance(types_, list) and any(t != "full_attention" for t in types_):
        yield "layer_types", "sliding-window layers are not implemented", "use full attention layers only"


FAMILY = Family(
    name=NAME,
    label="Qwen3",
    dims_cls=Qwen3Dims,
    hf_model_type="qwen3",
    hf_arch="Qwen3ForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 32768,
                 "rope_theta": 10000.0},
    hf_must_be={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
    rope_scaling=False,
    build=build,
    checkpoint_layout=checkpoint_layout,
    kv_components=kv_components,
    dims_rules=dims_rules,
    hf_config=hf_config,
    hf_checks=hf_checks,
    lora_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)
