"""Prefill/decode disaggregation (2P1D) over a real Mooncake pool: one cluster for the module.

A private network namespace (tests/support/netns.py) holds a Mooncake master with its segment,
two ``graphgen serve --role prefill`` instances (P2 with slow pool puts: ``put_delay``, so its
saves are caught in flight), one ``--role decode`` instance and ``graphgen route`` over them; the
official ``openai`` client and urllib run inside it (``pd_client.py``). The reference tokens come
from a cold ``Engine`` (write off, no pool) in this process — the engine a single ``both``
instance serves (``test_serve_run_parity.py`` holds the server to it).

Proved here: through the router, greedy tokens equal the reference (several prompt lengths,
streamed and not) and D loads every handed-off block (``cached_tokens``); P answers only once the
blocks are visible; a lease is held until the router releases it, or until it expires; a handoff
naming other blocks is not admitted (counted); a value corrupted in the pool is caught by its
checksum and recomputed (counted); a P SIGKILLed mid-save costs a recompute, not the request; no
decode instance up is a 503 at once; DeepSeek-V3 through the router equals its cold engine; the
store's master SIGKILLed costs a recompute; D SIGKILLed mid-stream ends the stream with an error
event (no hang), and D restarted on its port serves through the router again; ``n = 2`` through
the router is one prefill on P and a fork on D; the router's own key and the backends' key stay
apart (401s from the router, a 502 for a wrong backend key, no answer carrying it); P/D instances of
ranks (tp 2; dp 2 x tp 2 DeepSeek, with tp-2 instances beside them) through the router equal one rank, a
killed P rank costs a recompute and a killed D rank sends its request to another D; a speculative
(MTP) pair hands the MTP layer's KV off with the target's, the acceptance unchanged. After each:
every instance's counters back at their start (no lease, nothing running or saving, every device
block free) and no request in flight on a router.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serve_util import SPEC
from support.netns import Namespace, Worker, _env, _Proc
from support.paths import REPO as ROOT, TINY_DSV3

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PORT = 50170
POOL = f"mooncake://127.0.0.1:{PORT}"
BS = 4
N_NEW = 5
LEASE_S = 3.0
CLIENT_KEY, BACKEND_KEY = "client-key-5e1f", "backend-key-9c2d"  # the router's, the instances'
PROMPTS = {n: [(7 * n + 3 * i) % 150 + 1 for i in range(n)] for n in (3, 9, 16, 29)}
LONG = [(11 * i) % 140 + 5 for i in range(41)]  # 10 blocks handed off: ~3 s of P2's slow puts
CORRUPT = [9, *PROMPTS[16][1:]]  # a prompt no other test sends: its blocks are P1's alone


def _start(ns, name, *args) -> _Proc:
    p = _Proc(ns.argv(sys.executable, "-m", "graphgen", *args), log=ns._log(name))
    ns.procs.append(p)
    return p


def _url(p: _Proc, what: str) -> str:
    return p.wait_line(f"graphgen {what}: listening on", 180).rsplit(" ", 1)[-1]


def _serve_args(ckpt, role, *extra, spec=SPEC):
    return ("serve", "--spec", str(spec), "--weights", str(ckpt), "--port", "0", "--pool", POOL,
            "--torch-threads", "1", "--role", role, *extra)


# what a request holds while it runs and must give back: the pool's leases (booked in the P that
# pinned them), the engine's running / waiting requests, saves in flight and device blocks
HELD = ("graphgen_pd_leases", "graphgen_num_requests_running", "graphgen_num_requests_waiting",
        "graphgen_kv_saves_pending", "graphgen_kv_blocks_free")
INFLIGHT = "graphgen_route_backend_inflight"


class Cluster:
    def __init__(self, ns, ckpt):
        self.ns = ns
        _, self.master_pid = ns.serve(PORT)
        procs = {"p1": _start(ns, "p1", *_serve_args(ckpt, "prefill", "--kv-lease-timeout", str(LEASE_S))),
                 "p2": _start(ns, "p2", *_serve_args(ckpt, "prefill", "--faults", "put_delay=0.3")),
                 "d": _start(ns, "d", *_serve_args(ckpt, "decode"))}
        self.procs = procs
        # the test's client for quick jobs: one process in the namespace, kept (no interpreter start per job)
        self.client = Worker(ns.argv(sys.executable, str(HERE / "pd_client.py"), "--loop"), stdin=True,
                             log=ns._log("client"))
        ns.procs.append(self.client)
        self.url = {k: _url(p, "serve") for k, p in procs.items()}
        self.routers: list[str] = []
        self.router = self.route("router", "--prefill", self.url["p1"], "--prefill", self.url["p2"])
        self.start = self.counters(self.url)  # every fault test ends with these back

    def route(self, name, *args, decode=None) -> str:
        p = _start(self.ns, name, "route", *args, "--decode", decode or self.url["d"], "--port", "0",
                   "--health-interval", "0.5")
        self.routers.append(_url(p, "route"))
        return self.routers[-1]

    def jobs(self, *jobs, timeout=180) -> list[dict]:
        self.client.p.stdin.write(json.dumps(list(jobs)) + "\n")
        self.client.p.stdin.flush()
        return json.loads(self.client.wait_line("@@", timeout)[2:])

    def metrics(self, name, *prefixes) -> dict:
        return self.jobs({"op": "metrics", "base": self.url.get(name, name), "prefixes": list(prefixes)})[0]

    def counters(self, bases: dict) -> dict:
        """name -> its HELD samples (or the router's in-flight ones), one client process for all."""
        got = self.jobs(*({"op": "metrics", "base": b, "prefixes": [INFLIGHT] if n in self.routers else list(HELD)}
                          for n, b in bases.items()))
        return {n: {k: v for k, v in g.items() if k in HELD or k.startswith(INFLIGHT)} for n, g in zip(bases, got)}

    def held(self, start=None, bases=None) -> dict:
        """What is not back at its start: per live instance its HELD counters that differ from
        ``start`` (default: the cluster's at start-up), per router any request still in flight."""
        start = start or self.start
        bases = bases or {n: u for n, u in self.url.items() if self.procs[n].p.poll() is None}
        now = self.counters({**bases, **{r: r for r in self.routers}})
        out = {n: {k: (start[n].get(k), v) for k, v in c.items() if v != start[n].get(k)}
               for n, c in now.items() if n not in self.routers}
        out.update({r: {k: v for k, v in c.items() if v} for r, c in now.items() if r in self.routers})
        return {n: d for n, d in out.items() if d}

    def assert_nothing_held(self, start=None, bases=None):
        """No block leaked, no lease left: every instance's counters back at their start (no lease
        live on a P, nothing running, waiting or saving, every device block free), no router request
        in flight. Polled: a release or a free may land just after the answer."""
        deadline = time.monotonic() + 10
        while held := self.held(start, bases):
            assert time.monotonic() < deadline, held
            time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(ckpt):
    import torch

    from graphgen.runtime import open_engine

    torch.set_num_threads(1)
    with open_engine(SPEC, ckpt, write="off") as eng:
        return {tuple(p): eng.generate([p], N_NEW)[0].tokens for p in [*PROMPTS.values(), LONG, CORRUPT, [77, *PROMPTS[16][1:]]]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ckpt):
    try:
        ns = Namespace()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)  # never a silent skip, as the Mooncake tests
    ns.logdir = str(tmp_path_factory.mktemp("pd"))
    try:
        yield Cluster(ns, ckpt)
    finally:
        ns.close()


def _complete(base, prompt, stream=False, model="tiny_qwen3", **extra):
    return {"op": "complete", "base": base, "prompt": prompt, "max_tokens": N_NEW, "stream": stream, "extra": extra,
            "model": model}


def test_router_tokens_equal_a_single_instance(cluster, reference):
    jobs = [_complete(cluster.router, p, stream) for stream in (False, True) for p in PROMPTS.values()]
    out = cluster.jobs(*jobs)
    for job, got in zip(jobs, out):
        p = job["prompt"]
        assert got["tokens"] == reference[tuple(p)], (len(p), job["stream"], got)
        if not job["stream"]:  # the first pass: D loaded every handed-off block (P's, through the pool)
            assert got["cached"] == (len(p) - 1) // BS * BS, (len(p), got)
    d = cluster.metrics("d", "graphgen_pd_handoff")
    assert d['graphgen_pd_handoffs_total{result="accepted"}'] == len(jobs)
    assert d['graphgen_pd_handoff_blocks_total{result="recomputed"}'] == 0
    msgs = [{"role": "user", "content": "Tell me about the pool, in a few words please."}]
    chats = [{"op": "chat", "base": base, "messages": msgs, "max_tokens": N_NEW, "stream": stream}
             for base in (cluster.router, cluster.url["d"]) for stream in (False, True)]
    fan = {"op": "post", "url": cluster.router + "/v1/completions",  # n = 2: P prefills once, D forks
           "json": {"prompt": PROMPTS[9], "max_tokens": N_NEW, "temperature": 0, "n": 2}}
    *out, fanned = cluster.jobs(*chats, fan)
    via_router, direct = out[:2], out[2:]  # D without a handoff serves as `both`
    assert via_router == direct and direct[0] == direct[1] and len(direct[0]["tokens"]) == N_NEW
    assert fanned["status"] == 200
    fanned = json.loads(fanned["body"])
    assert [c["token_ids"] for c in fanned["choices"]] == [reference[tuple(PROMPTS[9])]] * 2
    assert fanned["usage"]["prompt_tokens_details"]["cached_tokens"] == 8  # P's 2 blocks, loaded once
    d = cluster.metrics("d", "graphgen_pd_handoff", "graphgen_forked")
    assert d['graphgen_pd_handoffs_total{result="accepted"}'] == len(jobs) + 3  # + 2 chats + the fan
    assert d["graphgen_forked_requests_total"] == 1 and d['graphgen_pd_handoff_blocks_total{result="recomputed"}'] == 0
    r = cluster.metrics(cluster.router, "graphgen_route_")
    assert r["graphgen_route_prefill_fallbacks_total"] == 0
    cluster.assert_nothing_held()  # the router released every lease, well before P2's 30 s timeout
    # the router counts a release once P's answer to it is read, which may land after P's own gauge
    # fell (what assert_nothing_held saw): polled, and never past the count
    deadline, key = time.monotonic() + 10, 'graphgen_route_lease_releases_total{result="ok"}'
    while (ok := cluster.metrics(cluster.router, "graphgen_route_lease")[key]) != len(jobs) + 3:
        assert ok < len(jobs) + 3 and time.monotonic() < deadline, ok
        time.sleep(0.05)


def test_prefill_handoff_lease_mismatch_and_expiry(cluster, reference):
    p = PROMPTS[16]
    (pre,) = cluster.jobs(_complete(cluster.url["p1"], p))  # a plain request to P: one dropped token
    kv = pre["kv"]
    assert pre["tokens"] == [] and kv["num_blocks"] == 3 and len(kv["block_hashes"]) == 3
    assert kv["lease_expires_ms"] > time.time() * 1000
    assert cluster.metrics("p1", "graphgen_pd_leases")["graphgen_pd_leases"] == 1
    assert cluster.held()["p1"]["graphgen_pd_leases"] == (0, 1)  # negative control: the leak check sees it
    before = cluster.metrics("d", "graphgen_pd_handoff")
    mismatch, ok = cluster.jobs(_complete(cluster.url["d"], PROMPTS[29], kv_transfer_params=kv),  # another prompt
                                _complete(cluster.url["d"], p, kv_transfer_params=kv))
    assert mismatch["tokens"] == reference[tuple(PROMPTS[29])]
    assert ok["tokens"] == reference[tuple(p)] and ok["cached"] == 3 * BS
    after = cluster.metrics("d", "graphgen_pd_handoff")
    assert after['graphgen_pd_handoffs_total{result="mismatch"}'] == before.get(
        'graphgen_pd_handoffs_total{result="mismatch"}', 0) + 1
    (bad,) = cluster.jobs(_complete(cluster.url["d"], p, kv_transfer_params={"num_blocks": 1}))
    assert bad["status"] == 400 and bad["error"]["param"] == "kv_transfer_params.block_hashes"
    # nobody released it: the lease ends at its timeout, not before. Its clock is the pool's, in P1's
    # process: polled (every 50 ms) until it lapses, and the moment checked against the expiry P gave
    deadline = time.monotonic() + LEASE_S + 30
    while cluster.metrics("p1", "graphgen_pd_leases")["graphgen_pd_leases"] != 0:
        assert time.monotonic() < deadline, "the lease outlived its timeout"
        time.sleep(0.05)
    assert time.time() * 1000 >= kv["lease_expires_ms"] - 50, "the lease ended before its timeout"
    (rel,) = cluster.jobs({"op": "post", "url": cluster.url["p1"] + "/v1/kv/release",
                           "json": {"lease_id": kv["lease_id"]}})
    assert rel["status"] == 200 and json.loads(rel["body"])["released"] is False
    cluster.assert_nothing_held()


def test_corrupt_value_is_recomputed(cluster, reference):
    from graphgen.runtime.pool.keys import BlockKey, KVShard

    p = CORRUPT
    (pre,) = cluster.jobs(_complete(cluster.url["p1"], p))
    kv = pre["kv"]
    w = cluster.ns.worker(f"127.0.0.1:{PORT}", name="corrupter")
    key = BlockKey("tiny_qwen3", kv["layout"], KVShard(), kv["block_hashes"][0]).render()
    assert w.call(op="corrupt", key=key)["rc"] == 0
    before = cluster.metrics("d", "graphgen_pd_handoff_blocks")
    (got,) = cluster.jobs(_complete(cluster.url["d"], p, kv_transfer_params=kv))
    assert got["tokens"] == reference[tuple(p)]
    assert got["cached"] == 0  # block 0 failed its checksum: the leading run stops there
    after = cluster.metrics("d", "graphgen_pd_handoff_blocks")
    name = 'graphgen_pd_handoff_blocks_total{result="recomputed"}'
    assert after[name] == before.get(name, 0) + 3
    cluster.jobs({"op": "post", "url": cluster.url["p1"] + "/v1/kv/release", "json": {"lease_id": kv["lease_id"]}})
    cluster.assert_nothing_held()


def test_no_decode_up_is_a_clear_503(cluster):
    router = cluster.route("router_no_d", "--prefill", cluster.url["p1"], "--api-key", "k1",
                           decode="http://127.0.0.1:9")
    t0 = time.monotonic()
    health, anon, got = cluster.jobs({"op": "get", "url": router + "/health"},  # /health needs no key
                                     {"op": "post", "url": router + "/v1/completions", "json": {"prompt": [1]}},
                                     dict(_complete(router, PROMPTS[9]), key="k1"))
    assert health["status"] == 503
    assert anon["status"] == 401 and json.loads(anon["body"])["error"]["code"] == "invalid_api_key"
    assert got["status"] == 503 and "no decode instance is up" in got["error"]["message"]
    assert time.monotonic() - t0 < 30
    cluster.assert_nothing_held()


def test_deepseek_through_the_router_equals_a_single_instance_and_keys_stay_apart(cluster, tiny_dsv3):
    """MLA + MoE: a 1P1D pair of DeepSeek-V3 instances on the same store (other keys: another model),
    each requiring the backend key; the router requires its own key of clients and sends the backend
    key to the instances. A missing or wrong client key (the backend key too) is the router's 401; a
    router sent with a wrong backend key answers a 502 naming the flag; no answer carries the
    backend key."""
    import torch

    from graphgen.runtime import open_engine

    prompts = [PROMPTS[9], PROMPTS[29]]
    procs = {k: _start(cluster.ns, f"ds_{k}", *_serve_args(tiny_dsv3.dir, k, "--api-key", BACKEND_KEY,
                                                           spec=TINY_DSV3))
             for k in ("prefill", "decode")}
    torch.set_num_threads(1)
    with open_engine(TINY_DSV3, tiny_dsv3.dir, write="off") as eng:  # loads while the servers start
        ref = {tuple(p): eng.generate([p], N_NEW)[0].tokens for p in prompts}
    url = {k: _url(p, "serve") for k, p in procs.items()}
    start = cluster.counters(url)
    router = cluster.route("router_ds", "--prefill", url["prefill"], "--api-key", CLIENT_KEY,
                           "--backend-api-key", BACKEND_KEY, decode=url["decode"])
    misconfigured = cluster.route("router_ds_bad", "--prefill", url["prefill"], "--api-key", CLIENT_KEY,
                                  "--backend-api-key", "not-the-backend-key", decode=url["decode"])
    jobs = [dict(_complete(router, p, stream, model="tiny_deepseek_v3"), key=CLIENT_KEY)
            for stream in (False, True) for p in prompts]
    body = {"model": "tiny_deepseek_v3", "prompt": PROMPTS[9], "max_tokens": 2}
    probes = [{"op": "post", "url": router + "/v1/completions", "json": body},                  # no key
              {"op": "post", "url": router + "/v1/completions", "json": body, "key": "wrong"},
              {"op": "post", "url": router + "/v1/completions", "json": body, "key": BACKEND_KEY},
              {"op": "get", "url": router + "/v1/models", "key": CLIENT_KEY},
              {"op": "post", "url": misconfigured + "/v1/completions", "json": body, "key": CLIENT_KEY},
              {"op": "post", "url": misconfigured + "/v1/completions",                          # no P: D refuses
               "json": {**body, "prompt": [PROMPTS[9], PROMPTS[3]]}, "key": CLIENT_KEY}]
    *got, none, wrong, backend, models, bad_p, bad_d = cluster.jobs(*jobs, *probes)
    for job, g in zip(jobs, got):
        assert g["tokens"] == ref[tuple(job["prompt"])], (len(job["prompt"]), job["stream"], g)
        if not job["stream"]:
            assert g["cached"] == (len(job["prompt"]) - 1) // BS * BS
    for r in (none, wrong, backend):
        assert r["status"] == 401 and json.loads(r["body"])["error"]["code"] == "invalid_api_key", r
    assert models["status"] == 200 and json.loads(models["body"])["data"][0]["id"] == "tiny_deepseek_v3"
    for r, kind in ((bad_p, "prefill"), (bad_d, "decode")):
        err = json.loads(r["body"])["error"]
        assert r["status"] == 502 and err["code"] == "backend_auth_failed" and kind in err["message"], r
        assert "--backend-api-key" in err["message"]
    for r in (none, wrong, backend, models, bad_p, bad_d):
        assert BACKEND_KEY not in json.dumps(r) and "not-the-backend-key" not in json.dumps(r)
    cluster.assert_nothing_held(start, url)  # the pair's leases released (with the backend key), blocks free
    for p in procs.values():
        p.kill(signal.SIGTERM)
    cluster.routers.remove(router)  # their backends are gone
    cluster.routers.remove(misconfigured)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (its rank processes, through the forkserver), from /proc."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids + [d for k in kids for d in _descendants(k)]


def test_ranks_pd_through_the_router_equals_a_single_instance_and_a_killed_p_rank_falls_back(cluster, ckpt):
    """Issue 37 item 3: a tp-2 P and a tp-2 D (Qwen3: each rank its own KV heads, two shards ``r0of2``/``r1of2``)
    on the cluster's master. P's ranks save their shards, P hands off both (``kv_transfer_params.shards``), D's
    ranks load their own: through the router the tokens equal D's own cold answer (no handoff), D loads every
    handed-off block, the leases go back to zero. A P rank SIGKILLed fails P within its deadline; the router
    falls back to a recompute on D: every request answered with the same tokens."""
    tp2 = ROOT / "specs" / "tiny_qwen3_tp2.yaml"
    procs = {k: _start(cluster.ns, f"tp2_{k}", *_serve_args(ckpt, k, spec=tp2))
             for k in ("prefill", "decode")}
    url = {k: _url(p, "serve") for k, p in procs.items()}
    start = cluster.counters(url)
    router = cluster.route("router_tp2", "--prefill", url["prefill"], decode=url["decode"])
    prompts = [PROMPTS[16], PROMPTS[29]]
    cold = cluster.jobs(*(_complete(url["decode"], p, model="tiny_qwen3_tp2") for p in prompts))
    (pre,) = cluster.jobs(_complete(url["prefill"], PROMPTS[9], model="tiny_qwen3_tp2"))
    assert pre["kv"]["shards"] == ["r0of2", "r1of2"] and pre["kv"]["num_blocks"] == 2, pre["kv"]
    cluster.jobs({"op": "post", "url": url["prefill"] + "/v1/kv/release", "json": {"lease_id": pre["kv"]["lease_id"]}})
    jobs = [_complete(router, p, stream, model="tiny_qwen3_tp2") for stream in (False, True) for p in prompts]
    out = cluster.jobs(*jobs)
    for job, got in zip(jobs, out):
        p = job["prompt"]
        assert got["tokens"] == cold[prompts.index(p)]["tokens"], (len(p), job["stream"], got)
        if not job["stream"]:  # the first pass: D's ranks loaded every handed-off block, both shards
            assert got["cached"] == (len(p) - 1) // BS * BS, (len(p), got)
    d = cluster.metrics(url["decode"], "graphgen_pd_handoff")
    assert d['graphgen_pd_handoffs_total{result="accepted"}'] == len(jobs)
    assert d['graphgen_pd_handoff_blocks_total{result="recomputed"}'] == 0
    cluster.assert_nothing_held(start, url)  # P's leases back to zero, nothing running on either

    ranks = _descendants(procs["prefill"].p.pid)
    assert ranks, "P's rank processes not found"
    os.kill(ranks[-1], signal.SIGKILL)
    t = time.monotonic()
    out = cluster.jobs(*(_complete(router, p, model="tiny_qwen3_tp2") for p in prompts), timeout=120)
    assert [o["tokens"] for o in out] == [c["tokens"] for c in cold], out
    assert time.monotonic() - t < 90
    r = cluster.metrics(router, "graphgen_route_")
    assert r["graphgen_route_prefill_fallbacks_total"] >= 1
    procs["decode"].kill()
    procs["prefill"].kill()


# ---- P/D instances of dp x tp ranks (issue 37 item 3): tiny DeepSeek, P and D at dp 2 x tp 2 (ep 4), D2 at tp 2 ----
DP_TP, TP_ONLY = ("--dp", "2", "--tp", "2", "--ep", "4"), ("--tp", "2", "--ep", "2")
DS_TOL = 1e-3  # ranks vs one rank (EP / TP reductions reorder sums): tokens equal where the margin is wider
REVERSE = [5, *PROMPTS[29][1:]]  # only the tp-2 P prefills it: D loads it from that P's saves, not its own cache
LONG_NEW = 64  # the request a D rank is killed under: long enough to be caught running
DS_LEASE_S = 5.0  # P's --kv-lease-timeout: outlives the router's requests (each released once D read), lapses after


@pytest.fixture(scope="module")
def dp_pd(cluster, tiny_dsv3):
    """A P and a D of dp 2 x tp 2 ranks each, a D2 and a P2 of tp 2 (the same shards: MLA's latent ``r0of2``) on
    the cluster's master, and the single-rank reference (tokens and step logits) they are held to."""
    import torch

    from graphgen.runtime import open_engine

    procs = {"p": _start(cluster.ns, "dptp_p", *_serve_args(tiny_dsv3.dir, "prefill", *DP_TP, "--kv-lease-timeout",
                                                            str(DS_LEASE_S), spec=TINY_DSV3)),
             "d": _start(cluster.ns, "dptp_d", *_serve_args(tiny_dsv3.dir, "decode", *DP_TP, spec=TINY_DSV3)),
             "d2": _start(cluster.ns, "tp_d2", *_serve_args(tiny_dsv3.dir, "decode", *TP_ONLY, spec=TINY_DSV3)),
             "p2": _start(cluster.ns, "tp_p2", *_serve_args(tiny_dsv3.dir, "prefill", *TP_ONLY, spec=TINY_DSV3))}
    torch.set_num_threads(1)
    with open_engine(TINY_DSV3, tiny_dsv3.dir, write="off", collect_logits=True) as eng:  # while they start
        ref = {tuple(p): eng.generate([p], N_NEW)[0] for p in (PROMPTS[9], PROMPTS[16], PROMPTS[29], REVERSE)}
        ref["long"] = eng.generate([PROMPTS[16]], LONG_NEW)[0]  # (no EOS set here: never stops early)
    url = {k: _url(p, "serve") for k, p in procs.items()}
    yield procs, url, ref
    for p in procs.values():
        p.kill()


def _ds_agree(ref, got: dict, where: str) -> int:
    """D's tokens against one rank's, margin-aware (support.tokens): equal wherever the reference's top-2 margin is
    wider than the ranks' rounding allows."""
    from support.tokens import assert_tokens_agree

    assert "tokens" in got, (where, got)
    return assert_tokens_agree(ref.tokens, ref.step_logits, got["tokens"], 2 * DS_TOL, where=where)


def test_dp_tp_pd_through_the_router_equals_one_rank_and_each_lease_ends_when_d_read_or_timed_out(cluster, dp_pd):
    """P's DP group that ran the prompt saves its TP shards (MLA: the latent once per group, ``r0of2``) and hands
    off the keys (``kv_transfer_params.shards``); D routes the request to one of its DP groups, whose ranks load
    their own shard: through the router (streamed and not) tokens equal one rank's (margin-aware), D loaded every
    handed-off block (0 recomputed). A tp-2 D (no DP groups) loads the dp x tp P's handoff alike, and the dp x tp
    D a tp-2 P's (the same shard naming both ways). Leases: one per
    handoff, released once D has read (the router's release) and, when nobody releases it, at P's
    --kv-lease-timeout (not before). Then leases / running / blocks back to their start."""
    procs, url, ref = dp_pd
    start = cluster.counters(url)
    (pre,) = cluster.jobs(_complete(url["p"], PROMPTS[9], model="tiny_deepseek_v3"))
    kv = pre["kv"]
    assert kv["shards"] == ["r0of2"] and kv["num_blocks"] == (len(PROMPTS[9]) - 1) // BS, kv
    assert cluster.metrics(url["p"], "graphgen_pd_leases")["graphgen_pd_leases"] == 1  # nobody releases this one

    router = cluster.route("router_dptp", "--prefill", url["p"], decode=url["d"])
    router_tp = cluster.route("router_dptp_tp", "--prefill", url["p"], decode=url["d2"])
    router_rev = cluster.route("router_tp_dptp", "--prefill", url["p2"], decode=url["d"])
    prompts = [PROMPTS[16], PROMPTS[29]]
    jobs = [_complete(router, p, stream, model="tiny_deepseek_v3") for stream in (False, True) for p in prompts]
    jobs += [_complete(router_tp, p, model="tiny_deepseek_v3") for p in (PROMPTS[9], PROMPTS[29])]
    rev = [_complete(router_rev, REVERSE, model="tiny_deepseek_v3")]
    out = cluster.jobs(*jobs, *rev)
    for job, got in zip(jobs + rev, out):
        p = job["prompt"]
        _ds_agree(ref[tuple(p)], got, f"{job['base']} {len(p)} tokens, stream {job['stream']}")
        if not job["stream"]:  # D's ranks (or D2's) loaded every handed-off block
            assert got["cached"] == (len(p) - 1) // BS * BS, (job["base"], len(p), got)
    for name, n in (("d", 5), ("d2", 2)):
        d = cluster.metrics(url[name], "graphgen_pd_handoff")
        assert d['graphgen_pd_handoffs_total{result="accepted"}'] == n, (name, d)
        assert d['graphgen_pd_handoff_blocks_total{result="recomputed"}'] == 0, (name, d)
    rel = cluster.metrics(url["p"], "graphgen_pd_lease_releases")
    assert rel['graphgen_pd_lease_releases_total{result="released"}'] == len(jobs), rel  # by the router, D read
    rel2 = cluster.metrics(url["p2"], "graphgen_pd_lease_releases")
    assert rel2['graphgen_pd_lease_releases_total{result="released"}'] == len(rev), rel2
    deadline = time.monotonic() + DS_LEASE_S + 10  # the direct request's lease: until its timeout
    while cluster.metrics(url["p"], "graphgen_pd_leases")["graphgen_pd_leases"]:
        assert time.monotonic() < deadline, "the unreleased lease never lapsed"
        time.sleep(0.05)
    assert time.time() * 1000 >= kv["lease_expires_ms"] - 100  # seen gone at its timeout, not before
    cluster.assert_nothing_held(start, url)  # nothing running or saving, every block free, no lease


def test_a_killed_d_rank_fails_its_instance_and_the_router_sends_its_request_to_another_d(cluster, dp_pd):
    """A rank of D (dp 2 x tp 2) SIGKILLed while D runs a request: D's engine ends within its deadline, the
    request in flight gets D's 503 (no token reached the client) and the router sends it to D2 with the same
    handoff: the client's answer is whole and equals one rank's; D exits (2); the next requests go to D2.
    Never a wrong or hung answer; P's leases back to zero."""
    procs, url, ref = dp_pd
    router = cluster.route("router_dfail", "--prefill", url["p"], "--decode", url["d"], decode=url["d2"])
    start = cluster.counters({k: url[k] for k in ("p", "d2")})
    job = dict(_complete(router, PROMPTS[16], model="tiny_deepseek_v3", ignore_eos=True), max_tokens=LONG_NEW)
    client = subprocess.Popen(cluster.ns.argv(sys.executable, str(HERE / "pd_client.py"), json.dumps([job])),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # the gate: D runs it (round robin: the router's first request goes to D)
    while not cluster.metrics(url["d"], "graphgen_num_requests_running").get("graphgen_num_requests_running"):
        assert time.monotonic() < deadline and client.poll() is None, "D never ran the request"
        time.sleep(0.02)
    ranks = _descendants(procs["d"].p.pid)
    assert ranks, "D's rank processes not found"
    os.kill(ranks[-1], signal.SIGKILL)
    t = time.monotonic()
    assert procs["d"].p.wait(timeout=60) == 2  # D's instance failed: it exits once its request got the sentence
    assert time.monotonic() - t < 30
    out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err[-3000:]
    got = json.loads(out.splitlines()[-1])
    assert len(got.get("tokens", ())) == LONG_NEW, got
    _ds_agree(ref["long"], got, "the request D's rank died under, answered by D2")
    r = cluster.metrics(router, "graphgen_route_")
    assert r['graphgen_route_backend_errors_total{kind="decode_failed"}'] == 1, r
    after = cluster.jobs(*(_complete(router, p, stream, model="tiny_deepseek_v3")
                           for stream, p in ((False, PROMPTS[9]), (True, PROMPTS[29]))))
    for p, got in zip([PROMPTS[9], PROMPTS[29]], after):
        _ds_agree(ref[tuple(p)], got, f"after D's failure, {len(p)} tokens")
    cluster.assert_nothing_held(start, {k: url[k] for k in ("p", "d2")})


SPEC_DECODE = "graphgen_spec_decode_num_"


def _acceptance(cluster, base) -> tuple:
    """D's speculative-decoding totals: (drafts, accepted, accepted per position)."""
    m = cluster.metrics(base, SPEC_DECODE)
    per_pos = tuple(m.get(f'{SPEC_DECODE}accepted_tokens_per_pos_total{{position="{i}"}}', 0) for i in (0, 1))
    return m.get(f"{SPEC_DECODE}draft_tokens_total", 0), m.get(f"{SPEC_DECODE}accepted_tokens_total", 0), per_pos


def _delta(after, before):
    return after[0] - before[0], after[1] - before[1], tuple(a - b for a, b in zip(after[2], before[2]))


def test_mtp_pd_through_the_router_equals_the_single_rank_run_and_keeps_the_acceptance(cluster, tmp_path_factory):
    """Issue 38 item 1: a speculative P and D (``--speculative mtp``, K = 2; DeepSeek-V3 with its MTP layer) on
    the cluster's master behind the router. P saves the MTP layer's KV with the target's under successor keys and
    says so (``kv_transfer_params.lookahead``); D loads every handed-off block. Through the router the tokens
    equal the CPU single-rank run (within its margin, support.tokens), and D's acceptance after the handoff
    equals the single-rank run's cold acceptance and D's own after a pool hit (the same prompt sent to D alone:
    the blocks P saved). A D without ``--speculative`` behind the same P: the handoff is a counted mismatch,
    the prompt recomputed, the tokens right. (With random weights the acceptance is near 0: the drafts' use of
    the handed-off MTP KV is proved on their logits in tests/runtime/test_mtp_handoff.py.)"""
    import dataclasses

    import torch

    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime import open_engine
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint
    from support.paths import TINY_DSV3_MTP
    from support.tokens import assert_tokens_agree

    ckpt = write_random_hf_checkpoint(str(tmp_path_factory.mktemp("pd_mtp") / "ckpt"), "deepseek_v3",
                                      dataclasses.asdict(load_spec(TINY_DSV3_MTP).dims), seed=11, tokenizer=False,
                                      mtp_layers=1)
    spec_args = ("--speculative", "mtp", "--num-speculative-tokens", "2")
    procs = {"prefill": _start(cluster.ns, "mtp_p", *_serve_args(ckpt, "prefill", *spec_args, spec=TINY_DSV3_MTP)),
             "decode": _start(cluster.ns, "mtp_d", *_serve_args(ckpt, "decode", *spec_args, spec=TINY_DSV3_MTP)),
             "plain": _start(cluster.ns, "mtp_plain_d", *_serve_args(ckpt, "decode", spec=TINY_DSV3_MTP))}
    prompts = [PROMPTS[16], PROMPTS[29]]
    torch.set_num_threads(1)
    ref, cold = {}, {}
    with open_engine(TINY_DSV3_MTP, ckpt, write="off", collect_logits=True) as eng:  # while the servers start
        for p in prompts:
            ref[tuple(p)] = eng.generate([p], N_NEW)[0]
    with open_engine(TINY_DSV3_MTP, ckpt, write="off", num_speculative_tokens=2) as eng:
        for p in prompts:  # the single-rank run's cold acceptance
            r = eng.generate([p], N_NEW)[0]
            cold[tuple(p)] = (r.num_draft_tokens, r.num_accepted_tokens, tuple(r.accepted_per_pos))
    url = {k: _url(p, "serve") for k, p in procs.items()}
    start = cluster.counters(url)
    model = "tiny_deepseek_v3_mtp"
    router = cluster.route("router_mtp", "--prefill", url["prefill"], decode=url["decode"])
    (pre,) = cluster.jobs(_complete(url["prefill"], PROMPTS[9], model=model))
    assert pre["tokens"] == [] and pre["kv"]["lookahead"] is True and pre["kv"]["num_blocks"] == 2, pre
    cluster.jobs({"op": "post", "url": url["prefill"] + "/v1/kv/release", "json": {"lease_id": pre["kv"]["lease_id"]}})

    def check(got, p, where):
        want = ref[tuple(p)]
        assert_tokens_agree(want.tokens, want.step_logits, got["tokens"], 1e-4, where=f"{where}, prompt of {len(p)}")

    for stream in (False, True):
        for p in prompts:
            before = _acceptance(cluster, url["decode"])
            (got,) = cluster.jobs(_complete(router, p, stream, model=model, ignore_eos=True))
            check(got, p, f"through the router (stream={stream})")
            if not stream:  # the first pass: D loaded every block P handed off (their MTP KV with them)
                assert got["cached"] == (len(p) - 1) // BS * BS, (len(p), got)
                assert _delta(_acceptance(cluster, url["decode"]), before) == cold[tuple(p)], len(p)
    d = cluster.metrics(url["decode"], "graphgen_pd_handoff")
    assert d['graphgen_pd_handoffs_total{result="accepted"}'] == 4
    assert d['graphgen_pd_handoff_blocks_total{result="recomputed"}'] == 0
    for p in prompts:  # D alone, no handoff: a pool hit on the blocks P saved
        before = _acceptance(cluster, url["decode"])
        (got,) = cluster.jobs(_complete(url["decode"], p, model=model, ignore_eos=True))
        check(got, p, "D alone after a pool hit")
        assert got["cached"] == (len(p) - 1) // BS * BS
        assert _delta(_acceptance(cluster, url["decode"]), before) == cold[tuple(p)], len(p)

    # the mismatched pair: P decodes speculatively, D does not (its keys carry no successor)
    (pre,) = cluster.jobs(_complete(url["prefill"], PROMPTS[16], model=model))
    (got,) = cluster.jobs(_complete(url["plain"], PROMPTS[16], model=model, kv_transfer_params=pre["kv"],
                                    ignore_eos=True))
    check(got, PROMPTS[16], "a D without --speculative")
    assert got["cached"] == 0
    m = cluster.metrics(url["plain"], "graphgen_pd_handoff")
    assert m['graphgen_pd_handoffs_total{result="mismatch"}'] == 1
    assert m['graphgen_pd_handoff_blocks_total{result="recomputed"}'] == 3
    cluster.jobs({"op": "post", "url": url["prefill"] + "/v1/kv/release", "json": {"lease_id": pre["kv"]["lease_id"]}})
    cluster.assert_nothing_held(start, url)  # P's leases back to zero, nothing running, every block free
    for p in procs.values():
        p.kill(signal.SIGTERM)
    cluster.routers.remove(router)


def test_prefill_killed_mid_save_costs_a_recompute(cluster, reference):
    router = cluster.route("router_p2", "--prefill", cluster.url["p2"])
    client = subprocess.Popen(cluster.ns.argv(sys.executable, str(HERE / "pd_client.py"),
                                              json.dumps([_complete(router, LONG)])),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the gate: P2's prefill ran and its commit is under way (10 puts of 0.3 s each: ~3 s of them left)
    deadline = time.monotonic() + 60
    while not cluster.metrics("p2", "graphgen_kv_saves_pending").get("graphgen_kv_saves_pending"):
        assert time.monotonic() < deadline and client.poll() is None, "P2 never began its saves"
        time.sleep(0.01)
    cluster.procs["p2"].kill(signal.SIGKILL)
    out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err[-3000:]
    got = json.loads(out.splitlines()[-1])
    assert got["tokens"] == reference[tuple(LONG)]
    assert got["cached"] < (len(LONG) - 1) // BS * BS  # what P2 committed before it died, at most
    fb = cluster.metrics(router, "graphgen_route_prefill_fallbacks_total")
    assert fb["graphgen_route_prefill_fallbacks_total"] == 1
    cluster.assert_nothing_held()


def test_master_killed_requests_succeed_by_recompute(cluster, reference):
    import os

    os.kill(cluster.master_pid, signal.SIGKILL)
    p = [77, *PROMPTS[16][1:]]
    (got,) = cluster.jobs(_complete(cluster.router, p))
    assert got["tokens"] == reference[tuple(p)] and got["cached"] == 0  # nothing could be handed off
    cluster.assert_nothing_held()


def test_decode_killed_mid_stream_is_a_clear_error_then_restarted_it_serves_again(cluster, ckpt, reference):
    job = dict(_complete(cluster.router, PROMPTS[9], stream=True, ignore_eos=True), max_tokens=1500, progress=True)
    client = subprocess.Popen(cluster.ns.argv(sys.executable, str(HERE / "pd_client.py"), json.dumps([job])),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert json.loads(client.stdout.readline()) == {"first_chunk": True}  # the stream is under way
    cluster.procs["d"].kill(signal.SIGKILL)
    out, err = client.communicate(timeout=60)
    assert client.returncode == 0, err[-3000:]
    got = json.loads(out.splitlines()[-1])
    assert "the decode instance failed" in got["error"], got
    # the router's health check (every 0.5 s here) notices the dead instance; until then a request
    # may still be tried on it and fail: only the state after the check is asserted
    deadline = time.monotonic() + 15
    while cluster.jobs({"op": "get", "url": cluster.router + "/health"})[0]["status"] != 503:
        assert time.monotonic() < deadline, "the router kept reporting a dead decode instance healthy"
        time.sleep(0.05)
    (after,) = cluster.jobs(_complete(cluster.router, [1, 2]))
    assert after["status"] == 503
    assert cluster.metrics("p1", "graphgen_pd_leases")["graphgen_pd_leases"] == 0  # released at D's first bytes

    # D restarted on its old port: the router's health check finds it again, and requests go through
    args = list(_serve_args(ckpt, "decode"))
    args[args.index("--port") + 1] = cluster.url["d"].rsplit(":", 1)[-1]
    cluster.procs["d"] = _start(cluster.ns, "d_restarted", *args)
    _url(cluster.procs["d"], "serve")
    deadline = time.monotonic() + 30
    while cluster.jobs({"op": "get", "url": cluster.router + "/health"})[0]["status"] != 200:
        assert time.monotonic() < deadline, "the router never saw the restarted decode instance"
        time.sleep(0.05)
    got = cluster.jobs(_complete(cluster.router, PROMPTS[16]), _complete(cluster.router, PROMPTS[29], stream=True))
    assert [g["tokens"] for g in got] == [reference[tuple(PROMPTS[16])], reference[tuple(PROMPTS[29])]]
    cluster.assert_nothing_held()
