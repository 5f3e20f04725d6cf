"""DeepSeek-V3: MLA attention (compressed KV latent), MoE with grouped top-k routing after dense
first layers (Hugging Face ``DeepseekV3ForCausalLM``). ``q_lora_rank: null`` is the uncompressed-query
variant (DeepSeek-V2-Lite style: one ``q_proj``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Optional

from ..ir.graph import Graph, Node, layer_tag
from .mtp import mtp_layout
from .nodes import common_head, kv_cache_name, layer_prefix, norm, swiglu, tail
from .base import doc
from .base import DecoderDims, Family, Rule, common_layout, hf_config_base, mlp_layout

NAME = "deepseek_v3"


@dataclass(frozen=True)
class RopeScaling:
    """YaRN RoPE scaling, as in DeepSeek-V3's ``rope_scaling`` (``type: yarn``)."""

    type: Literal["yarn"] = field(metadata=doc("Scaling kind; only 'yarn' is implemented."))
    factor: float = field(metadata=doc("Context extension factor (DeepSeek-V3: 40).", minimum=1.0))
    original_max_position_embeddings: int = field(metadata=doc("Pre-extension context (4096).", minimum=1))
    beta_fast: float = field(default=32.0, metadata=doc("YaRN beta_fast.", exclusive_minimum=0))
    beta_slow: float = field(default=1.0, metadata=doc("YaRN beta_slow.", exclusive_minimum=0))
    mscale: float = field(default=1.0, metadata=doc("YaRN mscale.", minimum=0))
    mscale_all_dim: float = field(default=0.0, metadata=doc("YaRN mscale_all_dim.", minimum=0))


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Dims(DecoderDims):
    """Dimensions of a DeepSeek-V3 model: MLA attention, MoE with dense first layers."""

    moe_intermediate_size: int = field(metadata=doc("Width of each routed/shared expert.", minimum=1))
    q_lora_rank: Optional[int] = field(metadata=doc(
        "Rank of the query compression; null: uncompressed queries (one q_proj, DeepSeek-V2-Lite style).",
        minimum=1))
    kv_lora_rank: int = field(metadata=doc("Rank of the compressed KV latent (what the cache holds).", minimum=1))
    qk_nope_head_dim: int = field(metadata=doc("Per-head query/key dims without RoPE.", minimum=1))
    qk_rope_head_dim: int = field(metadata=doc("Per-head query/key dims with RoPE (even).", minimum=2))
    v_head_dim: int = field(metadata=doc("Per-head value dims.", minimum=1))
    n_routed_experts: int = field(metadata=doc("Routed experts per MoE layer.", minimum=1))
    num_experts_per_tok: int = field(metadata=doc("Routed experts chosen per token (top-k).", minimum=1))
    n_shared_experts: int = field(metadata=doc("Shared experts per MoE layer (0: none).", minimum=0))
    n_group: int = field(metadata=doc("Expert groups for grouped top-k routing.", minimum=1))
    topk_group: int = field(metadata=doc("Groups kept per token.", minimum=1))
    first_k_dense_replace: int = field(metadata=doc("Leading layers with a dense MLP instead of MoE.", minimum=0))
    routed_scaling_factor: float = field(default=1.0, metadata=doc("Scale of the routed experts' output.",
                                                                  exclusive_minimum=0))
    norm_topk_prob: bool = field(default=True, metadata=doc("Renormalise the top-k routing weights."))
    rope_interleave: bool = field(default=True, metadata=doc("RoPE on interleaved pairs (DeepSeek layout)."))
    rope_scaling: Optional[RopeScaling] = field(default=None, metadata=doc("YaRN scaling, or null."))
    max_position_embeddings: int = field(default=163840, metadata=doc("Longest supported context.", minimum=1))


def dims_rules(d: DeepseekV3Dims) -> Iterator[Rule]:
    if d.num_experts_per_tok > d.n_routed_experts:
        yield ("dims.num_experts_per_tok",
               f"num_experts_per_tok ({d.num_experts_per_tok}) exceeds n_routed_experts ({d.n_routed_experts})",
               "choose at most n_routed_experts")
    if d.n_routed_experts % d.n_group:
        yield ("dims.n_group", f"n_group ({d.n_group}) must divide n_routed_experts ({d.n_routed_experts})",
               "pick a divisor of n_routed_experts")
    elif d.n_routed_experts // d.n_group < 2:
        # The router scores a group by the sum of its two best experts (noaux_tc).
        yield ("dims.n_group", f"n_group ({d.n_group}) leaves fewer than 2 experts per group "
               f"({d.n_routed_experts} routed experts)", "use n_group <= n_routed_experts / 2")
    if d.topk_group > d.n_group:
        yield "dims.topk_group", f"topk_group ({d.topk_group}) exceeds n_group ({d.n_group})", "use topk_group <= n_group"
    elif not d.n_routed_experts % d.n_group and d.num_experts_per_tok <= d.n_routed_experts:
        kept = d.topk_group * (d.n_routed_experts // d.n_group)
        if d.num_experts_per_tok > kept:
            # Experts outside the kept groups are masked out; top-k must fit in what is left.
            yield ("dims.num_experts_per_tok",
                   f"num_experts_per_tok ({d.num_experts_per_tok}) exceeds the {kept} experts in the "
                   f"topk_group ({d.topk_group}) groups kept per token", "raise topk_group or lower num_experts_per_tok")
    if d.first_k_dense_replace > d.num_hidden_layers:
        yield ("dims.first_k_dense_replace",
               f"first_k_dense_replace ({d.first_k_dense_replace}) exceeds num_hidden_layers ({d.num_hidden_layers})",
               "use at most num_hidden_layers")
    if d.qk_rope_head_dim % 2:
        yield "dims.qk_rope_head_dim", f"qk_rope_head_dim ({d.qk_rope_head_dim}) must be even for RoPE", "use an even value"


def kv_components(d: DeepseekV3Dims) -> tuple[tuple[str, tuple[int, ...]], ...]:
    # MLA caches the compressed latent and the shared RoPE key part, not per-head K/V.
    return (("ckv", (d.kv_lora_rank,)), ("kpe", (d.qk_rope_head_dim,)))


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(d: DeepseekV3Dims) -> float:
    """1/sqrt(qk head dim), times mscale(factor, mscale_all_dim)^2 under YaRN (as transformers)."""
    scale: float = (d.qk_nope_head_dim + d.qk_rope_head_dim) ** -0.5
    rs = d.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        m = yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale = scale * m * m
    return scale


def checkpoint_layout(d: DeepseekV3Dims, *, stacked: bool = False, mtp_layers: int = 0) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape; experts one key each as Hugging Face stores them, or ``stacked`` into
    ``mlp.experts.{gate,up,down}_proj.weight`` ``[E, ...]`` as the runtime holds them. With
    ``n_shared_experts: 0`` the shared-expert projections are zero-size (transformers still writes them).
    ``mtp_layers``: also the MTP layers' keys, in DeepSeek-V3's published layout (``graphgen.families.mtp``)."""
    out = common_layout(d)
    for i in range(d.num_hidden_layers):
        decoder_layer_layout(out, d, i, stacked=stacked)
    if mtp_layers:
        out.update(mtp_layout(d, mtp_layers, decoder_layer_layout, stacked=stacked))
    return out


def decoder_layer_layout(out: dict[str, tuple[int, ...]], d: DeepseekV3Dims, i: int, *, stacked: bool = False) -> None:
    """The keys of decoder layer ``i`` (dense MLP below ``first_k_dense_replace``, MoE from there; an
    MTP layer's index is past ``num_hidden_layers``, so it is MoE, as DeepSeek-V3's is)."""
    H, Hq = d.hidden_size, d.num_attention_heads
    n, r, v, R, qr = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank, d.q_lora_rank
    p = layer_prefix(i)
    a = f"{p}.self_attn"
    out[f"{p}.input_layernorm.weight"] = (H,)
    out[f"{p}.post_attention_layernorm.weight"] = (H,)
    if qr is None:
        out[f"{a}.q_proj.weight"] = (Hq * (n + r), H)
    else:
        out.update({f"{a}.q_a_proj.weight": (qr, H), f"{a}.q_a_layernorm.weight": (qr,),
                    f"{a}.q_b_proj.weight": (Hq * (n + r), qr)})
    out.update({f"{a}.kv_a_proj_with_mqa.weight": (R + r, H), f"{a}.kv_a_layernorm.weight": (R,),
                f"{a}.kv_b_proj.weight": (Hq * (n + v), R), f"{a}.o_proj.weight": (H, Hq * v)})
    if i < d.first_k_dense_replace:
        mlp_layout(out, f"{p}.mlp", H, d.intermediate_size)
        return
    E, I = d.n_routed_experts, d.moe_intermediate_size
    out[f"{p}.mlp.gate.weight"] = (E, H)
    out[f"{p}.mlp.gate.e_score_correction_bias"] = (E,)
    if stacked:
        out.update({f"{p}.mlp.experts.gate_proj.weight": (E, I, H), f"{p}.mlp.experts.up_proj.weight": (E, I, H),
                    f"{p}.mlp.experts.down_proj.weight": (E, H, I)})
    else:
        for e in range(E):
            mlp_layout(out, f"{p}.mlp.experts.{e}", H, I)
    mlp_layout(out, f"{p}.mlp.shared_experts", H, I * d.n_shared_experts)


def _scaling_attr(rs: Optional[RopeScaling]) -> Optional[dict[str, Any]]:
    if rs is None:
        return None
    return {"type": rs.type, "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast, "beta_slow": rs.beta_slow, "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim}


# transformers builds q_a_layernorm / kv_a_layernorm with its default eps, not rms_norm_eps.
MLA_NORM_EPS = 1e-6


def build(g: Graph, dims: DeepseekV3Dims, mode: str, *, block_size: int, kv_dtype: str) -> None:
    rope_head(g, dims, kv_dtype)
    h = "h.embed"
    for i in range(dims.num_hidden_layers):
        h = decoder_layer(g, dims, i, h, mode, block_size=block_size, kv_dtype=kv_dtype)
    tail(g, h, dims.rms_norm_eps, dims.tie_word_embeddings)


def build_mtp(g: Graph, dims: DeepseekV3Dims, k: int, mode: str, *, block_size: int, kv_dtype: str) -> None:
    """MTP layer ``k`` as a graph (docs/mtp.md): row t holds token t+1 (``input_ids``, embedded with
    the layer's ``embed_tokens``) and reads the previous hidden state at t (``prev_hidden``: the
    target's, or the previous draft step's); ``eh_proj``, one decoder layer whose KV is cache layer
    ``num_hidden_layers + k`` at the same slots as the target's, then the shared head."""
    from .mtp import PREV_HIDDEN, add_mtp_tail, mtp_prefix

    p = mtp_prefix(dims, k)
    i = dims.num_hidden_layers + k
    common_head(g, dims.qk_rope_head_dim, dims.rope_theta, _scaling_attr(dims.rope_scaling), kv_dtype,
                w_embed=f"{p}.embed_tokens.weight")
    prev = g.declare(PREV_HIDDEN, "input")
    x = g.declare(f"x.{layer_tag(i, dims.num_hidden_layers)}.eh_proj", "value")
    g.add(Node(f"{layer_tag(i, dims.num_hidden_layers)}.eh_proj", "mtp_eh_proj", "main", reads=("h.embed", prev),
               writes=(x,), layer=i, attrs={"w_enorm": f"{p}.enorm.weight", "w_hnorm": f"{p}.hnorm.weight",
                                            "w_eh": f"{p}.eh_proj.weight", "eps": dims.rms_norm_eps}))
    h = decoder_layer(g, dims, i, x, mode, block_size=block_size, kv_dtype=kv_dtype)
    add_mtp_tail(g, h, dims, k)


def rope_head(g: Graph, dims: DeepseekV3Dims, kv_dtype: str) -> None:
    """The step inputs, the embedding and the RoPE tables (``common_head`` with this family's RoPE)."""
    common_head(g, dims.qk_rope_head_dim, dims.rope_theta, _scaling_attr(dims.rope_scaling), kv_dtype)


def decoder_layer(g: Graph, dims: DeepseekV3Dims, i: int, h: str, mode: str, *, block_size: int,
                  kv_dtype: str) -> str:
    """Decoder layer ``i`` over the hidden state ``h`` (MLA, then a dense MLP below
    ``first_k_dense_replace`` or MoE); returns the name of its output. An MTP layer is layer
    ``num_hidden_layers + k`` (graphgen.families.mtp)."""
    eps = dims.rms_norm_eps
    scale = mla_softmax_scale(dims)
    kv_layout = FAMILY.kv_layout_attrs(dims, block_size, kv_dtype)
    compressed_q = dims.q_lora_rank is not None
    tag, p = layer_tag(i, dims.num_hidden_layers), layer_prefix(i)
    a = f"{p}.self_attn"
    x = norm(g, tag, i, "attn_norm", h, f"{p}.input_layernorm.weight", eps)
    q_nope, q_pe, c_kv, k_pe = (g.declare(f"{c}.{tag}", "value") for c in ("q_nope", "q_pe", "c_kv", "k_pe"))
    g.add(Node(f"{tag}.mla_prolog", "mla_prolog", "main", reads=(x, "cos", "sin"),
               writes=(q_nope, q_pe, c_kv, k_pe), layer=i,
               attrs={"w_q_a": f"{a}.q_a_proj.weight" if compressed_q else None,
                      "w_q_a_norm": f"{a}.q_a_layernorm.weight" if compressed_q else None,
                      "w_q_b": f"{a}.q_b_proj.weight" if compressed_q else f"{a}.q_proj.weight",
                      "w_kv_a": f"{a}.kv_a_proj_with_mqa.weight",
                      "w_kv_a_norm": f"{a}.kv_a_layernorm.weight", "num_heads": dims.num_attention_heads,
                      "qk_nope_head_dim": dims.qk_nope_head_dim, "qk_rope_head_dim": dims.qk_rope_head_dim,
                      "kv_lora_rank": dims.kv_lora_rank, "eps": MLA_NORM_EPS,
                      "interleave": dims.rope_interleave}))
    cache = g.declare(kv_cache_name(tag), "kv_cache")
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
    x2 = norm(g, tag, i, "mlp_norm", h_attn, f"{p}.post_attention_layernorm.weight", eps)
    if i < dims.first_k_dense_replace:
        return swiglu(g, tag, i, x2, h_attn, f"{p}.mlp")
    h = g.declare(f"h.{tag}", "value")
    shared = dims.n_shared_experts > 0  # 0: the checkpoint's shared projections are empty
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
    return h


_HF_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group",
            "topk_group", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "rope_theta",
            "rope_interleave", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")


def hf_config(d: DeepseekV3Dims, dtype: str, mtp_layers: int = 0) -> dict[str, Any]:
    import dataclasses

    cfg = hf_config_base(FAMILY, d, dtype, _HF_KEYS)
    # MLA has one shared latent "kv head"; transformers wants the attention-head count here
    cfg.update(num_key_value_heads=d.num_attention_heads, num_nextn_predict_layers=mtp_layers,
               topk_method="noaux_tc", scoring_func="sigmoid")
    scaling = None
    if d.rope_scaling is not None:
        scaling = {**dataclasses.asdict(d.rope_scaling), "rope_type": d.rope_scaling.type}
        cfg["rope_parameters"] = {**scaling, "rope_theta": float(d.rope_theta)}
    # legacy field (transformers 4.x, vLLM) and the transformers 5 one, kept consistent
    cfg["rope_scaling"] = scaling
    return cfg


def mtp_layers_of_config(cfg: dict[str, Any]) -> int:
    """The MTP layers a config.json declares (``num_nextn_predict_layers``; 0: none)."""
    mtp = cfg.get("num_nextn_predict_layers") or 0
    return mtp if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > 0 else 0


FAMILY = Family(
    name=NAME,
    label="DeepSeek-V3",
    dims_cls=DeepseekV3Dims,
    hf_model_type="deepseek_v3",
    hf_arch="DeepseekV3ForCausalLM",
    hf_defaults={"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
                 "rope_theta": 10000.0, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                 "norm_topk_prob": True, "rope_interleave": True},
    hf_must_be={"hidden_act": "silu", "attention_bias": False, "topk_method": "noaux_tc",
                "scoring_func": "sigmoid", "moe_layer_freq": 1},
    rope_scaling=True,
    build=build,
    checkpoint_layout=checkpoint_layout,
    kv_components=kv_components,
    dims_rules=dims_rules,
    hf_config=hf_config,
    mtp_layers_of_config=mtp_layers_of_config,
    build_mtp=build_mtp,
    # the router is precision-sensitive: transformers keeps it in float32 too
    fp32_suffixes=(".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"),
    attention="mla",
    has_moe=lambda d: d.first_k_dense_replace < d.num_hidden_layers,
    # MLA's projections (kv_b_proj is absorbed into the attention's einsums: not a linear layer here) and
    # the dense layers' MLP; the MoE layers' experts take no adapter (docs/lora.md)
    lora_modules=("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj",
                  "down_proj"),
)
