"""Acceptance 3 and 4: what the save stream puts in the pool is exactly the KV the forward computed.

3. With the save stream delayed: pooled blocks are bit-identical to an independent synchronous
   engine's (itself anchored to transformers' KV cache at 1e-4); no key is visible before its save
   has completed; a request that ends right after prefill does not let its device blocks be reused
   while the save still has to read them (negative control: without pins, the check fails).
4. The event is what makes it correct: drop the save stream's wait(s) from the generated
   mempool_prefill module and delay the forward stream; the same check then sees wrong bytes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch

import e2e_util as u

from graphgen.runtime import Engine, open_engine
from graphgen.runtime.core.faults import Faults
from graphgen.runtime.pool import HostPool
from support.hooks import drop_save_waits

SAVE_DELAY = 0.03     # per save op: long next to a tiny forward (~1 ms), short for the suite
FORWARD_DELAY = 0.04  # per KV write: a save that does not wait reads before this write


def _model(request, family):
    return (u.TINY_QWEN3, request.getfixturevalue("qwen")) if family == "qwen3_dense" else \
        (u.TINY_DSV3, request.getfixturevalue("tiny_dsv3"))


class RecordingPool(HostPool):
    """A HostPool that remembers when each put started (to order commits against save copies)."""

    def __init__(self, capacity_bytes: int = 1 << 24):
        super().__init__(capacity_bytes)
        self.put_times: list[float] = []

    def put(self, key, value):
        self.put_times.append(time.perf_counter())
        return super().put(key, value)


def _record_save_copies(eng: Engine) -> list[float]:
    """Completion time of every copy into staging (rt.kv_save; the bulk save calls it per layer)."""
    done: list[float] = []
    orig = eng.runner.rt.kv_save

    def kv_save(*a, **k):
        orig(*a, **k)
        done.append(time.perf_counter())

    eng.runner.rt.kv_save = kv_save
    return done


@pytest.mark.parametrize("gran", ["forward", "layer"])
@pytest.mark.parametrize("family", ["qwen3_dense", "deepseek_v3"])
def test_delayed_save_pools_exact_kv_and_only_after_it_completes(family, gran, request):
    spec, hf = _model(request, family)
    p = u.rand_prompt(torch.Generator().manual_seed(41), 13)   # 3 full blocks + 1 token
    ref, ref_tokens = u.reference_blocks(spec, hf.dir, [p])
    pool = RecordingPool()
    gate = threading.Event()   # every save op waits on it (then lags SAVE_DELAY): held until we looked
    with open_engine(spec, hf.dir, write="async", granularity=gran, pool=pool,
                          faults=Faults(save_delay_s=SAVE_DELAY, save_gate=gate)) as eng:
        copies = _record_save_copies(eng)
        keys = u.keys_of(eng, p)
        try:
            r = eng.generate([p], 1)[0]
            # generate() returned with the first token while the save is held: nothing is visible
            visible_early = [k for k in keys if pool.contains(k)]
            held_copies = len(copies)
        finally:
            gate.set()
        eng.drain()
        missing, wrong = u.pooled_mismatches(pool, keys, ref)
        u.assert_blocks_match_hf_cache(hf.model, eng, p, ref)   # the reference is transformers' KV
    assert r.tokens == ref_tokens[0]
    assert len(keys) == 3 and r.saved_blocks == 3
    assert visible_early == [] and held_copies == 0   # the gate held every save op
    assert (missing, wrong) == ([], [])
    assert sorted(pool.keys()) == sorted(keys)
    # every commit began after the last copy into staging had finished
    assert len(copies) == eng.cache.num_layers and len(pool.put_times) == 3
    assert min(pool.put_times) >= max(copies)


def _reuse_scenario(qwen, *, pins: bool):
    """a (2 full blocks, max_new_tokens=1: done right after prefill, its save still sleeping), then
    at once b (another 2 blocks) in a 3-block cache: b can only get blocks by reusing a's.
    Returns (a's pooled-bytes mismatches, b's, allocations that handed out a pinned block,
    a's block ids, b's block ids, a visible before b ran, tokens)."""
    g = torch.Generator().manual_seed(43)
    a, b = u.rand_prompt(g, 8), u.rand_prompt(g, 8)
    ref, ref_tokens = u.reference_blocks(u.TINY_QWEN3, qwen.dir, [a, b])
    gate = threading.Event()   # a's save is held until a's visibility was looked at, then lags SAVE_DELAY
    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", num_blocks=3,
                          faults=Faults(save_delay_s=SAVE_DELAY, save_gate=gate)) as eng:
        alloc = eng.alloc
        orig_pin, orig_unpin, orig_alloc = alloc.pin, alloc.unpin, alloc.alloc
        pinned: Counter = Counter()   # our own account of what the engine pinned
        handed: list[tuple[list[int], list[int]]] = []

        def pin(ids):
            ids = list(ids)
            if pins:
                orig_pin(ids)
            pinned.update(ids)

        def unpin(ids):
            ids = list(ids)
            pinned.subtract(ids)      # before the real unpin: a block is never free yet counted
            if pins:
                orig_unpin(ids)

        def alloc_(n):
            ids = orig_alloc(n)
            handed.append((ids, [i for i in ids if pinned[i] > 0]))
            return ids

        alloc.pin, alloc.unpin, alloc.alloc = pin, unpin, alloc_
        try:
            ra = eng.generate([a], 1)[0]
            a_visible = [k for k in u.keys_of(eng, a) if eng.pool.contains(k)]
        finally:
            gate.set()
        rb = eng.generate([b], 1)[0]
        eng.drain()
        bad_a = u.pooled_mismatches(eng.pool, u.keys_of(eng, a), ref)
        bad_b = u.pooled_mismatches(eng.pool, u.keys_of(eng, b), ref)
    pinned_handed = [bad for _, bad in handed if bad]
    return dict(bad_a=bad_a, bad_b=bad_b, pinned_handed=pinned_handed, a_blocks=handed[0][0],
                b_blocks=[i for ids, _ in handed[1:] for i in ids], a_visible=a_visible,
                tokens=[ra.tokens, rb.tokens], ref_tokens=ref_tokens)


def test_finished_request_blocks_not_reused_while_its_save_runs(qwen):
    s = _reuse_scenario(qwen, pins=True)
    assert s["a_visible"] == []                    # a finished without waiting for its save
    assert set(s["a_blocks"]) & set(s["b_blocks"])  # the tiny cache did force reuse of a's blocks...
    assert s["pinned_handed"] == []                # ...but never while they were pinned
    assert s["bad_a"] == ([], []) and s["bad_b"] == ([], [])
    assert s["tokens"] == s["ref_tokens"]


def test_reuse_check_detects_missing_pins(qwen):
    # Negative control for the test above: with pin/unpin turned into no-ops, b overwrites a's
    # blocks before the delayed save copies them, and the same byte check must notice.
    s = _reuse_scenario(qwen, pins=False)
    missing, wrong = s["bad_a"]
    assert missing == [] and wrong, "without pins a's pooled KV should be b's, not a's"
    assert s["tokens"] == s["ref_tokens"]          # tokens alone would not have shown it


# ------------------------------------------------------------------------------------ acceptance 4

def _pooled_kv_after_slow_forward(qwen, gran: str, mutate: bool):
    p = u.rand_prompt(torch.Generator().manual_seed(47), 9)   # 2 full blocks + 1 token
    ref, ref_tokens = u.reference_blocks(u.TINY_QWEN3, qwen.dir, [p])
    hooked = []

    def hook(variant, source):
        new = drop_save_waits(variant, source) if mutate else source
        if new != source:
            hooked.append(variant)
        return new

    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", granularity=gran, source_hook=hook,
                          faults=Faults(forward_delay_s=FORWARD_DELAY)) as eng:
        r = eng.generate([p], 1)[0]
        eng.drain()
        result = u.pooled_mismatches(eng.pool, u.keys_of(eng, p), ref)
    assert r.variant.startswith("mempool_prefill") and r.tokens == ref_tokens[0]
    assert bool(hooked) == mutate
    return result


@pytest.mark.parametrize("gran", ["forward", "layer"])
def test_save_event_is_what_keeps_pooled_kv_correct(qwen, gran):
    assert _pooled_kv_after_slow_forward(qwen, gran, mutate=False) == ([], []), "unmutated: must be exact"
    missing, wrong = _pooled_kv_after_slow_forward(qwen, gran, mutate=True)
    assert missing == [], "the mutation only removes the wait: the blocks are still committed"
    assert wrong, "without the wait the save must read KV the slowed forward has not written yet"
