"""LoRA test helpers: the tiny LoRA specs, HF dims from a spec, and random PEFT adapters written with peft."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SPECS = {"qwen3_dense": ROOT / "specs/tiny_qwen3_lora.yaml", "deepseek_v3": ROOT / "specs/tiny_deepseek_v3_lora.yaml"}
def hf_dims(spec) -> dict:
    d = dataclasses.asdict(spec.dims)
    d.setdefault("max_position_embeddings", 512)
    return d


def write_adapter(base, out: Path, targets, r: int, alpha: float, rslora: bool, seed: int):
    """A random PEFT LoRA adapter over ``base`` (B non-zero: init_lora_weights=False), saved as published;
    returns peft's model with it (the reference)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                           use_rslora=rslora, init_lora_weights=False))
    with torch.no_grad():  # O(1) deltas at these scales, so a missing or misplaced delta shows in the logits
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5 / p.std().clamp_min(1e-6) * p.shape[-1] ** -0.5)
    model.save_pretrained(str(out))
    return model.eval()




def assert_greedy_within(model, prompt: list[int], tokens: list[int], tol: float = 1e-3, what: str = "") -> None:
    """``tokens`` is a greedy continuation of ``prompt`` under ``model`` (teacher forcing, one forward): each
    token's reference logit is within ``tol`` of the position's max -- the argmax, or a tie the float rounding
    of another implementation may break either way (no exact-token assert at a near tie)."""
    from .hf import hf_step_logits

    ref = hf_step_logits(model, prompt, tokens)
    for i, t in enumerate(tokens):
        gap = (ref[i].max() - ref[i, t]).item()
        assert gap <= tol, f"{what}: token {i} ({t}) is {gap:.3g} below the reference's best ({ref[i].argmax().item()})"
