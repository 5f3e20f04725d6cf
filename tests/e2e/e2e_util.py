"""Helpers of the end-to-end tests: pooled-KV checks (the HF references, prompts and the CLI runner
are in ``tests/support``, re-exported here under the names the tests use).

Every expected value here is computed (by transformers, by an independent engine, or from the
pool contract), never written down, so each check can fail.
"""

from __future__ import annotations

import torch

from graphgen.runtime import Engine, open_engine
from graphgen.runtime.core.kvcache import PagedKVCache, unpack_block_into
from graphgen.runtime.pool import HostPool, block_keys

from support.cli import CLI_ENV, cli, cli_argv  # noqa: F401
from support.hf import ATOL, assert_greedy_by_hf, assert_steps_match_hf, rand_prompt  # noqa: F401
from support.paths import REPO, TINY_DSV3, TINY_QWEN3  # noqa: F401


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
