"""Shared helpers for the end-to-end tests: Hugging Face references, prompts, pooled-KV checks.

Every expected value here is computed (by transformers, by an independent engine, or from the
pool contract), never written down, so each check can fail.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from graphgen.runtime import Engine, open_engine
from graphgen.runtime.core.kvcache import PagedKVCache, unpack_block_into
from graphgen.runtime.pool import HostPool, block_keys

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-4
TINY_QWEN3 = REPO / "specs" / "tiny_qwen3.yaml"
TINY_DSV3 = REPO / "specs" / "tiny_deepseek_v3.yaml"


def _load_hf_models():
    # tests/runtime is not a package; load its helper by path under a private name so it does not
    # shadow (or get shadowed by) the copy tests/runtime imports as ``hf_models``.
    spec = importlib.util.spec_from_file_location("graphgen_e2e_hf_models", REPO / "tests" / "runtime" / "hf_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hfm = _load_hf_models()


# one intra-op thread in CLI subprocesses too (tiny models; see conftest._one_torch_thread)
CLI_ENV = dict(os.environ, OMP_NUM_THREADS="1")


def cli_argv(*args) -> list[str]:
    return [sys.executable, "-m", "graphgen.cli", *map(str, args)]


def cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """``graphgen <args>`` in a subprocess, from the repo root (where ``generated/`` lives)."""
    return subprocess.run(cli_argv(*args), cwd=REPO, env=CLI_ENV, capture_output=True, text=True,
                          timeout=timeout)


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


def keys_of(engine: Engine, prompt: list[int]) -> list[str]:
    """Pool keys of the prompt's full blocks, from the public key function (not the engine's)."""
    return block_keys(prompt, engine.block_size, model=engine.spec.name, layout=engine.cache.layout)


def reference_blocks(spec_path, weights, prompts, **kw) -> tuple[dict[str, bytes], list[list[int]]]:
    """(key -> packed block bytes, first tokens) from an independent engine that writes
    synchronously (no delays, no faults, a pool big enough to keep everything): what a correct save
    must put in the pool. Prompts run one at a time, first token only."""
    pool = HostPool(1 << 26)
    with open_engine(spec_path, weights, write="sync", pool=pool, **kw) as eng:
        tokens = [r.tokens for r in eng.generate(prompts, 1)]
        eng.drain()
        keys = {k for p in prompts for k in keys_of(eng, p)}
    assert keys and all(pool.contains(k) for k in keys), "the sync reference must save every full block"
    return {k: pool.get(k) for k in keys}, tokens


def pooled_mismatches(pool, keys, ref: dict[str, bytes]) -> tuple[list[str], list[str]]:
    """(missing keys, keys whose pooled bytes differ from the reference)."""
    missing, wrong = [], []
    for k in keys:
        v = pool.get(k)
        if v is None:
            missing.append(k)
        elif v != ref[k]:
            wrong.append(k)
    return missing, wrong


@torch.no_grad()
def assert_blocks_match_hf_cache(model, engine: Engine, prompt: list[int], ref: dict[str, bytes]) -> None:
    """Anchor the byte reference to transformers: each pooled block, unpacked, equals (atol 1e-4)
    the slice of the cache HF builds for the same prompt (qwen3: k, v [Hkv, T, D]; deepseek_v3:
    the compressed latent and k_pe, each [1, T, d])."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    hf_cache = getattr(out, "cache", None) or out.past_key_values
    bs = engine.block_size
    one = PagedKVCache(engine.cache.num_layers, engine.cache.component_shapes, 1, engine.dtype)
    for j, key in enumerate(keys_of(engine, prompt)):
        unpack_block_into(one, 0, ref[key])
        for layer in range(one.num_layers):
            hf_layer = hf_cache.layers[layer]
            for comp, hf_t in zip(one[layer], (hf_layer.keys, hf_layer.values)):
                want = hf_t[0].transpose(0, 1)[j * bs:(j + 1) * bs].reshape(comp.shape[1:])
                err = (comp[0] - want).abs().max().item()
                assert err <= ATOL, f"block {j} layer {layer}: pooled KV vs HF cache max |diff| {err:.3g}"
