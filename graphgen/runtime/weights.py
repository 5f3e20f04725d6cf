"""Hugging Face checkpoint I/O for the CPU runtime.

``load_hf_weights`` reads ``model.safetensors`` (or a sharded ``model.safetensors.index.json``)
into a flat dict keyed by checkpoint names, checks every key and shape against the layout that
``config.json`` implies, and stacks DeepSeek-V3 experts into
``model.layers.N.mlp.experts.{gate,up,down}_proj.weight`` ``[E, ...]``.

``write_random_hf_checkpoint`` writes a random checkpoint in the same layout, with a config.json
transformers can load, without importing transformers (demo and benchmarks run without it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from typing import Optional

import torch

Tensor = torch.Tensor

__all__ = ["load_hf_weights", "write_random_hf_checkpoint", "checkpoint_layout", "family_of_config",
           "WeightsError"]

_FAMILY_BY_MODEL_TYPE = {"qwen3": "qwen3_dense", "deepseek_v3": "deepseek_v3"}
_ARCH = {"qwen3_dense": ("qwen3", "Qwen3ForCausalLM"),
         "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM")}
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
# kept in float32 whatever the load dtype (transformers does the same: routing is precision-sensitive)
_FP32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")


class WeightsError(ValueError):
    """A checkpoint does not match what its config.json describes."""


def _as_dict(obj) -> dict:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return dict(obj)


def family_of_config(config: dict) -> str:
    mt = config.get("model_type")
    if mt not in _FAMILY_BY_MODEL_TYPE:
        raise WeightsError(f"unsupported model_type {mt!r} in config.json (supported: {sorted(_FAMILY_BY_MODEL_TYPE)})")
    return _FAMILY_BY_MODEL_TYPE[mt]


def checkpoint_layout(family: str, dims: dict) -> dict[str, tuple]:
    """Checkpoint key -> shape, as a Hugging Face checkpoint of this family stores it (experts
    unstacked, ``lm_head.weight`` included even when tied)."""
    d = _as_dict(dims)
    H, V, L = d["hidden_size"], d["vocab_size"], d["num_hidden_layers"]
    Hq = d["num_attention_heads"]
    out: dict[str, tuple] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
                             "lm_head.weight": (V, H)}

    def mlp(prefix: str, inter: int) -> None:
        out[f"{prefix}.gate_proj.weight"] = (inter, H)
        out[f"{prefix}.up_proj.weight"] = (inter, H)
        out[f"{prefix}.down_proj.weight"] = (H, inter)

    for i in range(L):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (H,)
        out[f"{p}.post_attention_layernorm.weight"] = (H,)
        a = f"{p}.self_attn"
        if family == "qwen3_dense":
            D = d.get("head_dim") or H // Hq
            Hkv = d["num_key_value_heads"]
            out[f"{a}.q_proj.weight"] = (Hq * D, H)
            out[f"{a}.k_proj.weight"] = (Hkv * D, H)
            out[f"{a}.v_proj.weight"] = (Hkv * D, H)
            out[f"{a}.o_proj.weight"] = (H, Hq * D)
            out[f"{a}.q_norm.weight"] = (D,)
            out[f"{a}.k_norm.weight"] = (D,)
            mlp(f"{p}.mlp", d["intermediate_size"])
        elif family == "deepseek_v3":
            n, r, v = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
            R, qr = d["kv_lora_rank"], d.get("q_lora_rank")
            if qr:
                out[f"{a}.q_a_proj.weight"] = (qr, H)
                out[f"{a}.q_a_layernorm.weight"] = (qr,)
                out[f"{a}.q_b_proj.weight"] = (Hq * (n + r), qr)
            else:
                out[f"{a}.q_proj.weight"] = (Hq * (n + r), H)
            out[f"{a}.kv_a_proj_with_mqa.weight"] = (R + r, H)
            out[f"{a}.kv_a_layernorm.weight"] = (R,)
            out[f"{a}.kv_b_proj.weight"] = (Hq * (n + v), R)
            out[f"{a}.o_proj.weight"] = (H, Hq * v)
            if i < d["first_k_dense_replace"]:
                mlp(f"{p}.mlp", d["intermediate_size"])
            else:
                E, I = d["n_routed_experts"], d["moe_intermediate_size"]
                out[f"{p}.mlp.gate.weight"] = (E, H)
                out[f"{p}.mlp.gate.e_score_correction_bias"] = (E,)
                for e in range(E):
                    mlp(f"{p}.mlp.experts.{e}", I)
                if d.get("n_shared_experts", 0):
                    mlp(f"{p}.mlp.shared_experts", I * d["n_shared_experts"])
        else:
            raise WeightsError(f"unknown model family {family!r} (expected qwen3_dense or deepseek_v3)")
    return out


def _read_tensors(hf_dir: str) -> dict[str, Tensor]:
    from safetensors import safe_open

    single = os.path.join(hf_dir, "model.safetensors")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(single):
        files = {single: None}
    elif os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = {}
        for key, fname in weight_map.items():
            files.setdefault(os.path.join(hf_dir, fname), []).append(key)
    else:
        raise WeightsError(f"{hf_dir}: neither model.safetensors nor model.safetensors.index.json found")
    out: dict[str, Tensor] = {}
    for path, keys in files.items():
        if not os.path.exists(path):
            raise WeightsError(f"{hf_dir}: shard {os.path.basename(path)} named in the index is missing")
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            for key in (keys if keys is not None else sorted(present)):
                if key not in present:
                    raise WeightsError(f"{path}: index lists {key!r} but the shard does not hold it")
                out[key] = f.get_tensor(key)
    return out


def load_hf_weights(hf_dir: str, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Flat ``{checkpoint key: tensor}`` in ``dtype``, validated against config.json."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    family = family_of_config(config)
    layout = checkpoint_layout(family, config)
    raw = _read_tensors(hf_dir)
    L = config["num_hidden_layers"]

    if config.get("tie_word_embeddings") and "lm_head.weight" not in raw and "model.embed_tokens.weight" in raw:
        raw["lm_head.weight"] = raw["model.embed_tokens.weight"]

    # keys a loader may skip: layers past num_hidden_layers are DeepSeek's MTP module, and
    # rotary inv_freq buffers are recomputed from the config
    def ignorable(key: str) -> bool:
        m = _LAYER_KEY.match(key)
        return (m is not None and int(m.group(1)) >= L) or key.endswith("rotary_emb.inv_freq")

    missing = [k for k in layout if k not in raw]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"{hf_dir}: checkpoint is missing key(s) {missing[:5]}{more} for a {family} "
                           f"model as config.json describes it")
    unexpected = [k for k in raw if k not in layout and not ignorable(k)]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise WeightsError(f"{hf_dir}: unexpected checkpoint key(s) {unexpected[:5]}{more} for a {family} model")
    for key, shape in layout.items():
        got = tuple(raw[key].shape)
        if got != tuple(shape):
            raise WeightsError(f"{hf_dir}: {key} has shape {list(got)}, expected {list(shape)} from config.json")

    out: dict[str, Tensor] = {}
    stacks: dict[tuple[int, str], dict[int, Tensor]] = {}
    for key in layout:
        t = raw[key]
        m = _EXPERT_KEY.match(key)
        if m:
            stacks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = t
            continue
        out[key] = t.to(torch.float32 if key.endswith(_FP32_SUFFIXES) else dtype)
    for (layer, proj), per_expert in sorted(stacks.items()):
        tensors = [per_expert[e] for e in range(len(per_expert))]
        out[f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"] = torch.stack(tensors).to(dtype)
    return out


# --------------------------------------------------------------------------------------------
# random checkpoints
# --------------------------------------------------------------------------------------------

_QWEN3_DEFAULTS = dict(rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       max_position_embeddings=40960)
_DSV3_DEFAULTS = dict(rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      max_position_embeddings=163840, routed_scaling_factor=1.0, norm_topk_prob=True,
                      rope_interleave=True, rope_scaling=None, n_shared_experts=0)


def _hf_config(family: str, dims: dict, dtype: torch.dtype) -> dict:
    model_type, arch = _ARCH[family]
    d = dict(_QWEN3_DEFAULTS if family == "qwen3_dense" else _DSV3_DEFAULTS)
    d.update(dims)
    if family == "qwen3_dense" and not d.get("head_dim"):
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    cfg = {
        "architectures": [arch], "model_type": model_type,
        "dtype": str(dtype).replace("torch.", ""),
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    rope_params = {"rope_type": "default", "rope_theta": float(d["rope_theta"])}
    if family == "qwen3_dense":
        keys = ["num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                "max_position_embeddings"]
        cfg.update({k: d[k] for k in keys})
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=d["num_hidden_layers"],
                   layer_types=["full_attention"] * d["num_hidden_layers"])
    else:
        keys = ["num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size",
                "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group",
                "topk_group", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "rope_theta",
                "rope_interleave", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"]
        cfg.update({k: d[k] for k in keys})
        # MLA has one shared latent "kv head"; transformers wants the attention-head count here
        cfg.update(num_key_value_heads=d["num_attention_heads"], num_nextn_predict_layers=0,
                   topk_method="noaux_tc", scoring_func="sigmoid")
        scaling = d.get("rope_scaling")
        if scaling:
            scaling = _as_dict(scaling)
            kind = scaling.get("type", scaling.get("rope_type", "yarn"))
            scaling = {**scaling, "type": kind, "rope_type": kind}
            rope_params = {**scaling, "rope_theta": float(d["rope_theta"])}
        # legacy field (transformers 4.x, vLLM) and the transformers 5 one, kept consistent
        cfg["rope_scaling"] = scaling or None
    cfg["rope_parameters"] = rope_params
    return cfg


def write_random_hf_checkpoint(out_dir: str, family: str, dims: dict, seed: int = 0,
                               dtype: torch.dtype = torch.float32, tokenizer: bool = True) -> str:
    """Write ``config.json`` + ``model.safetensors`` with random weights; returns ``out_dir``.
    With ``tokenizer`` (and the ``tokenizers`` package installed) also a byte-level BPE tokenizer of
    exactly ``vocab_size`` tokens (``runtime.tokenizer.write_tokenizer``), so text prompts work.

    Scales keep activations and logits O(1): matrices ~ N(0, (1/sqrt(fan_in))^2) clipped to
    std 0.02..0.1, norms ~ 1 + N(0, 0.05^2), embeddings std 0.1 (normed right after), and a small
    random e_score_correction_bias so the biased routing choice is exercised."""
    from safetensors.torch import save_file

    if family not in _ARCH:
        raise WeightsError(f"unknown model family {family!r} (expected qwen3_dense or deepseek_v3)")
    dims = {k: (v if k != "rope_scaling" or v is None else _as_dict(v)) for k, v in _as_dict(dims).items()}
    cfg = _hf_config(family, dims, dtype)
    layout = checkpoint_layout(family, cfg)
    if cfg["tie_word_embeddings"]:
        layout.pop("lm_head.weight")  # tied checkpoints omit it; the loader re-adds it

    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, Tensor] = {}
    for key, shape in layout.items():
        if len(shape) == 1:
            if key.endswith("e_score_correction_bias"):
                t = 0.05 * torch.randn(shape, generator=g)
            else:  # RMSNorm weights
                t = 1.0 + 0.05 * torch.randn(shape, generator=g)
        elif key in ("model.embed_tokens.weight",):
            t = 0.1 * torch.randn(shape, generator=g)
        else:
            std = min(max(shape[1] ** -0.5, 0.02), 0.1)
            t = std * torch.randn(shape, generator=g)
        tensors[key] = t.to(torch.float32 if key.endswith(_FP32_SUFFIXES) else dtype).contiguous()

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer and importlib.util.find_spec("tokenizers") is not None:
        from .tokenizer import write_tokenizer

        write_tokenizer(out_dir, cfg["vocab_size"])
    return out_dir
