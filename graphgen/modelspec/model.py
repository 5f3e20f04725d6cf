"""The spec data model: one frozen dataclass per concept.

A spec file (``specs/<model>.yaml``) parses into a :class:`ModelSpec`. Every field carries its
documentation in ``metadata["doc"]``; the strict loader (``loader.py``) and the JSON Schema
(``schema.py``) are both derived from these definitions, so the three cannot drift apart.

Names that end up in generated code (model and variant names, the NPU save-stream tag) must be
Python identifiers: a spec is code input, and nothing from it is pasted into a template unchecked.

``metadata`` keys read by the loader and the schema: ``doc`` (description), ``minimum`` /
``exclusive_minimum`` (numeric bounds), ``identifier`` (the string must pass :func:`is_identifier`),
``renamed_from`` (the key's old name: a spec still using it gets the rename as its fix),
``nullable=False`` (an Optional field that may be omitted but not written as ``null``), ``min_items`` /
``unique`` (list rules; the loader reports them through ``compat.py`` with the fix), ``by_family``
(a union of dims classes, the one of the spec's ``family`` applies), ``key_name`` / ``example`` (a
``dict[str, ...]`` field: what its keys name, and an example for the fix of an empty mapping).

The family dims classes live with their families (``graphgen/families``) and are re-exported here.
"""

from __future__ import annotations

import dataclasses
import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from ..families import FAMILIES, Dims
# re-exported: the spec model's family names, dims and RoPE scaling types are the families'
from ..families import DeepseekV3Dims as DeepseekV3Dims, FamilyName as FamilyName, Qwen3Dims as Qwen3Dims
from ..families import RopeScaling as RopeScaling
from ..families.base import doc

WriteMode = Literal["off", "sync", "async"]
Granularity = Literal["forward", "layer"]
WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
Phase = Literal["prefill", "decode", "mtp"]
KVDType = Literal["float32", "bfloat16", "float16"]
CompileMode = Literal["max-autotune", "reduce-overhead"]

# Marker type for strings that must be Python identifiers (they become names in generated code).
Identifier = str

# ASCII only, and no leading double underscore (dunder names have meaning to Python itself).
IDENTIFIER_PATTERN = r"^(?!__)[A-Za-z_][A-Za-z0-9_]*$"


def is_identifier(name: object) -> bool:
    """True for a name that is safe to use as a Python identifier in generated code."""
    return (isinstance(name, str) and re.fullmatch(IDENTIFIER_PATTERN, name) is not None
            and not keyword.iskeyword(name))


@dataclass(frozen=True)
class KVCacheLayout:
    """Paged KV-cache layout."""

    block_size: int = field(default=128, metadata=doc("Tokens per KV block (the pool's unit too).", minimum=1))
    dtype: KVDType = field(default="bfloat16", metadata=doc("Element type of the cache."))


@dataclass(frozen=True)
class PoolWrite:
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
    save_decode: bool = field(
        default=False,
        metadata=doc("Also save each KV block a decode step fills (so a conversation's next turn hits "
                     "this turn's answer): copied from the cache after the step that fills it, "
                     "committed on the host stream (async) or inline (sync). No effect with write: off."),
    )
    policy: WritePolicy = field(
        default="write_through",
        metadata=doc("When a full block is saved: write_through, when a step fills it; "
                     "write_through_selective, the same but only once its key was computed min_uses "
                     "times (counted in a bounded LRU map); write_back, when its device block leaves "
                     "the device (freed by its last holder), never reused before that save committed."),
    )
    min_uses: int = field(
        default=2, metadata=doc("write_through_selective: computations of a block's key before it is saved.",
                                minimum=1))
    device_cache: bool = field(
        default=False,
        metadata=doc("Keep the full KV blocks of finished requests on the device (LRU by key, evicted "
                     "when blocks run out): a later prompt's leading blocks found there are shared, "
                     "not loaded from the pool (device_hit_blocks). Needs features: [prefix_cache]."),
    )


@dataclass(frozen=True)
class Variant:
    """One compiled graph of the model."""

    phase: Phase = field(metadata=doc("prefill (new prompt tokens), decode (one token per sequence) or mtp "
                                      "(the MTP draft layer over rows of tokens t+1 and the target's hidden "
                                      "states at t; needs the mtp: section; docs/mtp.md)."))
    history: bool = field(
        default=False,
        metadata=doc("Prefill only: history KV is loaded from the pool first (splitfuse-style attention "
                     "over history + new tokens)."),
    )
    save: Optional[bool] = field(
        default=None,
        metadata=doc("Save this graph's new full KV blocks to the pool. Default: true for prefill and mtp "
                     "when pool.write is not off (an mtp graph saves whole blocks, every layer); decode "
                     "graphs never save."),
    )
    granularity: Optional[Granularity] = field(
        default=None, metadata=doc("Overrides pool.granularity for this variant."))


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
    # ---- step shapes (graphgen.npu.run.bucketing): every step is padded to one of these buckets, so
    # each variant compiles one graph per bucket (docs/npu.md); rules checked in compat._npu_rules
    dtype: Literal["bfloat16", "float16"] = field(
        default="bfloat16",
        metadata=doc("Weights/activations dtype on the NPU (the kernels take float16 or bfloat16; "
                     "RoPE tables are built in it)."))
    decode_batch_buckets: tuple[int, ...] = field(
        default=(1, 2, 4, 8),
        metadata=doc("Decode batch sizes a step is padded to (ascending, unique); the last one is the "
                     "largest decode batch.", minimum=1, min_items=1, unique=True))
    prefill_token_buckets: tuple[int, ...] = field(
        default=(128, 256, 512, 1024),
        metadata=doc("Token counts a prefill/splitfuse step is padded to (ascending, unique; the "
                     "smallest at least prefill_seqs + 1: one padding sequence takes the surplus).",
                     minimum=1, min_items=1, unique=True))
    prefill_seqs: int = field(
        default=2, metadata=doc("Sequences per prefill/splitfuse step at most (the graph's batch is "
                                "prefill_seqs + 1).", minimum=1))
    max_model_len: Optional[int] = field(
        default=None, metadata=doc("Longest sequence (prompt + generated tokens); block tables have "
                                   "ceil(max_model_len / block_size) columns. Default: "
                                   "dims.max_position_embeddings, at most 4096.", minimum=1, nullable=False))
    save_rows: Optional[int] = field(
        default=None, metadata=doc("Blocks one step saves at most (staging rows). Default: the largest "
                                   "prefill bucket / block_size.", minimum=1, nullable=False))
    staging_buffers: int = field(
        default=3, metadata=doc("Persistent staging buffers (graphgen.npu.run.staging.StagingRing): at least "
                                "the commits in flight + 1.", minimum=1))
    device_memory_gib: Optional[float] = field(
        default=None, metadata=doc("Memory of one device in GiB (default: a 64 GiB A2/A3 die); validate rejects "
                                   "a layout whose per-rank launch (weights, KV, staging rings, buffers) exceeds "
                                   "0.9 of what the device gives torch (docs/npu.md, 'Full-size launch').",
                                   exclusive_minimum=0))


@dataclass(frozen=True)
class Parallel:
    """How the model is split over ranks (one process or device per rank; see docs/parallel.md)."""

    tp: int = field(default=1, metadata=doc("Tensor-parallel ranks: attention heads, MLP width and vocabulary are "
                                            "split Megatron-style; partial sums meet in all-reduces.", minimum=1))
    ep: int = field(default=1, metadata=doc("Expert-parallel ranks: each holds n_routed_experts / ep whole experts. "
                                            "1 or tp (EP reuses the TP ranks); under DP attention (dp > 1) "
                                            "dp × tp (the MoE spans every DP group).", minimum=1))
    dp: int = field(default=1, metadata=doc("Data-parallel attention groups of tp ranks each: every group has its "
                                            "own requests, scheduler and KV; only hidden states cross groups, "
                                            "around the MoE.", minimum=1))
    cp: int = field(default=1, metadata=doc("Context-parallel groups of tp ranks each: a prefill's tokens are "
                                            "split head-tail into 2 × cp chunks, each layer's KV all-gathered "
                                            "before the cache write; decode KV is replicated.", minimum=1))
    sp: bool = field(default=False, metadata=doc("Sequence parallel inside the TP group: each all-reduce becomes a "
                                                 "reduce-scatter over the tokens, the norms run on 1/tp of them, "
                                                 "an all-gather restores them (needs tp > 1)."))

    @property
    def world(self) -> int:
        """Ranks of the layout: dp × cp × tp (rank = (dp_rank × cp + cp_rank) × tp + tp_rank)."""
        return self.dp * self.cp * self.tp


@dataclass(frozen=True)
class Mtp:
    """DeepSeek-V3's multi-token-prediction (MTP) layers, a draft model for speculative decoding (docs/mtp.md)."""

    num_layers: int = field(metadata=doc(
        "MTP layers in the checkpoint (config.json's num_nextn_predict_layers; DeepSeek-V3 ships 1): "
        "model.layers.{num_hidden_layers + k}. Each is one more KV layer in every pool block.", minimum=1))


# vLLM's allowed max_lora_rank values (vllm/config/lora.py; prior-art-4.md 1.2)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class Lora:
    """Multi-LoRA (docs/lora.md): PEFT adapters applied per request over the base model, several in one step.
    The graphs take every targeted projection's adapter slots and each token's slot; the runtime loads an
    adapter into a free slot on demand and evicts the least recently used one (never one a running step reads)."""

    max_loras: int = field(default=1, metadata=doc(
        "Adapter slots on the device: distinct adapters one step can batch (vLLM's --max-loras).", minimum=1))
    max_lora_rank: int = field(default=16, metadata=doc(
        "Largest adapter rank r a slot holds (vLLM's --max-lora-rank; one of 1, 8, 16, 32, 64, 128, 256, 320, "
        "512); a bigger adapter is refused.", minimum=1))
    targets: tuple[str, ...] = field(default=(), metadata=doc(
        "Projections (module names as in the checkpoint, e.g. q_proj, v_proj) that adapters may target; "
        "empty: every projection the family can adapt (docs/lora.md). An adapter targeting another is refused.",
        unique=True))


QuantMethod = Literal["none", "w8a8_dynamic"]


@dataclass(frozen=True)
class Fp8Checkpoint:
    """The checkpoint's FP8 weights, as its config.json's ``quantization_config`` records them (DeepSeek-V3's
    published layout): ``float8_e4m3fn`` matrices, each with a float32 ``<name>.weight_scale_inv`` holding
    one scale per ``weight_block_size`` block (value = fp8 x scale). The loader dequantizes each rank's
    slice, reading only the scale blocks that cover it."""

    quant_method: Literal["fp8"] = field(default="fp8", metadata=doc("Hugging Face's quant_method (fp8 only)."))
    fmt: Literal["e4m3"] = field(default="e4m3", metadata=doc("FP8 format of the weights (float8_e4m3fn)."))
    activation_scheme: Literal["dynamic"] = field(
        default="dynamic", metadata=doc("How the checkpoint's authors quantize activations (dynamic: no "
                                        "stored activation scales)."))
    weight_block_size: tuple[int, ...] = field(
        default=(128, 128), metadata=doc("[rows, cols] of the weight block one scale covers (DeepSeek-V3: "
                                         "[128, 128]).", minimum=1, min_items=2))


@dataclass(frozen=True)
class Quantization:
    """How the model's linear layers store and multiply their weights (docs/spec.md, "Quantization")."""

    method: QuantMethod = field(
        default="none",
        metadata=doc("none: every weight in the compute dtype. w8a8_dynamic: the linear layers' weights int8 "
                     "with one scale per output channel (quantized at load from the checkpoint), activations "
                     "quantized per token in the graph, products in int8; norms, router, embedding, lm_head, "
                     "MLA's kv_b_proj and the MTP eh_proj stay in the compute dtype."))
    checkpoint: Optional[Fp8Checkpoint] = field(
        default=None, metadata=doc("The checkpoint's own quantization (omit for a bf16/fp32 checkpoint); "
                                   "graphgen import-hf writes it from config.json's quantization_config.",
                                   nullable=False))


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
    family: FamilyName = field(metadata=doc(f"Model family: {' or '.join(FAMILIES)}."))
    dims: Dims = field(metadata=doc("Family dimensions (the family's dims class).", by_family=True))
    variants: dict[str, Variant] = field(metadata=doc(
        "Graph variants by name (names are Python identifiers).", key_name="variant name",
        example="variants: {decode: {phase: decode}}"))
    kv_cache: KVCacheLayout = field(default_factory=KVCacheLayout, metadata=doc("KV-cache layout."))
    pool: PoolWrite = field(default_factory=PoolWrite, metadata=doc("Pool write mode and granularity.",
                                                                                renamed_from="mempool"))
    features: tuple[str, ...] = field(default=(), metadata=doc("Enabled features (see the compatibility matrix).",
                                                                     unique=True))
    targets: Targets = field(default_factory=lambda: Targets(cpu=CpuTarget()), metadata=doc("Targets to lower to."))
    parallel: Parallel = field(default_factory=Parallel, metadata=doc("Tensor/expert parallel layout."))
    description: str = field(default="", metadata=doc("Free text for humans."))
    quantization: Quantization = field(default_factory=Quantization, metadata=doc(
        "Weight quantization: the checkpoint's (FP8) and how the linear layers compute (W8A8)."))
    mtp: Optional[Mtp] = field(default=None, metadata=doc(
        "Multi-token prediction layers (DeepSeek-V3 only; omit for none): their KV is cached, saved and "
        "loaded with the target's layers.", nullable=False))
    lora: Optional[Lora] = field(default=None, metadata=doc(
        "Multi-LoRA adapter slots (omit for none; docs/lora.md): every graph takes per-token adapters on the "
        "targeted projections.", nullable=False))

    @property
    def mtp_layers(self) -> int:
        """MTP layers the spec enables (0: none)."""
        return self.mtp.num_layers if self.mtp is not None else 0

    @property
    def kv_layers(self) -> int:
        """KV-cache layers: the decoder layers, then the MTP layers (one pool block holds them all)."""
        return self.dims.num_hidden_layers + self.mtp_layers

    # ---- derived facts used by the IR builder and the runtime ----
    def variant_granularity(self, v: Variant) -> Granularity:
        if v.phase == "mtp":  # it saves whole blocks of every layer once its own layer is written
            return "forward"
        return v.granularity or self.pool.granularity

    def variant_saves(self, v: Variant) -> bool:
        if v.phase == "decode" or self.pool.write == "off":
            return False
        return True if v.save is None else v.save

    def with_overrides(self, write: Optional[WriteMode] = None, granularity: Optional[Granularity] = None,
                       tp: Optional[int] = None, ep: Optional[int] = None, dp: Optional[int] = None,
                       cp: Optional[int] = None, sp: Optional[bool] = None,
                       policy: Optional[WritePolicy] = None, min_uses: Optional[int] = None,
                       max_loras: Optional[int] = None, max_lora_rank: Optional[int] = None,
                       enable_lora: bool = False) -> "ModelSpec":
        """The same model with the pool write mode, granularity, write policy (and ``min_uses``) and/or parallel layout
        forced (run-time override; a changed layout is re-checked by ``families.parallel.parallel_rules``,
        which the distributed launcher calls)."""
        spec = self
        if enable_lora or max_loras is not None or max_lora_rank is not None:  # vLLM's --max-loras/--max-lora-rank
            lora = spec.lora or Lora()  # a spec without a lora: section gets vLLM's defaults (1 slot, rank 16)
            if max_loras is not None:
                lora = dataclasses.replace(lora, max_loras=max_loras)
            if max_lora_rank is not None:
                lora = dataclasses.replace(lora, max_lora_rank=max_lora_rank)
            spec = dataclasses.replace(spec, lora=lora)
        if policy is not None:
            spec = dataclasses.replace(spec, pool=dataclasses.replace(spec.pool, policy=policy))
        if min_uses is not None:
            spec = dataclasses.replace(spec, pool=dataclasses.replace(spec.pool, min_uses=min_uses))
        layout: dict[str, Any] = {k: v for k, v in (("tp", tp), ("ep", ep), ("dp", dp), ("cp", cp), ("sp", sp)) if v is not None}
        if layout:
            spec = dataclasses.replace(spec, parallel=dataclasses.replace(self.parallel, **layout))
        if write is not None:
            spec = dataclasses.replace(spec, pool=dataclasses.replace(spec.pool, write=write))
        if granularity is not None:
            spec = dataclasses.replace(
                spec,
                pool=dataclasses.replace(spec.pool, granularity=granularity),
                variants={n: dataclasses.replace(v, granularity=None) for n, v in spec.variants.items()},
            )
        return spec
