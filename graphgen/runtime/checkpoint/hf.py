"""Hugging Face checkpoint I/O for the CPU runtime.

``load_hf_weights`` reads ``model.safetensors`` (or a sharded ``model.safetensors.index.json``)
into a flat dict keyed by checkpoint names, checks every key and shape against the layout that
``config.json`` implies (the family's layout, graphgen/families), and stacks MoE experts into
``model.layers.N.mlp.experts.{gate,up,down}_proj.weight`` ``[E, ...]``.

``write_random_hf_checkpoint`` writes a random checkpoint in the same layout, with a config.json
transformers can load, without importing transformers (demo and benchmarks run without it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import torch

from ...families import BY_HF_MODEL_TYPE, FAMILIES
from .. import progress

Tensor = torch.Tensor

__all__ = ["load_hf_weights", "write_random_hf_checkpoint", "checkpoint_layout", "family_of_config",
           "WeightsError"]

_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


class WeightsError(ValueError):
    """A checkpoint does not match what its config.json describes."""


def family_of_config(config: dict) -> str:
    mt = config.get("model_type")
    if mt not in BY_HF_MODEL_TYPE:
        raise WeightsError(f"unsupported model_type {mt!r} in config.json (supported: {sorted(BY_HF_MODEL_TYPE)})")
    return BY_HF_MODEL_TYPE[mt].name


def _family(name: str):
    if name not in FAMILIES:
        raise WeightsError(f"unknown model family {name!r} (expected {' or '.join(FAMILIES)})")
    return FAMILIES[name]


def checkpoint_layout(family: str, dims, mtp_layers: int = 0) -> dict[str, tuple]:
    """Checkpoint key -> shape, as a Hugging Face checkpoint of this family stores it (experts
    unstacked, ``lm_head.weight`` included even when tied); ``dims`` is a dims object or a
    config.json dict; ``mtp_layers``: with that many MTP layers (DeepSeek-V3). The family's layout
    (graphgen/families) is the one source."""
    fam = _family(family)
    try:
        extra = {"mtp_layers": mtp_layers} if mtp_layers else {}
        return fam.checkpoint_layout(fam.dims_of(dims), **extra)
    except TypeError as e:  # a required dim is missing from the config
        raise WeightsError(f"config.json does not describe a {family} model: {e}") from None


def _empty(shape) -> bool:
    return 0 in tuple(shape)


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
    report = progress.current_progress()  # bytes read, for the start's progress lines (graphgen.runtime.progress)
    report.phase("load", total=sum(os.path.getsize(p) for p in files if os.path.exists(p)))
    for path, keys in files.items():
        if not os.path.exists(path):
            raise WeightsError(f"{hf_dir}: shard {os.path.basename(path)} named in the index is missing")
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            for key in (keys if keys is not None else sorted(present)):
                if key not in present:
                    raise WeightsError(f"{path}: index lists {key!r} but the shard does not hold it")
                out[key] = t = f.get_tensor(key)
                report.advance(t.numel() * t.element_size())
    return out


def load_hf_weights(hf_dir: str, dtype: torch.dtype = torch.float32, mtp_layers: int = 0) -> dict[str, Tensor]:
    """Flat ``{checkpoint key: tensor}`` in ``dtype``, validated against config.json. ``mtp_layers``:
    also load that many of DeepSeek-V3's MTP layers (``model.layers.{num_hidden_layers + k}.*``,
    graphgen.families.mtp); an MTP layer's ``embed_tokens`` / ``shared_head.head`` the checkpoint
    omits is the target's tensor (shared, not copied)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    family = family_of_config(config)
    declared = FAMILIES[family].mtp_layers_of_config(config)
    if mtp_layers > declared:
        raise WeightsError(f"{hf_dir}: the spec has {mtp_layers} MTP layer(s) but config.json declares "
                           f"num_nextn_predict_layers: {declared}; use a checkpoint with MTP layers or remove "
                           f"the spec's mtp: section")
    layout = checkpoint_layout(family, config, mtp_layers)
    fp32 = FAMILIES[family].fp32_suffixes
    raw = _read_tensors(hf_dir)
    L = config["num_hidden_layers"]

    if config.get("tie_word_embeddings") and "lm_head.weight" not in raw and "model.embed_tokens.weight" in raw:
        raw["lm_head.weight"] = raw["model.embed_tokens.weight"]
    if mtp_layers:
        from ...families.mtp import shared_keys

        for key, target in shared_keys(FAMILIES[family].dims_of(config), mtp_layers).items():
            if key not in raw and target in raw:
                raw[key] = raw[target]

    # keys a loader may skip: layers past the loaded ones are DeepSeek's MTP module (not asked
    # for), and rotary inv_freq buffers are recomputed from the config
    def ignorable(key: str) -> bool:
        m = _LAYER_KEY.match(key)
        return (m is not None and int(m.group(1)) >= L + mtp_layers) or key.endswith("rotary_emb.inv_freq")

    # zero-size entries are weights the model does not have (n_shared_experts: 0): transformers
    # writes them empty, other writers leave them out; either way they are not loaded
    missing = [k for k, shape in layout.items() if k not in raw and not _empty(shape)]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise WeightsError(f"{hf_dir}: checkpoint is missing key(s) {missing[:5]}{more} for a {family} "
                           f"model as config.json describes it")
    unexpected = [k for k in raw if k not in layout and not ignorable(k)]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise WeightsError(f"{hf_dir}: unexpected checkpoint key(s) {unexpected[:5]}{more} for a {family} model")
    for key, shape in layout.items():
        if key not in raw:  # an absent empty weight
            continue
        got = tuple(raw[key].shape)
        if got != tuple(shape):
            raise WeightsError(f"{hf_dir}: {key} has shape {list(got)}, expected {list(shape)} from config.json")

    out: dict[str, Tensor] = {}
    stacks: dict[tuple[int, str], dict[int, Tensor]] = {}
    converted: dict[int, Tensor] = {}  # one converted tensor per source tensor: shared stays shared
    for key, shape in layout.items():
        if _empty(shape):
            continue
        t = raw[key]
        m = _EXPERT_KEY.match(key)
        if m:
            stacks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = t
            continue
        if id(t) not in converted:
            converted[id(t)] = t.to(torch.float32 if fp32 and key.endswith(fp32) else dtype)
        out[key] = converted[id(t)]
    for (layer, proj), per_expert in sorted(stacks.items()):
        tensors = [per_expert[e] for e in range(len(per_expert))]
        out[f"model.layers.{layer}.mlp.experts.{proj}_proj.weight"] = torch.stack(tensors).to(dtype)
    return out


# --------------------------------------------------------------------------------------------
# random checkpoints
# --------------------------------------------------------------------------------------------

def write_random_hf_checkpoint(out_dir: str, family: str, dims: dict, seed: int = 0,
                               dtype: torch.dtype = torch.float32, tokenizer: bool = True,
                               mtp_layers: int = 0, mtp_copies: bool = True) -> str:
    """Write ``config.json`` + ``model.safetensors`` with random weights; returns ``out_dir``.
    With ``tokenizer`` (and the ``tokenizers`` package installed) also a byte-level BPE tokenizer of
    exactly ``vocab_size`` tokens (``runtime.tokenizer.write_tokenizer``), so text prompts work.
    ``eos_token_id`` in ``config.json`` is that tokenizer's EOS (``tokenizer.eos_token``; written even
    without the ``tokenizers`` package), so ``graphgen run``/``serve`` stop where it would.

    Scales keep activations and logits O(1): matrices ~ N(0, (1/sqrt(fan_in))^2) clipped to
    std 0.02..0.1, norms ~ 1 + N(0, 0.05^2), embeddings std 0.1 (normed right after), and a small
    random e_score_correction_bias so the biased routing choice is exercised.

    ``mtp_layers``: also that many DeepSeek-V3 MTP layers (``num_nextn_predict_layers`` in
    config.json), drawn after every target tensor (so the target's weights equal the checkpoint's
    without MTP of the same seed); their ``embed_tokens`` / ``shared_head.head`` are copies of the
    target's, as DeepSeek publishes them, or left out (``mtp_copies=False``: the loader shares the
    target's)."""
    from safetensors.torch import save_file

    fam = _family(family)
    d = fam.dims_of(dims)
    dtype_name = str(dtype).replace("torch.", "")
    cfg = fam.hf_config(d, dtype_name, mtp_layers) if mtp_layers else fam.hf_config(d, dtype_name)
    layout = checkpoint_layout(family, d, mtp_layers)
    copies = {}
    if mtp_layers:
        from ...families.mtp import shared_keys

        copies = shared_keys(d, mtp_layers)
        for key in copies:
            layout.pop(key)
    from .tokenizer import eos_token_ids_of

    eos = eos_token_ids_of(cfg["vocab_size"], family)  # the EOS of the tokenizer written below ([]: none fits)
    cfg["eos_token_id"] = (eos[0] if len(eos) == 1 else eos) if eos else None
    if cfg["tie_word_embeddings"]:
        layout.pop("lm_head.weight")  # tied checkpoints omit it; the loader re-adds it

    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, Tensor] = {}
    for key, shape in layout.items():
        if _empty(shape):  # written empty, as transformers does (n_shared_experts: 0)
            t = torch.zeros(shape)
        elif len(shape) == 1:
            if key.endswith("e_score_correction_bias"):
                t = 0.05 * torch.randn(shape, generator=g)
            else:  # RMSNorm weights
                t = 1.0 + 0.05 * torch.randn(shape, generator=g)
        elif key in ("model.embed_tokens.weight",):
            t = 0.1 * torch.randn(shape, generator=g)
        else:
            std = min(max(shape[1] ** -0.5, 0.02), 0.1)
            t = std * torch.randn(shape, generator=g)
        fp32 = fam.fp32_suffixes
        tensors[key] = t.to(torch.float32 if fp32 and key.endswith(fp32) else dtype).contiguous()
    if mtp_copies:
        for key, target in copies.items():
            tensors[key] = tensors[target if target in tensors else "model.embed_tokens.weight"].clone()

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer and importlib.util.find_spec("tokenizers") is not None:
        from .tokenizer import write_tokenizer

        write_tokenizer(out_dir, cfg["vocab_size"], family=family)
    return out_dir


def check_config(spec, hf_dir) -> None:
    """The checkpoint's config.json must describe the spec's model (family and every stated dim);
    ``ValueError``/``FileNotFoundError`` naming the mismatch and the fix otherwise."""
    import dataclasses
    import json
    from pathlib import Path

    hf_dir = Path(hf_dir)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path}: no config.json (expected a Hugging Face checkpoint folder)")
    cfg = json.loads(cfg_path.read_text())
    try:
        family = family_of_config(cfg)
    except WeightsError as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    fix = f"create a matching spec with: graphgen import-hf {hf_dir} --out specs/NAME.yaml"
    if family != spec.family:
        raise ValueError(f"{cfg_path} does not match spec {spec.name} (model_type {cfg.get('model_type')!r} is "
                         f"family {family}, the spec is {spec.family}); {fix}")
    # Every dim the config states must agree (same family => same field names). Not compared:
    # max_position_embeddings (a context limit, not a weight or numeric property) and the RoPE
    # fields, which transformers 5 nests under rope_parameters.
    skip = {"max_position_embeddings", "rope_theta", "rope_scaling"}
    wrong = [(k, cfg[k], v) for k, v in dataclasses.asdict(spec.dims).items()
             if k not in skip and cfg.get(k) is not None and cfg[k] != v]
    if wrong:
        desc = ", ".join(f"{k}: checkpoint {a} vs spec {b}" for k, a, b in wrong)
        raise ValueError(f"{cfg_path} does not match spec {spec.name} ({desc}); {fix}")
    declared = FAMILIES[family].mtp_layers_of_config(cfg)
    if spec.mtp_layers > declared:
        raise ValueError(f"{cfg_path} does not match spec {spec.name}: the spec has mtp: {{num_layers: "
                         f"{spec.mtp_layers}}} but the checkpoint declares num_nextn_predict_layers: {declared}; "
                         f"use a checkpoint with MTP layers, or remove the spec's mtp: section")
