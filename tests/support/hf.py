"""Tiny random Hugging Face reference models, and the transformers references the tests compare to.

Dims use Hugging Face config names (the same dicts ``write_random_hf_checkpoint`` takes).
transformers' own init (std 0.02, unit norms, zero routing bias) gives near-constant logits that
would hide mistakes at ``atol=1e-4``, so every weight is re-drawn at O(1)-activation scales.
"""

from __future__ import annotations

import os

import torch

ATOL = 1e-4

QWEN3_DIMS = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=512)

DSV3_DIMS = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 vocab_size=256, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                 n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                 routed_scaling_factor=1.5, norm_topk_prob=False, rope_theta=10000.0, rope_interleave=True,
                 rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=512)

# grouped routing (8 experts in 4 groups, 2 groups kept) and YaRN with mscale != mscale_all_dim,
# so both the cos/sin attention factor and the softmax mscale^2 differ from 1. theta=100 with an
# original context of 64 puts YaRN's ramp inside the 4 rotary frequencies (correction dims -0.99
# and 2.02), so the blend and its floor/ceil truncation show in the logits of short prompts.
DSV3_GROUPED_YARN_DIMS = dict(
    DSV3_DIMS, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, num_hidden_layers=3,
    routed_scaling_factor=2.5, norm_topk_prob=True, rope_theta=100.0, max_position_embeddings=256,
    rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8))


def hf_config(family: str, dims: dict):
    from transformers import DeepseekV3Config, Qwen3Config

    d = dict(dims)
    if family == "qwen3_dense":
        return Qwen3Config(**d)
    if family == "deepseek_v3":
        d["num_key_value_heads"] = d["num_attention_heads"]
        scaling = d.pop("rope_scaling", None)
        rope = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        if scaling:
            rope = {**scaling, "rope_type": scaling["type"], "rope_theta": rope["rope_theta"]}
        return DeepseekV3Config(rope_parameters=rope, **d)
    raise ValueError(family)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw all weights: matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), routing bias
    ~ N(0, 0.1^2) (large enough to change some expert choices), embeddings N(0, 0.5^2)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in model.state_dict().items():
        if not t.is_floating_point() or not t.numel():  # empty: n_shared_experts 0
            continue
        if name.endswith("e_score_correction_bias"):
            new = 0.1 * torch.randn(t.shape, generator=g)
        elif t.dim() == 1:
            new = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            new = 0.5 * torch.randn(t.shape, generator=g)
        else:
            new = torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5
        t.copy_(new.to(t.dtype))


def build_hf_model(family: str, dims: dict, out_dir: str, seed: int = 0):
    """Build a random float32 HF model, save_pretrained it to ``out_dir``; returns (model, out_dir)."""
    from transformers import DeepseekV3ForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cls = Qwen3ForCausalLM if family == "qwen3_dense" else DeepseekV3ForCausalLM
    config = hf_config(family, dims)
    config._attn_implementation = "eager"
    model = cls(config).to(torch.float32).eval()
    randomize_(model, seed)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    return model, out_dir


def load_hf_model(family: str, hf_dir: str, **kw):
    from transformers import DeepseekV3ForCausalLM, Qwen3ForCausalLM

    cls = Qwen3ForCausalLM if family == "qwen3_dense" else DeepseekV3ForCausalLM
    return cls.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32,
                               attn_implementation="eager", **kw)


@torch.no_grad()
def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits at the last position of one unpadded prompt (full forward, no cache)."""
    return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def rand_prompt(gen: torch.Generator, n: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


@torch.no_grad()
def hf_logits(model, seq: list[int]) -> torch.Tensor:
    """Logits at every position of ``seq`` (one full forward, no cache): [len(seq), V]."""
    return model(input_ids=torch.tensor([seq])).logits[0].float()


def hf_step_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF logits for each generated step: the full sequence (prompt + generated tokens but the last)
    in one forward; row i predicts generated token i."""
    seq = list(prompt) + list(tokens[:-1])
    return hf_logits(model, seq)[len(prompt) - 1:]


def assert_greedy_by_hf(model, prompt: list[int], tokens: list[int], what: str = "") -> torch.Tensor:
    """``tokens`` is transformers' greedy continuation of ``prompt``: with the tokens fed back
    (teacher forcing, one forward), each must be the argmax at its position -- exactly the greedy
    loop's condition. Returns the HF step logits for further checks."""
    ref = hf_step_logits(model, prompt, tokens)
    want = ref.argmax(-1).tolist()
    assert list(tokens) == want, f"{what}: engine tokens {list(tokens)} != HF greedy {want}"
    return ref


def assert_steps_match_hf(model, result, what: str) -> None:
    """Every generated step's engine logits vs transformers on the full sequence, atol 1e-4."""
    assert len(result.step_logits) == len(result.tokens) > 0, what
    ref = hf_step_logits(model, result.prompt, result.tokens)
    for i, row in enumerate(result.step_logits):
        err = (row - ref[i]).abs().max().item()
        assert err <= ATOL, f"{what}: step {i} (position {len(result.prompt) - 1 + i}) max |diff| {err:.3g} > {ATOL}"


def hf_mtp_reference(ckpt: str, L: int):
    """transformers' DeepseekV3ForCausalLM and an ``MtpModel(main, 1)`` holding the checkpoint's MTP
    layer (``MtpModel.from_pretrained`` finds MTP tensors only in 61-layer checkpoints): its decoder
    block is layer L of the checkpoint loaded as an (L+1)-layer model (the checkpoint's expert-per-key
    tensors, and an FP8 checkpoint's block scales, go through transformers' own conversion), its norms
    and eh_proj the checkpoint's tensors."""
    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpModel

    main = load_hf_model("deepseek_v3", ckpt).eval()
    mtp = MtpModel(main, 1).eval()
    longer = load_hf_model("deepseek_v3", ckpt, num_hidden_layers=L + 1)
    mtp.layers[0].mtp_block.load_state_dict(longer.model.layers[L].state_dict())
    raw = load_file(f"{ckpt}/model.safetensors")
    p = f"model.layers.{L}"
    with torch.no_grad():
        for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("shared_head.norm", "post_norm")):
            getattr(mtp.layers[0], theirs).weight.copy_(raw[f"{p}.{ours}.weight"])
    return main, mtp
