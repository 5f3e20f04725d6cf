"""The device prefix cache (issue 17 item 5, ``pool.device_cache``): finished requests' full blocks
stay on the device, a later prompt shares them instead of loading them from the pool
(``device_hit_blocks``, apart from the pool's ``hit_blocks``), LRU eviction when blocks run out,
refcounts shared with forks, and write-back on eviction."""
from __future__ import annotations

import dataclasses

from graphgen.runtime import open_engine
from test_continuous_batching import BS, SPEC, ckpt, prompts  # noqa: F401  (fixture)

P = prompts(1, seed=51, lo=4 * BS + 1, hi=4 * BS + 2)[0]  # 4 full blocks (the last token computed)
A, B, C = prompts(3, seed=52, lo=2 * BS + 1, hi=2 * BS + 2)  # 2 full blocks each, 3 blocks in all


def _engine(ckpt, num_blocks=64, **pool):
    pool = dataclasses.replace(SPEC.pool, **{"write": "sync", "device_cache": True, **pool})
    return open_engine(dataclasses.replace(SPEC, pool=pool), ckpt, num_blocks=num_blocks)


def _keys(e, prompt, n):
    return e.loader.block_keys(prompt)[:n]


def test_a_device_hit_shares_the_blocks_and_skips_the_pool_load(ckpt):
    with open_engine(dataclasses.replace(SPEC, pool=dataclasses.replace(SPEC.pool, write="off")), ckpt) as e:
        cold = e.generate([P], 6)[0].tokens
    with _engine(ckpt) as e:
        first = e.generate([P], 6)[0]
        cached = len(e.scheduler.device_cache)
        again = e.generate([P], 6)[0]
        s = e.core.stats()
    assert first.hit_tokens == 0 and again.hit_tokens == 4 * BS and first.tokens == again.tokens == cold
    # P's prompt + 5 fed-back tokens: (17 + 5) // 4 = 5 landed full blocks kept after the first run
    assert cached == (len(P) + 5) // BS
    assert s["device_hit_blocks"] == 4 and s["hit_blocks"] == 0 and s["loaded_blocks"] == 0  # no pool load


def test_refcounts_are_shared_with_the_requests_and_forks_using_a_cached_block(ckpt):
    from graphgen.runtime import SamplingParams

    with _engine(ckpt) as e:
        llm, alloc, dc = e.core, e.alloc, e.scheduler.device_cache
        e.generate([P], 2)
        first = [dc.block(k) for k in _keys(e, P, 4)]
        assert [alloc.refcount(b) for b in first] == [1] * 4            # the cache's own reference
        llm.add_request(0, P, SamplingParams(max_tokens=4, temperature=1.0, seed=1))
        llm.add_request(1, P, SamplingParams(max_tokens=4, temperature=1.0, seed=2), fork_of=0)
        while len(llm.scheduler.running) < 2:
            llm.step()
        assert [alloc.refcount(b) for b in first[:4]] == [3] * 4        # cache + parent + fork
        while llm.has_work():
            llm.step()
        assert [alloc.refcount(b) for b in first[:4]] == [1] * 4
        assert alloc.num_free + len(dc) == alloc.num_blocks            # nothing else held: no leak
        llm.shutdown()
        assert alloc.num_free == alloc.num_blocks                       # shutdown drops the cache


def test_eviction_takes_the_least_recently_used_blocks_nobody_holds(ckpt):
    with _engine(ckpt, num_blocks=7) as e:
        dc = e.scheduler.device_cache
        e.generate([A], 1)                       # A's 2 full blocks cached (the third is partial)
        e.generate([B], 1)
        assert dc.lru_keys() == _keys(e, A, 2) + _keys(e, B, 2)
        assert e.generate([A], 1)[0].hit_tokens == 2 * BS    # a device hit makes A the most recent
        assert dc.lru_keys() == _keys(e, B, 2) + _keys(e, A, 2)
        e.generate([C], 1)                       # 3 blocks with 3 free: no eviction yet
        assert set(_keys(e, B, 2)) <= set(dc.lru_keys())
        e.generate([P], 1)                       # 5 blocks: the LRU ones (B, then A) go first
        assert not set(_keys(e, B, 2)) & set(dc.lru_keys())
        assert e.core.stats()["device_hit_blocks"] == 2


def test_write_back_saves_a_cached_block_when_it_is_evicted_and_the_replay_restores_it(ckpt):
    with _engine(ckpt, num_blocks=7, policy="write_back") as e:
        e.generate([P], 2)
        assert e.stats["puts"] == 0              # finished, but its blocks are still on the device
        for q in (A, B, C, A, B, C):             # push P's blocks out of the device cache
            e.generate([q], 1)
        e.drain()
        assert not set(_keys(e, P, 4)) & set(e.scheduler.device_cache.lru_keys())
        assert e.stats["puts"] >= 4
        again = e.generate([P], 2)[0]
        s = e.core.stats()
    assert again.hit_tokens == 4 * BS and s["loaded_blocks"] == 4     # restored from the pool
