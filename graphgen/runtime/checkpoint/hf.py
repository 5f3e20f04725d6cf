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

import torch

from .index import EXPERT_KEY as _EXPERT_KEY
from ...families import FAMILIES
from .index import CheckpointIndex, WeightsError, _empty, _family, checkpoint_layout, family_of_config
from .stream import SliceReader, dequantize_blocks
from ..progress import current_progress

Tensor = torch.Tensor

__all__ = ["load_hf_weights", "write_random_hf_checkpoint", "checkpoint_layout", "family_of_config",
           "WeightsError"]


def load_hf_weights(hf_dir: str, dtype: torch.dtype = torch.float32, mtp_layers: int = 0) -> dict[str, Tensor]:
    """Flat ``{checkpoint key: tensor}`` in ``dtype``, validated against config.json. ``mtp_layers``:
    also load that many of DeepSeek-V3's MTP layers (``model.layers.{num_hidden_layers + k}.*``,
    graphgen.families.mtp); an MTP layer's ``embed_tokens`` / ``shared_head.head`` the checkpoint
    omits is the target's tensor (shared, not copied). The whole model in one process: the CPU
    reference path and tests; a rank streams its own slices instead
    (`graphgen.runtime.checkpoint.stream.CheckpointWeights`). An FP8 checkpoint's weights come dequantized
    (fp8 x block scale, `graphgen.runtime.checkpoint.stream.dequantize_blocks`)."""
    index = CheckpointIndex.open(hf_dir, mtp_layers)
    fp32 = _family(index.family).fp32_suffixes
    out: dict[str, Tensor] = {}
    stacks: dict[tuple[int, str], dict[int, Tensor]] = {}
    converted: dict[int, Tensor] = {}  # one converted tensor per stored tensor: shared stays shared
    report = current_progress()  # bytes read, for the start's progress lines (graphgen.runtime.progress)
    report.phase("load", total=sum(src.nbytes for src in {id(s): s for s in index.tensors.values()}.values()))
    with SliceReader() as reader:
        for key, src in index.tensors.items():
            if id(src) not in converted:
                want = torch.float32 if fp32 and key.endswith(fp32) else dtype
                scale = index.scale_of(src)
                if scale is None:
                    converted[id(src)] = reader.read(src).to(want, copy=True)
                else:  # FP8: its block scales first (one read buffer), then the weight, dequantized
                    blocks = reader.read(scale.src).clone()
                    converted[id(src)] = dequantize_blocks(reader.read(src), blocks, scale.block).to(want)
                report.advance(src.nbytes)
            m = _EXPERT_KEY.match(key)
            if m:
                stacks.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = converted[id(src)]
            else:
                out[key] = converted[id(src)]
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
    _check_quantization(spec, cfg, cfg_path, fix)
    declared = FAMILIES[family].mtp_layers_of_config(cfg)
    if spec.mtp_layers > declared:
        raise ValueError(f"{cfg_path} does not match spec {spec.name}: the spec has mtp: {{num_layers: "
                         f"{spec.mtp_layers}}} but the checkpoint declares num_nextn_predict_layers: {declared}; "
                         f"use a checkpoint with MTP layers, or remove the spec's mtp: section")


def _check_quantization(spec, cfg: dict, cfg_path, fix: str) -> None:
    """The spec's ``quantization.checkpoint`` must be what config.json's ``quantization_config`` says (an
    FP8 block size, or none): the loader reads what the spec declares."""
    from ...modelspec.import_hf import fp8_checkpoint_of

    fp8, refused = fp8_checkpoint_of(cfg.get("quantization_config"))
    if refused:
        raise ValueError(f"{cfg_path}: quantization_config: {refused[0]}")
    declared = spec.quantization.checkpoint
    if fp8 == declared:
        return
    have = f"an fp8 checkpoint with {list(fp8.weight_block_size)} blocks" if fp8 else "no quantization_config"
    says = (f"quantization: {{checkpoint: {{weight_block_size: {list(declared.weight_block_size)}}}}}" if declared
            else "no quantization.checkpoint")
    want = (f"add 'quantization: {{checkpoint: {{quant_method: fp8, weight_block_size: "
            f"{list(fp8.weight_block_size)}}}}}' to the spec" if fp8 else "remove the spec's quantization.checkpoint")
    raise ValueError(f"{cfg_path} does not match spec {spec.name}: config.json has {have} but the spec has "
                     f"{says}; {want}, or {fix}")
