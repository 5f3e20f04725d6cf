"""The pool load is a graph node on the kv_load stream (insert_kv_load): it overlaps the forward
layer by layer, and only its events keep the forward from reading history blocks it has not loaded.

A cold engine puts a prompt's blocks into a pool; a second engine, with an empty cache, prefills the
same prompt with those blocks as history (``splitfuse``), its load slowed by fault injection. The
second engine's runtime is instrumented to time each layer's load and attention and to look at the
loaded block when layer 0's attention starts. Without timing (issue 17 item 6): a long hit loaded
with the first chunk, its last layer's load held by a gate, still computes layer 0 (layer-wise
load); loaded as a whole prefix (granularity forward) it computes nothing until the gate opens.
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
    assert sorted(loads) == sorted(attns) == [0, 1]
    # that layer 0 computes while a later layer's load is still running is proven by order, not by these
    # clocks (a busy scheduler need not interleave them): the gated test below holds the last load closed
    # and sees layer 0's attention finish. Here: every layer's attention starts after its own load
    # finished (its event: an order the events enforce), on the loaded blocks
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


def _gated_warm_run(qwen, prompt, pool, granularity: str, wait_s: float):
    """A warm prefill (its first chunk: the pool hit is loaded with it, budget 8) whose load of the
    LAST layer is held back by a gate. Returns (whether layer 0's attention finished while the gate
    was closed, within ``wait_s``; the log at that moment; the request's result)."""
    gate, attn0 = threading.Event(), threading.Event()
    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", granularity=granularity, pool=pool,
                     max_num_batched_tokens=8, collect_logits=True) as eng:
        log = _instrument(eng)
        rt, last = eng.runner.rt, len(list(eng.cache)) - 1
        load, attention = rt.kv_load, rt.paged_attention
        layer_of = {id(layer): i for i, layer in enumerate(eng.cache)}

        def gated_load(cache, loads, block_ids):
            if layer_of[id(cache)] == last:
                gate.wait(30)
            load(cache, loads, block_ids)

        def seen_attention(q, cache, *args, **kw):
            out = attention(q, cache, *args, **kw)
            if layer_of[id(cache)] == 0:
                attn0.set()
            return out

        rt.kv_load, rt.paged_attention = gated_load, seen_attention
        box = {}
        t = threading.Thread(target=lambda: box.update(r=eng.generate([prompt], 1)[0]))
        t.start()
        computed = attn0.wait(wait_s)
        snapshot = list(log)
        gate.set()
        t.join(60)
        eng.drain()
    return computed, snapshot, box["r"]


@pytest.fixture(scope="module")
def long_pooled(qwen):
    prompt = u.rand_prompt(torch.Generator().manual_seed(54), 30)  # 7 full blocks + 2 tokens
    pool = HostPool(1 << 24)
    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", granularity="layer", pool=pool,
                     max_num_batched_tokens=8, collect_logits=True) as eng:
        cold = eng.generate([prompt], 1)[0]
        eng.drain()
    return prompt, pool, cold


def test_layer_wise_load_of_a_long_hit_computes_earlier_layers_while_a_later_layers_load_is_held(qwen, long_pooled):
    """Layer i's attention waits for layer i's load only: with the last layer's load gated shut,
    layer 0's attention over the loaded history completes (on the loaded blocks), and nothing of the
    last layer runs before the gate opens."""
    prompt, pool, cold = long_pooled
    computed, log, warm = _gated_warm_run(qwen, prompt, pool, "layer", wait_s=30)
    assert computed and warm.variant == "splitfuse" and warm.hit_tokens == 28
    assert [e[1] for e in log if e[0] == "load"] == [0] and [e[1] for e in log if e[0] == "attn"] == [0]
    assert log[-1][4], "layer 0 attended to blocks other than the loaded ones"
    assert warm.tokens == cold.tokens
    torch.testing.assert_close(warm.step_logits[0], cold.step_logits[0], rtol=1e-4, atol=1e-4)


def test_a_whole_prefix_load_holds_every_layer_until_the_last_layers_load(qwen, long_pooled):
    """The comparison (granularity forward): one load event for the whole prefix, so the gated last
    layer holds layer 0's attention too: the test above can tell the two apart."""
    prompt, pool, cold = long_pooled
    computed, log, warm = _gated_warm_run(qwen, prompt, pool, "forward", wait_s=1.0)
    assert not computed and not [e for e in log if e[0] == "attn"]
    assert warm.variant == "splitfuse" and warm.tokens == cold.tokens


@pytest.mark.parametrize("granularity", ["forward", "layer"])
def test_a_pool_hit_read_in_place_gives_the_cold_logits_and_lets_go_of_the_pool(qwen, pooled, granularity):
    # HostPool lends the hit's run (its values were put in order): the load staging is the pool's
    # memory, the graph's kv_load reads it there. The tokens and logits are the cold prefill's, and
    # once the request is done nothing holds the lend (a leaked reader would pin pool values forever)
    prompt, pool, cold = pooled
    lends = pool.stats()["lends"]
    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", granularity=granularity, pool=pool,
                     collect_logits=True) as eng:
        warm = eng.generate([prompt], 1)[0]
        eng.drain()
        assert warm.hit_tokens == 8 and warm.tokens == cold.tokens
        torch.testing.assert_close(warm.step_logits[0], cold.step_logits[0], rtol=1e-4, atol=1e-4)
        assert pool.stats()["lends"] == lends + 1 and pool.stats()["live_lends"] == 0
