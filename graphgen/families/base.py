"""What a model family is: one frozen :class:`Family` object per family, registered in ``FAMILIES``.

A family module (``qwen3_dense.py``, ``deepseek_v3.py``) holds almost everything graphgen knows about
that architecture. Two per-family tables remain outside it, and a new family fills them in too: the
parallel plan (``graphgen.families.parallel.PLANS``) and three rows of the compatibility matrix that
name families (``graphgen.modelspec.compat.MATRIX``: ``write:async``, ``mtp``, ``yarn``). The rest:

- ``dims_cls``: the spec's ``dims`` dataclass (Hugging Face config names), and ``dims_rules``: the
  shape rules the spec loader reports (``(where, message, fix)`` triples);
- ``hf_*``: the Hugging Face ``model_type``, architecture class, the defaults transformers assumes
  for omitted config fields, the config values graphgen reproduces, and the config writer;
- ``build``: the forward as IR nodes (shared node helpers are in ``graphgen.families.nodes``);
- ``checkpoint_layout``: checkpoint key -> shape (``mtp_layers=N``: with the MTP layers, DeepSeek-V3 only), the one layout the weight loader, the random
  checkpoint writer and the NPU inputs use. A zero-size shape is a weight the model does not have
  but transformers still writes (an empty ``nn.Linear``); consumers accept it absent or empty and
  never hand it to generated code;
- ``kv_components``: the KV cache's components and their per-token shapes.

Pure Python, no torch: the build path imports this.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional



def doc(text: str, **extra: Any) -> dict[str, Any]:
    """``metadata`` of a spec field (the spec model's and the family dims'): its documentation plus
    rules the loader and schema read. Here, at the bottom, so families and the spec model share it."""
    return {"doc": text, **extra}


Rule = tuple[str, str, str]  # (spec path, message, fix)


@dataclass(frozen=True, kw_only=True)
class DecoderDims:
    """The fields every decoder family's dims share (names as in Hugging Face configs). Keyword-only, so a
    family's own required fields may follow these defaults; a family re-declares a field to change its
    default (rope_theta, max_position_embeddings)."""

    num_hidden_layers: int = field(metadata=doc("Decoder layers (an MTP layer is not one).", minimum=1))
    hidden_size: int = field(metadata=doc("Model width.", minimum=1))
    intermediate_size: int = field(metadata=doc("MLP width (of the dense layers, for MoE families).", minimum=1))
    vocab_size: int = field(metadata=doc("Vocabulary size.", minimum=1))
    num_attention_heads: int = field(metadata=doc("Query heads.", minimum=1))
    rope_theta: float = field(default=10000.0, metadata=doc("RoPE base.", exclusive_minimum=0))
    rms_norm_eps: float = field(default=1e-6, metadata=doc("RMSNorm epsilon.", exclusive_minimum=0))
    tie_word_embeddings: bool = field(default=False, metadata=doc("LM head shares the embedding."))
    max_position_embeddings: int = field(default=40960, metadata=doc("Longest supported context.", minimum=1))


@dataclass(frozen=True)
class Family:
    name: str
    label: str  # how people write the architecture's name, for messages
    dims_cls: type
    hf_model_type: str
    hf_arch: str
    # Values transformers assumes when a config omits a field (not graphgen's own dims defaults).
    hf_defaults: Mapping[str, Any]
    # Config values graphgen implements; any other value is refused by import-hf.
    hf_must_be: Mapping[str, Any]
    # Whether the family accepts YaRN rope scaling (in dims.rope_scaling).
    rope_scaling: bool
    build: Callable[..., None]  # (graph, dims, mode, *, block_size, kv_dtype)
    checkpoint_layout: Callable[..., dict[str, tuple[int, ...]]]  # (dims, *, stacked=False[, mtp_layers=N]) -> {key: shape}
    kv_components: Callable[[Any], tuple[tuple[str, tuple[int, ...]], ...]]  # dims -> ((name, per-token shape), ...)
    dims_rules: Callable[[Any], Iterable[Rule]]
    hf_config: Callable[..., dict[str, Any]]  # (dims, dtype name[, mtp_layers]) -> config.json dict
    # Checkpoint keys (by suffix) kept in float32 whatever the load dtype, as transformers keeps them.
    fp32_suffixes: tuple[str, ...] = ()
    hf_checks: Callable[[dict[str, Any]], Iterable[tuple[str, str, str]]] = lambda cfg: ()  # (key, message, fix)
    hf_notes: Callable[[dict[str, Any]], Iterable[str]] = lambda cfg: ()
    # config.json -> the MTP layers its checkpoint holds (0: none; only DeepSeek-V3 has them).
    mtp_layers_of_config: Callable[[dict[str, Any]], int] = lambda cfg: 0
    # The MTP layer k as a graph: (graph, dims, k, mode, *, block_size, kv_dtype); None: no MTP layers.
    build_mtp: Optional[Callable[..., None]] = None
    # The attention kind ("gqa": per-head K/V cache; "mla": compressed latent cache) and whether any
    # layer is MoE: what target checks (e.g. the NPU kernels' documented limits) key on.
    attention: str = "gqa"
    has_moe: Callable[[Any], bool] = lambda dims: False
    # The projections (checkpoint module names) a LoRA adapter may target (docs/lora.md); () : none.
    lora_modules: tuple[str, ...] = ()

    def kv_widths(self, dims: Any) -> tuple[int, ...]:
        """Elements per token of each KV component (what the IR's kv_write/attention nodes carry)."""
        return tuple(math.prod(shape) for _, shape in self.kv_components(dims))

    def kv_layout_attrs(self, dims: Any, block_size: int, kv_dtype: str) -> dict[str, Any]:
        """The KV-layout attributes of kv_write and attention nodes."""
        return {"components": tuple(n for n, _ in self.kv_components(dims)), "widths": self.kv_widths(dims),
                "block_size": block_size, "kv_dtype": kv_dtype}

    def dims_of(self, dims: Any) -> Any:
        """``dims`` as this family's dims dataclass (a dims object, or a mapping such as a config.json
        or ``dataclasses.asdict`` output; keys the class lacks are ignored, absent ones take the
        Hugging Face default, then the dims default)."""
        if isinstance(dims, self.dims_cls):
            return dims
        if dataclasses.is_dataclass(dims) and not isinstance(dims, type):
            dims = dataclasses.asdict(dims)
        kwargs = {}
        for f in dataclasses.fields(self.dims_cls):
            if f.name in dims and (dims[f.name] is not None or _nullable(f)):
                kwargs[f.name] = dims[f.name]
            elif f.name in self.hf_defaults:
                kwargs[f.name] = self.hf_defaults[f.name]
            elif f.name in _DERIVED:
                value = _DERIVED[f.name](dims)
                if value is not None:
                    kwargs[f.name] = value
        return self.dims_cls(**_nested(self.dims_cls, kwargs))


def _nullable(f: dataclasses.Field[Any]) -> bool:
    return "Optional" in str(f.type) or "None" in str(f.type)


# Fields Hugging Face configs may leave implicit, derived as transformers derives them.
_DERIVED: dict[str, Callable[[Mapping[str, Any]], Optional[Any]]] = {
    "head_dim": lambda d: (d["hidden_size"] // d["num_attention_heads"]
                           if "hidden_size" in d and "num_attention_heads" in d else None),
}


def _nested(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Mapping values of dataclass-typed fields (e.g. ``rope_scaling``) as those dataclasses."""
    import typing

    hints = typing.get_type_hints(cls)
    out = dict(kwargs)
    for name, value in kwargs.items():
        if isinstance(value, Mapping):
            for tp in (hints[name], *typing.get_args(hints[name])):
                if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                    names = {f.name for f in dataclasses.fields(tp)}
                    out[name] = tp(**{k: v for k, v in value.items() if k in names})
                    break
    return out


def mlp_layout(out: dict[str, tuple[int, ...]], prefix: str, hidden: int, inter: int) -> None:
    """The three SwiGLU projections of a Hugging Face MLP block."""
    out[f"{prefix}.gate_proj.weight"] = (inter, hidden)
    out[f"{prefix}.up_proj.weight"] = (inter, hidden)
    out[f"{prefix}.down_proj.weight"] = (hidden, inter)


def common_layout(d: Any) -> dict[str, tuple[int, ...]]:
    """Embedding, final norm and LM head (``lm_head.weight`` listed even when tied)."""
    H, V = d.hidden_size, d.vocab_size
    return {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}


def hf_config_base(family: Family, dims: Any, dtype: str, keys: Iterable[str]) -> dict[str, Any]:
    """The config.json fields every family writes, plus ``keys`` of ``dims``."""
    d = dataclasses.asdict(dims)
    cfg = {
        "architectures": [family.hf_arch], "model_type": family.hf_model_type, "dtype": dtype,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(d["rope_theta"])},
    }
    cfg.update({k: d[k] for k in keys})
    return cfg
