"""Acceptance 5: a full pool evicts, and a failing pool never changes tokens or shows partial data.

Eviction: a lookup only counts the leading run of keys that are fully present; a prompt whose first
block was evicted gets no hit even though its later blocks are still pooled. Put failures (all, or a
seeded half): requests still succeed with the write-off tokens, exactly the successfully committed
keys are visible (with exact bytes), and a later lookup hits exactly their leading run.
The expected hits are computed from the pool's own key list (pool.keys() does not touch recency)
or from the fault draw, which is a pure function of (seed, key, attempt)."""

from __future__ import annotations

import pytest
import torch

import e2e_util as u

from graphgen.runtime import open_engine
from graphgen.runtime.core.faults import Faults
from graphgen.runtime.pool import HostPool

N_NEW = 3


def _leading_run(keys, present) -> int:
    n = 0
    for k in keys:
        if k not in present:
            break
        n += 1
    return n


def _write_off_tokens(qwen, prompts):
    with open_engine(u.TINY_QWEN3, qwen.dir, write="off") as eng:
        return [r.tokens for r in eng.generate(prompts, N_NEW)]


def _block_bytes(qwen) -> int:
    with open_engine(u.TINY_QWEN3, qwen.dir, write="off", num_blocks=1) as eng:
        return eng.cache.block_bytes()


def test_eviction_first_block_gone_means_no_hit(qwen):
    g = torch.Generator().manual_seed(51)
    a = u.rand_prompt(g, 13)                  # 3 full blocks
    b = u.rand_prompt(g, 5)                   # 1 full block
    expected = _write_off_tokens(qwen, [a, b, a])
    ref, _ = u.reference_blocks(u.TINY_QWEN3, qwen.dir, [a, b])
    pool = HostPool(3 * _block_bytes(qwen))   # room for exactly a's 3 blocks
    with open_engine(u.TINY_QWEN3, qwen.dir, write="sync", pool=pool) as eng:
        ka, kb = u.keys_of(eng, a), u.keys_of(eng, b)
        out = [eng.generate([a], N_NEW)[0]]
        assert pool.keys() == ka
        out.append(eng.generate([b], N_NEW)[0])   # its block evicts the least recently used: a's first
        snapshot = pool.keys()
        out.append(eng.generate([a], N_NEW)[0])
        stats = pool.stats()
    assert snapshot == ka[1:] + kb, "LRU: a's first block is the one evicted"
    assert stats["evictions"] >= 1
    assert all(pool.get(k) in (None, ref[k]) for k in ka + kb)   # whatever is pooled is exact
    assert _leading_run(ka, set(snapshot)) == 0
    assert out[2].hit_tokens == 0 and out[2].variant == "mempool_prefill"   # though blocks 1, 2 were there
    assert [r.tokens for r in out] == expected


def test_eviction_gap_counts_only_the_leading_run(qwen):
    g = torch.Generator().manual_seed(53)
    a = u.rand_prompt(g, 13)                  # blocks a0 a1 a2
    c = a[:4] + u.rand_prompt(g, 9)           # shares a0, then its own c1 c2
    expected = _write_off_tokens(qwen, [a, c, a])
    pool = HostPool(4 * _block_bytes(qwen))
    with open_engine(u.TINY_QWEN3, qwen.dir, write="sync", pool=pool) as eng:
        ka, kc = u.keys_of(eng, a), u.keys_of(eng, c)
        out = [eng.generate([a], N_NEW)[0]]
        out.append(eng.generate([c], N_NEW)[0])   # hits a0 (refreshing it), saves c1 c2: evicts a1
        snapshot = set(pool.keys())
        out.append(eng.generate([a], N_NEW)[0])
    assert out[1].hit_tokens == 4
    assert ka[0] in snapshot and ka[1] not in snapshot and ka[2] in snapshot, "scenario: a gap at a1"
    run = _leading_run(ka[:(len(a) - 1) // 4], snapshot)
    assert run == 1
    assert out[2].hit_tokens == run * 4 and out[2].variant == "splitfuse"
    assert [r.tokens for r in out] == expected


def _seed_with_partial_pattern(keys) -> int:
    """A seed whose put_fail=0.5 draw (first attempt of each key) commits the first block, loses a
    middle one and commits a later one: the case where a partial commit could be misread as a hit."""
    for seed in range(200):
        f = Faults(put_fail=0.5, seed=seed)
        ok = [not f.put_fails(k, 0) for k in keys]
        if ok[0] and not all(ok[:-1]) and any(ok[ok.index(False):]):
            return seed
    raise AssertionError("no seed in range(200) gives a partial pattern")


@pytest.mark.parametrize("put_fail", [1.0, 0.5])
def test_put_failures_keep_tokens_and_hide_failed_blocks(qwen, put_fail):
    g = torch.Generator().manual_seed(57)
    p = u.rand_prompt(g, 17)                  # 4 full blocks, lookups use at most 4
    expected = _write_off_tokens(qwen, [p, p])
    ref, _ = u.reference_blocks(u.TINY_QWEN3, qwen.dir, [p])
    inner = HostPool(1 << 24)
    with open_engine(u.TINY_QWEN3, qwen.dir, write="off", num_blocks=1) as probe:
        keys = u.keys_of(probe, p)
    seed = _seed_with_partial_pattern(keys) if put_fail < 1 else 0
    faults = Faults(put_fail=put_fail, seed=seed)
    committed = [k for k in keys if not faults.put_fails(k, 0)]   # the fault draw is a pure function
    with open_engine(u.TINY_QWEN3, qwen.dir, write="async", pool=inner, faults=faults) as eng:
        r1 = eng.generate([p], N_NEW)[0]
        eng.drain()
        visible = inner.keys()
        r2 = eng.generate([p], N_NEW)[0]
        eng.drain()
        failures = eng.stats["put_failures"]
    assert [r1.tokens, r2.tokens] == expected
    assert sorted(visible) == sorted(committed)           # nothing of a failed put is visible
    assert all(inner.get(k) == ref[k] for k in committed)  # and what is visible is exact
    run = _leading_run(keys[:(len(p) - 1) // 4], set(committed))
    assert r2.hit_tokens == run * 4
    if put_fail == 1.0:
        assert committed == [] and r2.hit_tokens == 0 and failures >= len(keys)
    else:
        assert 0 < run < len(committed)   # a committed block after the gap did not count
