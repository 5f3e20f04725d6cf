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
    (["--kv-lease-timeout", "0"], "--kv-lease-timeout must be > 0"),
])
def test_bad_role_flags_exit_2_before_the_model_loads(ckpt, args, msg):
    res = _cli("serve", "--spec", str(SPEC), "--weights", str(ckpt), *args)
    assert res.returncode == 2 and msg in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def test_role_refusals_live_in_the_one_table_and_dp_groups_are_not_refused():
    """--role prefill|decode runs at every layout the ranks run (dp x tp included: issue 37 item 3); what a
    role still refuses (with --speculative mtp) is a row of families.parallel's one refusal table, which
    `graphgen serve` reads through layout_refusal (negative control: the same launch as role both)."""
    from argparse import Namespace

    from graphgen.engine_args import layout_refusal
    from graphgen.families.parallel import runtime_layout_gap
    from graphgen.modelspec.loader import load_spec
    from support.paths import TINY_DSV3, TINY_DSV3_MTP

    def refusal(spec, role, **flags):
        over = dict(dict.fromkeys(("tp", "ep", "dp", "cp", "sp")), target="cpu", speculative=None, role=role)
        return layout_refusal(load_spec(spec), Namespace(**{**over, **flags}))

    for role in ("prefill", "decode", "both"):
        assert refusal(TINY_DSV3, role, dp=2, tp=2, ep=4) is None
        assert refusal(TINY_DSV3, role, dp=2, ep=2) is None
    assert refusal(TINY_DSV3_MTP, "decode", speculative="mtp") is None  # MTP through P/D at one rank each
    sentence = refusal(TINY_DSV3_MTP, "decode", speculative="mtp", tp=2, ep=2)
    assert sentence and "--role prefill|decode" in sentence and "--speculative mtp" in sentence, sentence
    assert refusal(TINY_DSV3_MTP, "both", speculative="mtp", tp=2, ep=2) is None
    par = load_spec(TINY_DSV3_MTP).with_overrides(tp=2, ep=2).parallel
    assert runtime_layout_gap(par, speculative=True, role="prefill") == sentence
    assert runtime_layout_gap(par, speculative=True) is None


def test_ranks_naming_of_dp_groups_is_the_tp_ranks_and_one_rank_each_is_one_ranks():
    """`DistributedEngine.kv_naming` over what its ranks' probes answer (model, layout, shard, block size): the
    ranks of dp 2 x tp 2 DeepSeek (MLA: every rank the latent r0of2) name the blocks as tp 2 does (one shard,
    r0of2); dp 2 x tp 1 (every rank r0of1) as one rank (no shards: the vLLM shape), so a dp x tp P and a tp D
    hand off to each other; Qwen3 at tp 2 (two shards) is not a one-rank naming (negative control)."""
    from types import SimpleNamespace

    from graphgen.runtime.parallel.launcher import DistributedEngine
    from graphgen.runtime.pool.keys import block_keys

    def naming(*shards):
        probe = [("m", "L", i, n, 4, False) for i, n in shards]  # (not speculative)
        eng = SimpleNamespace(_pool=None, on_ranks=lambda fn: probe)
        eng.block_naming = lambda: DistributedEngine.block_naming(eng)  # kv_naming's body (any pool)
        return DistributedEngine.kv_naming(eng)

    prompt = list(range(1, 14))
    one = CacheNaming(4, "L", lambda p, salt="": chain_digests(p, 4, salt),
                      lambda p, salt="": block_keys(p, 4, model="m", layout="L", salt=salt))  # Engine's own
    dp_tp, tp = naming((0, 2), (0, 2), (0, 2), (0, 2)), naming((0, 2), (0, 2))
    assert dp_tp.shards == tp.shards == ("r0of2",) and dp_tp.handoff_keys(prompt) == tp.handoff_keys(prompt)
    dp1 = naming((0, 1), (0, 1))
    assert dp1.shards == () and dp1.handoff_keys(prompt) == one.handoff_keys(prompt)
    qwen = naming((0, 2), (1, 2))
    assert qwen.shards == ("r0of2", "r1of2") and len(qwen.handoff_keys(prompt)) == 2
    assert qwen.handoff_keys(prompt)[0] != one.handoff_keys(prompt)[0]


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


def test_a_decode_that_fails_before_answering_sends_the_request_to_the_next_one():
    """The router's D side (route.app._to_decode, aiohttp) against loopback sockets: a D whose engine ended
    answers 503 (not streamed) or an error as its stream's first event; another D answers. While one is up the
    request goes to it (counted, nothing of the failed D's reaches the client) and P's lease is released once;
    with no other D the failed answer is relayed as it is (negative control), and a stream already under way is
    never switched (its first event was a token)."""
    import aiohttp
    from graphgen.route.app import RouterState, _Metrics, _to_decode

    err = b'data: {"error": {"message": "rank 3 exited", "code": "error"}}\n\ndata: [DONE]\n\n'
    answers = {"dead_json": (b"503 Service Unavailable", b"application/json", b'{"error": {"message": "gone"}}'),
               "dead_sse": (b"200 OK", b"text/event-stream", err),
               "ok_json": (b"200 OK", b"application/json", b'{"ok": 1}'),
               "ok_sse": (b"200 OK", b"text/event-stream", b'data: {"tok": 1}\n\ndata: [DONE]\n\n')}

    def backend(kind):
        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            status, ctype, body = answers[kind]
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
            writer.close()
        return serve

    async def send(st, stream):
        released = []
        out = await _to_decode(st, "/v1/completions", {"prompt": [1]}, {"prompt": [1]},
                               lambda: released.append(1), 0.0)
        body = b"".join([c async for c in out.body_iterator]) if stream else out.body
        return out.status_code, body, len(released)

    async def main():
        servers = {k: await asyncio.start_server(backend(k), "127.0.0.1", 0) for k in answers}
        url = {k: f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for k, s in servers.items()}
        got = {}
        async with aiohttp.ClientSession() as http:
            for name, urls, stream in (("json", ["dead_json", "ok_json"], False), ("sse", ["dead_sse", "ok_sse"], True),
                                       ("json_alone", ["dead_json"], False), ("sse_alone", ["dead_sse"], True),
                                       ("sse_ok_first", ["ok_sse", "dead_sse"], True)):
                decode = Pool([url[u] for u in urls], "round_robin")
                st = RouterState(Pool([]), decode, _Metrics(Pool([]), decode), [], {})
                st.http = http
                got[name] = (*await send(st, stream),
                             st.metrics.backend_errors.labels(kind="decode_failed")._value.get())
        for s in servers.values():
            s.close()
        return got

    got = asyncio.run(main())
    assert got["json"] == (200, b'{"ok": 1}', 1, 1), got["json"]
    assert got["sse"] == (200, answers["ok_sse"][2], 1, 1), got["sse"]
    assert got["json_alone"][:3] == (503, answers["dead_json"][2], 1) and got["json_alone"][3] == 0
    assert got["sse_alone"] == (200, err, 1, 0), got["sse_alone"]
    assert got["sse_ok_first"] == (200, answers["ok_sse"][2], 1, 0), got["sse_ok_first"]
