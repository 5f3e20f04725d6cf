"""The P/D parts that need no cluster: the router's policies, the handoff's wire format and the
decode side's check of it, and the flags refused before anything loads (the cluster itself:
test_pd.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from graphgen.route.app import one_handoff, prefill_body
from graphgen.balance import Pool, prefix_key
from graphgen.runtime import HostPool, chain_digests
from graphgen.serve.errors import ApiError
from graphgen.serve.pd import PD, CacheNaming, Handoff
from serve_util import ROOT, SPEC


def test_round_robin_and_least_loaded_skip_backends_that_are_down():
    pool = Pool(["http://a", "http://b", "http://c"], "round_robin")
    assert [pool.pick().url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    pool.backends[1].healthy = False
    assert {pool.pick().url for _ in range(4)} == {"http://a", "http://c"}
    ll = Pool(["http://a", "http://b"], "least_loaded")
    ll.backends[0].begin()
    assert {ll.pick().url for _ in range(3)} == {"http://b"}
    for b in ll.backends:
        b.healthy = False
    assert ll.pick() is None
    assert Pool([], "round_robin").pick() is None  # no --prefill: the router goes straight to D


def test_prefix_policy_keeps_a_prefix_on_one_backend_and_moves_only_the_dead_ones_share():
    pool = Pool([f"http://p{i}" for i in range(4)], "prefix")
    keys = [prefix_key({"prompt": [i, 1, 2]}) for i in range(40)]
    first = {k: pool.pick(k).url for k in keys}
    assert all(pool.pick(k).url == first[k] for k in keys) and len(set(first.values())) > 1
    pool.backends[0].healthy = False
    moved = {k for k in keys if pool.pick(k).url != first[k]}
    assert moved == {k for k in keys if first[k] == "http://p0"}


def _pd(role="decode", bs=4):
    naming = CacheNaming(bs, "L1", lambda p, salt="": chain_digests(p, bs, salt),
                         lambda p, salt="": [f"k{d}" for d in chain_digests(p, bs, salt)])
    return PD(role, HostPool(1 << 20), naming, CollectorRegistry(), lease_timeout_s=5)


def test_handoff_wire_format_and_its_400s():
    h = Handoff(("aa", "bb"), 2, "L1", "id", 5)
    assert Handoff.parse(h.body()) == h and Handoff.parse(None) is None
    for bad, param in (([], "kv_transfer_params"), ({"num_blocks": 1}, "kv_transfer_params.block_hashes"),
                       ({**h.body(), "num_blocks": 3}, "kv_transfer_params.num_blocks"),
                       ({**h.body(), "lease_expires_ms": -1}, "kv_transfer_params.lease_expires_ms"),
                       ({**h.body(), "lookahead": "yes"}, "kv_transfer_params.lookahead")):
        with pytest.raises(ApiError) as e:
            Handoff.parse(bad)
        assert e.value.status == 400 and e.value.param == param
    assert "lookahead" not in h.body()  # vLLM's shape unless P decodes speculatively
    spec = Handoff(("aa",), 1, "L1", "id", 5, lookahead=True)
    assert spec.body()["lookahead"] is True and Handoff.parse(spec.body()) == spec


def test_decode_admits_a_handoff_only_keyed_as_it_keys_its_blocks(caplog):
    """A P decoding speculatively (successor-keyed blocks) and a D that does not, or the other way round: a
    counted mismatch (recomputed), said once in the log naming the flag."""
    plain, spec = _pd(), _pd()
    spec.naming = dataclasses.replace(spec.naming, lookahead=True)
    prompt = list(range(1, 14))
    own = tuple(chain_digests(prompt, 4)[:3])
    with caplog.at_level("WARNING", logger="graphgen.serve.pd"):
        assert not plain.accept(prompt, Handoff(own, 3, "L1", "x", 0, lookahead=True))
        assert not plain.accept(prompt, Handoff(own, 3, "L1", "x", 0, lookahead=True))
        assert not spec.accept(prompt, Handoff(own, 3, "L1", "x", 0))
    assert spec.accept(prompt, Handoff(own, 3, "L1", "x", 0, lookahead=True))
    assert plain.handoffs.labels(result="mismatch")._value.get() == 2
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "--speculative mtp" in warned[0] and "with --speculative" in warned[0], warned


def test_decode_accepts_only_its_own_hashing_and_layout():
    pd = _pd()
    prompt = list(range(1, 14))  # 13 tokens: 3 blocks handed off (the last token is recomputed)
    own = chain_digests(prompt, 4)[:3]
    assert pd.naming.handed_off(prompt) == 3
    assert pd.accept(prompt, Handoff(tuple(own), 3, "L1", "x", 0))
    assert pd.accept(prompt, Handoff(tuple(own[:2]), 2, "L1", "x", 0))  # a shorter run is fine
    assert not pd.accept(prompt, Handoff(tuple(own), 3, "L2", "x", 0))  # another layout
    assert not pd.accept([99, *prompt[1:]], Handoff(tuple(own), 3, "L1", "x", 0))  # another prompt
    four = chain_digests(list(range(1, 17)), 4)
    assert not pd.accept(list(range(1, 17)), Handoff(tuple(four), 4, "L1", "x", 0))  # the last block too
    assert pd.handoffs.labels(result="mismatch")._value.get() == 3


def test_prefill_leases_the_handed_off_blocks_and_waits_for_them():
    pd = _pd("prefill")
    pd.visible_timeout_s = 0.3
    prompt = list(range(1, 14))
    keys, lease = pd.lease(prompt)
    assert len(keys) == 1 and len(keys[0]) == 3 and pd.pool.leases() == 1  # one shard (one rank)
    for k in keys[0][:2]:
        pd.pool.put(k, b"v")
    assert asyncio.run(pd.wait_visible(keys)) == 2  # no commit pending: the visible run, not a hang
    pd.pool.put(keys[0][2], b"v")
    assert asyncio.run(pd.wait_visible(keys)) == 3
    assert pd.release(lease.lease_id) and pd.pool.leases() == 0


def _pd_ranks(role="prefill", bs=4, shards=("r0of2", "r1of2")):
    """A P/D over the keys of two KV shards (a tp-2 instance whose ranks hold different KV heads)."""
    fns = tuple((lambda s: lambda p, salt="": [f"{s}:{d}" for d in chain_digests(p, bs, salt)])(s) for s in shards)
    naming = CacheNaming(bs, "L1", lambda p, salt="": chain_digests(p, bs, salt), fns[0], shard_keys=fns,
                         shards=shards)
    return PD(role, HostPool(1 << 20), naming, CollectorRegistry(), lease_timeout_s=5)


def test_ranks_handoff_leases_every_shard_and_waits_until_every_shard_is_visible():
    """Issue 37 item 3: P's ranks each save their shard; a block is handed off once every shard's part of it
    is visible, one lease pins them all, the wire format names the shards and D checks them."""
    pd = _pd_ranks()
    pd.visible_timeout_s = 0.3
    prompt = list(range(1, 14))
    keys, lease = pd.lease(prompt)
    assert [len(k) for k in keys] == [3, 3] and keys[0][0].startswith("r0of2") and keys[1][0].startswith("r1of2")
    assert pd.pool.leases() == 1
    for k in keys[0]:
        pd.pool.put(k, b"v")       # rank 0's shard of all 3 blocks, rank 1's of the first only
    pd.pool.put(keys[1][0], b"v")
    assert asyncio.run(pd.wait_visible(keys)) == 1   # negative control: one shard alone is not a handoff
    for k in keys[1][1:]:
        pd.pool.put(k, b"v")
    body = {"choices": [{"index": 0, "text": "x", "token_ids": [5], "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 13, "completion_tokens": 1, "total_tokens": 14}}
    out = asyncio.run(pd.finish_prefill(prompt, keys, lease, body))
    h = Handoff.parse(out["kv_transfer_params"])
    assert h.num_blocks == 3 and h.shards == ("r0of2", "r1of2")
    assert _pd_ranks("decode").accept(prompt, h)
    assert not _pd_ranks("decode", shards=("r0of1",)).accept(prompt, h)   # another tp: its keys differ
    assert not _pd("decode").accept(prompt, h)                            # one rank vs a tp-2 handoff
    assert pd.release(lease.lease_id) and pd.pool.leases() == 0
    with pytest.raises(ApiError, match="shards"):
        Handoff.parse({**h.body(), "shards": "r0of2"})


def test_prefill_answer_of_n_choices_is_one_handoff_and_n_empty_choices():
    pd = _pd("prefill")
    prompt = list(range(1, 14))
    keys, lease = pd.lease(prompt)
    for k in keys[0]:
        pd.pool.put(k, b"v")
    body = {"choices": [{"index": 0, "text": "x", "token_ids": [5], "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 13, "completion_tokens": 1, "total_tokens": 14}}
    out = asyncio.run(pd.finish_prefill(prompt, keys, lease, body, n=3))
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == [] and c["text"] == "" for c in out["choices"])
    assert out["usage"]["completion_tokens"] == 0 and out["kv_transfer_params"]["num_blocks"] == 3
    assert out["kv_transfer_params"]["block_hashes"] == chain_digests(prompt, 4)[:3]


def _cli(*args):
    from support.inproc import cli_inproc

    return cli_inproc(*args, timeout=120)


@pytest.mark.parametrize("args,msg", [
    (["--role", "prefill"], "--role prefill hands the KV over through a shared pool"),
    (["--role", "decode", "--pool", "mooncake://127.0.0.1:1", "--write", "off"], "write off"),
    (["--role", "prefill", "--pool", "mooncake://127.0.0.1:1", "--dp", "2"], "DP groups do not yet"),
    (["--kv-lease-timeout", "0"], "--kv-lease-timeout must be > 0"),
])
def test_bad_role_flags_exit_2_before_the_model_loads(ckpt, args, msg):
    res = _cli("serve", "--spec", str(SPEC), "--weights", str(ckpt), *args)
    assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def test_bad_route_flags_exit_2():
    res = _cli("route", "--prefill", "localhost:1", "--decode", "http://127.0.0.1:2")
    assert res.returncode == 2 and "--prefill localhost:1: expected http://HOST:PORT" in res.stderr, res.stderr


def test_router_prefill_body_and_which_requests_one_handoff_covers():
    body = {"prompt": [1, 2], "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 5, "kv_transfer_params": {"x": 1}, "max_completion_tokens": 9, "top_k": 3}
    assert prefill_body(body) == {"prompt": [1, 2], "max_tokens": 1, "stream": False, "max_completion_tokens": 1,
                                  "top_k": 3}
    assert one_handoff({"prompt": "text"}) and one_handoff({"messages": []}) and one_handoff({"prompt": [1, 2]})
    assert not one_handoff({"prompt": [[1, 2], [3]]}) and not one_handoff({"prompt": ["a", "b"]})
    assert one_handoff({"prompt": [1], "n": 2}) and one_handoff({"prompt": [1], "best_of": 3})  # D forks


def test_health_check_a_refusal_is_down_at_once_a_slow_backend_after_three_timeouts():
    """The router's own check (route.app._check, aiohttp) against real loopback sockets: one that
    accepts and never answers (a backend whose event loop is busy on a loaded host), one that refuses
    (a dead backend), one that answers 200. Before this, one check slower than 2 s took a live P out
    of rotation and its next handoffs fell back to a recompute."""
    import aiohttp
    from graphgen.balance import SLOW_CHECKS_DOWN
    from graphgen.route.app import RouterState, _check

    async def main():
        silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)

        async def ok(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
            await writer.drain()
            writer.close()

        good = await asyncio.start_server(ok, "127.0.0.1", 0)
        closed = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        refused_port = closed.sockets[0].getsockname()[1]
        closed.close()
        await closed.wait_closed()
        url = lambda srv: f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"  # noqa: E731
        pool = Pool([url(silent), f"http://127.0.0.1:{refused_port}", url(good)])
        slow, dead, up = pool.backends
        st = RouterState(pool, Pool([]), None, [], {}, health_timeout_s=0.2)
        async with aiohttp.ClientSession() as st.http:
            seen = []
            for _ in range(SLOW_CHECKS_DOWN):
                await asyncio.gather(*(_check(st, b) for b in pool.backends))
                seen.append((slow.healthy, dead.healthy, up.healthy))
            assert seen == [(True, False, True)] * (SLOW_CHECKS_DOWN - 1) + [(False, False, True)], seen
            assert slow.slow_checks == SLOW_CHECKS_DOWN and up.slow_checks == 0
            slow.url = up.url  # the busy backend answers again: up, its count reset
            await _check(st, slow)
            assert slow.healthy and slow.slow_checks == 0
        silent.close()
        good.close()

    asyncio.run(main())
