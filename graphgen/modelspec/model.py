"""The spec data model: one frozen dataclass per concept.

A spec file (``specs/<model>.yaml``) parses into a :class:`ModelSpec`. Every field carries its
documentation in ``metadata["doc"]``; the strict loader (``loader.py``) and the JSON Schema
(``schema.py``) are both derived from these definitions, so the three cannot drift apart.

Names that end up in generated code (model and variant names, the NPU save-stream tag) must be
Python identifiers: a spec is code input, and nothing from it is pasted into a template unchecked.

``metadata`` keys read by the loader and the schema: ``doc`` (description), ``minimum`` /
``exclusive_minimum`` (numeric bounds), ``identifier`` (the string must pass :func:`is_identifier`),
``nullable=False`` (an Optional field that may be omitted but not written as ``null``), ``min_items`` /
``unique`` (list rules; the loader reports them through ``compat.py`` with the fix).
"""

from __future__ import annotations

import dataclasses
import keyword
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

Family = Literal["qwen3_dense", "deepseek_v3"]
WriteMode = Literal["off", "sync", "async"]
Granularity = Literal["forward", "layer"]
Phase = Literal["prefill", "decode"]
KVDType = Literal["float32", "bfloat16", "float16"]
CompileMode = Literal["max-autotune", "reduce-overhead"]

# Marker type for strings that must be Python identifiers (they become names in generated code).
Identifier = str

# ASCII only, and no leading double underscore (dunder names have meaning to Python itself).
IDENTIFIER_PATTERN = r"^(?!__)[A-Za-z_][A-Za-z0-9_]*$"


def is_identifier(name) -> bool:
    """True for a name that is safe to use as a Python identifier in generated code."""
    return (isinstance(name, str) and re.fullmatch(IDENTIFIER_PATTERN, name) is not None
            and not keyword.iskeyword(name))


def doc(text: str, **extra) -> dict:
    return {"doc": text, **extra}


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


@dataclass(frozen=True)
class Qwen3Dims:
    """Dimensions of a Qwen3 dense model (names as in Hugging Face ``Qwen3Config``)."""

    num_hidden_layers: int = field(metadata=doc("Decoder layers.", minimum=1))
    hidden_size: int = field(metadata=doc("Model width.", minimum=1))
    intermediate_size: int = field(metadata=doc("SwiGLU MLP width.", minimum=1))
    vocab_size: int = field(metadata=doc("Vocabulary size.", minimum=1))
    num_attention_heads: int = field(metadata=doc("Query heads.", minimum=1))
    num_key_value_heads: int = field(metadata=doc("KV heads (GQA); divides num_attention_heads.", minimum=1))
    head_dim: int = field(metadata=doc("Per-head dimension (even: RoPE rotates halves).", minimum=2))
    rope_theta: float = field(default=1000000.0, metadata=doc("RoPE base.", exclusive_minimum=0))
    rms_norm_eps: float = field(default=1e-6, metadata=doc("RMSNorm epsilon.", exclusive_minimum=0))
    tie_word_embeddings: bool = field(default=False, metadata=doc("LM head shares the embedding."))
    max_position_embeddings: int = field(default=40960, metadata=doc("Longest supported context.", minimum=1))


@dataclass(frozen=True)
class DeepseekV3Dims:
    """Dimensions of a DeepSeek-V3 model: MLA attention, MoE with dense first layers."""

    num_hidden_layers: int = field(metadata=doc("Decoder layers (MTP layer not included).", minimum=1))
    hidden_size: int = field(metadata=doc("Model width.", minimum=1))
    intermediate_size: int = field(metadata=doc("MLP width of the dense layers.", minimum=1))
    moe_intermediate_size: int = field(metadata=doc("Width of each routed/shared expert.", minimum=1))
    vocab_size: int = field(metadata=doc("Vocabulary size.", minimum=1))
    num_attention_heads: int = field(metadata=doc("Attention heads.", minimum=1))
    q_lora_rank: int = field(metadata=doc("Rank of the query compression.", minimum=1))
    kv_lora_rank: int = field(metadata=doc("Rank of the compressed KV latent (what the cache holds).", minimum=1))
    qk_nope_head_dim: int = field(metadata=doc("Per-head query/key dims without RoPE.", minimum=1))
    qk_rope_head_dim: int = field(metadata=doc("Per-head query/key dims with RoPE (even).", minimum=2))
    v_head_dim: int = field(metadata=doc("Per-head value dims.", minimum=1))
    n_routed_experts: int = field(metadata=doc("Routed experts per MoE layer.", minimum=1))
    num_experts_per_tok: int = field(metadata=doc("Routed experts chosen per token (top-k).", minimum=1))
    n_shared_experts: int = field(metadata=doc("Shared experts per MoE layer.", minimum=0))
    n_group: int = field(metadata=doc("Expert groups for grouped top-k routing.", minimum=1))
    topk_group: int = field(metadata=doc("Groups kept per token.", minimum=1))
    first_k_dense_replace: int = field(metadata=doc("Leading layers with a dense MLP instead of MoE.", minimum=0))
    routed_scaling_factor: float = field(default=1.0, metadata=doc("Scale of the routed experts' output.",
                                                                  exclusive_minimum=0))
    norm_topk_prob: bool = field(default=True, metadata=doc("Renormalise the top-k routing weights."))
    rope_theta: float = field(default=10000.0, metadata=doc("RoPE base.", exclusive_minimum=0))
    rope_interleave: bool = field(default=True, metadata=doc("RoPE on interleaved pairs (DeepSeek layout)."))
    rope_scaling: Optional[RopeScaling] = field(default=None, metadata=doc("YaRN scaling, or null."))
    rms_norm_eps: float = field(default=1e-6, metadata=doc("RMSNorm epsilon.", exclusive_minimum=0))
    tie_word_embeddings: bool = field(default=False, metadata=doc("LM head shares the embedding."))
    max_position_embeddings: int = field(default=163840, metadata=doc("Longest supported context.", minimum=1))


DIMS_BY_FAMILY = {"qwen3_dense": Qwen3Dims, "deepseek_v3": DeepseekV3Dims}


@dataclass(frozen=True)
class KVCacheLayout:
    """Paged KV-cache layout."""

    block_size: int = field(default=128, metadata=doc("Tokens per KV block (the pool's unit too).", minimum=1))
    dtype: KVDType = field(default="bfloat16", metadata=doc("Element type of the cache."))


@dataclass(frozen=True)
class Mempool:
    """How KV is written to the KV-cache pool."""

    write: WriteMode = field(
        default="sync",
        metadata=doc("off: no pool writes; sync: save on the forward stream (blocks TTFT); "
                     "async: save on the save stream, synchronised by record/wait events."),
    )
    granularity: Granularity = field(
        default="forward",
        metadata=doc("forward: one bulk save after the last layer's KV write (the seed's non-layered "
                     "mode); layer: each layer saved as soon as its KV is written."),
    )


@dataclass(frozen=True)
class Variant:
    """One compiled graph of the model."""

    phase: Phase = field(metadata=doc("prefill (new prompt tokens) or decode (one token per sequence)."))
    history: bool = field(
        default=False,
        metadata=doc("Prefill only: history KV is loaded from the pool first (splitfuse-style attention "
                     "over history + new tokens)."),
    )
    save: Optional[bool] = field(
        default=None,
        metadata=doc("Save this graph's new full KV blocks to the pool. Default: true for prefill when "
                     "mempool.write is not off; decode graphs never save."),
    )
    granularity: Optional[Granularity] = field(
        default=None, metadata=doc("Overrides mempool.granularity for this variant."))


@dataclass(frozen=True)
class CpuTarget:
    """Lower to plain torch on CPU (numerics and async-save proofs)."""


@dataclass(frozen=True)
class NpuTarget:
    """Lower to Ascend NPUs through torchair (not executed here: no NPU)."""

    compile_modes: tuple[CompileMode, ...] = field(
        default=("max-autotune",),
        metadata=doc("torchair CompilerConfig modes to generate: max-autotune (GE graph, "
                     "record/wait ops) and/or reduce-overhead (aclgraph, tagged events).",
                     min_items=1, unique=True),
    )
    save_stream_tag: Identifier = field(
        default="kv_save", metadata=doc("Tag of the save stream in npu_stream_switch.", identifier=True))
    save_stream_priority: int = field(
        default=0, metadata=doc("Priority passed to npu_stream_switch for the save stream."))


@dataclass(frozen=True)
class Targets:
    """Code generation targets; at least one must be enabled. Omit a key to disable that target."""

    cpu: Optional[CpuTarget] = field(
        default=None, metadata=doc("Generate the CPU target (write cpu: {} to enable).", nullable=False))
    npu: Optional[NpuTarget] = field(
        default=None, metadata=doc("Generate the NPU (torchair) target (npu: {} for defaults).", nullable=False))


@dataclass(frozen=True)
class ModelSpec:
    """A model and the graph variants to generate for it."""

    name: Identifier = field(metadata=doc("Model name; a Python identifier (it names generated code).",
                                          identifier=True))
    family: Family = field(metadata=doc("Model family: qwen3_dense or deepseek_v3."))
    dims: object = field(metadata=doc("Family dimensions (see Qwen3Dims / DeepseekV3Dims)."))
    variants: dict = field(metadata=doc("Graph variants by name (names are Python identifiers)."))
    kv_cache: KVCacheLayout = field(default_factory=KVCacheLayout, metadata=doc("KV-cache layout."))
    mempool: Mempool = field(default_factory=Mempool, metadata=doc("Pool write mode and granularity."))
    features: tuple[str, ...] = field(default=(), metadata=doc("Enabled features (see the compatibility matrix).",
                                                                     unique=True))
    targets: Targets = field(default_factory=lambda: Targets(cpu=CpuTarget()), metadata=doc("Targets to lower to."))
    description: str = field(default="", metadata=doc("Free text for humans."))

    # ---- derived facts used by the IR builder and the runtime ----
    def variant_granularity(self, v: Variant) -> Granularity:
        return v.granularity or self.mempool.granularity

    def variant_saves(self, v: Variant) -> bool:
        if v.phase == "decode" or self.mempool.write == "off":
            return False
        return True if v.save is None else v.save

    def with_overrides(self, write: Optional[str] = None, granularity: Optional[str] = None) -> "ModelSpec":
        """The same model with the pool write mode and/or granularity forced (run-time override)."""
        spec = self
        if write is not None:
            spec = dataclasses.replace(spec, mempool=dataclasses.replace(spec.mempool, write=write))
        if granularity is not None:
            spec = dataclasses.replace(
                spec,
                mempool=dataclasses.replace(spec.mempool, granularity=granularity),
                variants={n: dataclasses.replace(v, granularity=None) for n, v in spec.variants.items()},
            )
        return spec
