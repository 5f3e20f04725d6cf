"""The pool load is a graph node on the kv_load stream (insert_kv_load): it overlaps the forward
layer by layer, and only its events keep the forward from reading history blocks it has not loaded.

A cold engine puts a prompt's blocks into a pool; a second engine, with an empty cache, prefills the
same prompt with those blocks as history (``splitfuse``), its load slowed by fault injection. The
second engine's runtime is instrumented to time each layer's load and attention and to look at the
loaded block when layer 0's attention starts.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from graphgen.runtime import open_engine
from graphgen.runtime.core.faults import Faults
from graphgen.runtime.pool import HostPool

import e2e_util as u

LOAD_DELAY = 0.5  # per layer: long against a tiny layer's forward, even on a busy machine


def _instrument(eng):
    """Log (what, layer, start, end) of every kv_load and paged_attention; at each attention, also
    whether the layer's loaded blocks hold what the load staged (False: a stale block was read)."""
    log, lock = [], threading.Lock()
    rt, layers = eng.runner.rt, list(eng.cache)
    layer_of = {id(layer): i for i, layer in enumerate(layers)}
    staged: dict[int, tuple] = {}  # layer -> (block ids, the staged blocks of component 0)
    kv_load, attention = rt.kv_load, rt.paged_attention

    def timed_load(cache, loads, block_ids):
        i = layer_of[id(cache)]
        with lock:
            staged[i] = (block_ids.clone(), loads[0][:block_ids.numel()].clone())
        t = time.perf_counter()
        kv_load(cache, loads, block_ids)
        with lock:
            log.append(("load", i, t, time.perf_counter()))

    def timed_attention(q, cache, *args, **kw):
        i = layer_of[id(cache)]
        t = time.perf_counter()
        with lock:
            ids, want = staged.get(i, (None, None))
        fresh = want is not None and torch.equal(cache[0].index_select(0, ids), want)
        out = attention(q, cache, *args, **kw)
        with lock:
            log.append(("attn", i, t, time.perf_counter(), fresh))
        return out

    rt.kv_load, rt.paged_attention = timed_load, timed_attention
    return log


def drop_load_waits(variant: str, source: str) -> str:
    """The forward's waits on the load events removed (a negative control)."""
    out = [ln for ln in source.splitlines(keepends=True) if not ln.strip().startswith("rt.wait(ev['ev.L")
           or ".kv_load']" not in ln]
    return "".join(out)


def _warm_run(qwen, prompt, pool, hook=None):
    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", granularity="layer", pool=pool,
                          source_hook=hook, faults=Faults(load_delay_s=LOAD_DELAY), collect_logits=True) as eng:
        log = _instrument(eng)
        r = eng.generate([prompt], 1)[0]
        eng.drain()
    return r, log


@pytest.fixture(scope="module")
def pooled(qwen):
    prompt = u.rand_prompt(torch.Generator().manual_seed(53), 9)  # 2 full blocks + 1 token
    pool = HostPool(1 << 24)
    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", granularity="layer", pool=pool,
                          collect_logits=True) as eng:
        cold = eng.generate([prompt], 1)[0]
        eng.drain()
    assert cold.variant.startswith("mempool_prefill") and cold.hit_tokens == 0
    return prompt, pool, cold


def test_load_overlaps_the_forward_layer_by_layer(qwen, pooled):
    prompt, pool, cold = pooled
    warm, log = _warm_run(qwen, prompt, pool)
    assert warm.variant == "splitfuse" and warm.hit_tokens == 8  # 2 blocks came from the pool
    loads = {e[1]: e for e in log if e[0] == "load"}
    attns = {e[1]: e for e in log if e[0] == "attn"}
    last = max(loads)
    assert sorted(loads) == sorted(attns) == [0, 1]
    # layer 0 computes while the last layer's (slowed) load is still running ...
    assert attns[0][2] < loads[last][3], log
    # ... and every layer's attention starts after its own load finished, on the loaded blocks
    assert all(attns[i][2] >= loads[i][3] and attns[i][4] for i in loads), log
    # the history is the pool's: the same tokens and logits as the cold prefill computed
    assert warm.tokens == cold.tokens
    torch.testing.assert_close(warm.step_logits[0], cold.step_logits[0], rtol=1e-4, atol=1e-4)


def test_without_the_load_wait_the_forward_reads_a_stale_block(qwen, pooled):
    prompt, pool, cold = pooled
    hooked = []

    def hook(variant, source):
        new = drop_load_waits(variant, source)
        if new != source:
            hooked.append(variant)
        return new

    warm, log = _warm_run(qwen, prompt, pool, hook)
    assert warm.variant == "splitfuse" and "splitfuse" in hooked
    attn0 = next(e for e in log if e[0] == "attn" and e[1] == 0)
    assert not attn0[4], "without the wait, layer 0's attention must run before its block is loaded"
    assert not torch.allclose(warm.step_logits[0], cold.step_logits[0], rtol=1e-4, atol=1e-4)
