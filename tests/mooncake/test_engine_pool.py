"""Engines sharing a Mooncake master, and its faults, end to end: real `mooncake_master` processes,
engine processes (`graphgen run`, or `engine_worker.py` driven through a pipe), all inside a
private network namespace per test (tests/support/netns.py). The reference is a cold run of the same prompts
in this process (write off, no pool): a prefix loaded from the pool must give exactly its tokens.

The tiny model's KV block is ~2 KiB, so a SIGKILL lands between puts far more often than inside
one; the inside-a-put case (8 MiB values) is test_mooncake_pool.py's writer-killed test."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from types import SimpleNamespace

import pytest

from support.netns import ROOT

PORT = 50110
MASTER = f"127.0.0.1:{PORT}"
URL = f"mooncake://{MASTER}"
SPEC = os.path.join(ROOT, "specs", "tiny_qwen3.yaml")
N_NEW = 4
BS = 4                                            # tiny_qwen3's block size (checked below)
P = list(range(1, 14))                            # 13 tokens: 3 blocks looked up, 3 saved
Q = P[:8] + [40, 41, 42]                          # shares P's first 2 blocks
K = [(7 * i) % 250 + 1 for i in range(33)]        # 8 blocks saved
FRESH = [[200 + i, 3, 5, 7, 11, 13] for i in range(40)]   # 1 block each, never seen before


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import torch

    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime import open_engine
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(SPEC)
    assert spec.kv_cache.block_size == BS
    ckpt = tmp_path_factory.mktemp("mooncake_engine") / "tiny_qwen3"
    write_random_hf_checkpoint(ckpt, spec.family, dataclasses.asdict(spec.dims), seed=0)
    torch.set_num_threads(1)
    cold = {}
    with open_engine(SPEC, ckpt, write="off") as eng:
        for p in [P, Q, K, *FRESH[:3]]:
            cold[tuple(p)] = eng.generate([p], N_NEW)[0].tokens
    return SimpleNamespace(weights=str(ckpt), cold=lambda p: cold[tuple(p)])


def _pid(line):
    return int(dict(f.split("=", 1) for f in line.split()[1:])["pid"])


def _run(ns, model, url, *prompts):
    args = ["run", "--spec", SPEC, "--weights", model.weights, "--pool", url, "--json",
            "--max-new-tokens", str(N_NEW)]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    t = time.monotonic()
    res = ns.run(*args)
    res.dt = time.monotonic() - t
    return res, [json.loads(s) for s in res.stdout.splitlines() if s.startswith("{")]


def test_cli_runs_share_blocks_and_a_dead_master_costs_only_a_recompute(ns, model):
    """The acceptance test: `graphgen run --pool mooncake://...` in separate processes."""
    _, master_pid = ns.serve(PORT)
    res, a = _run(ns, model, URL, P)                  # A: cold prefill, async save (the spec's write)
    assert res.returncode == 0, res.stderr
    assert a[0]["hit_tokens"] == 0 and a[0]["tokens"] == model.cold(P)
    res, b = _run(ns, model, URL, Q, P)               # B: another process loads A's blocks
    assert res.returncode == 0, res.stderr
    assert [o["hit_tokens"] for o in b] == [2 * BS, 3 * BS]
    assert [o["variant"] for o in b] == ["splitfuse", "splitfuse"]
    assert [o["tokens"] for o in b] == [model.cold(Q), model.cold(P)]

    os.kill(master_pid, signal.SIGKILL)
    res, c = _run(ns, model, URL, Q, P)               # no master: recompute, exit 0, same tokens
    assert res.returncode == 0, res.stderr
    assert [o["hit_tokens"] for o in c] == [0, 0]
    assert [o["tokens"] for o in c] == [model.cold(Q), model.cold(P)]
    assert res.stderr.count("unavailable") == 1       # logged once, not per block
    assert "errors" in res.stderr and res.dt < 60


def test_master_killed_mid_run_then_restarted_empty(ns, model):
    master, line = ns.server("master", "--port", str(PORT), name="master1")
    ns.server("segment", "--master", MASTER, "--segment", "64MiB", name="segment")
    e = ns.engine(URL + "?max_backoff=1", spec=SPEC, weights=model.weights, write="async")
    assert e.call(op="gen", prompts=[P])["hit"] == [0]
    r = e.call(op="gen", prompts=[P])
    assert r["hit"] == [3 * BS] and r["tokens"] == [model.cold(P)]

    os.kill(_pid(line), signal.SIGKILL)
    master.kill()
    t = time.monotonic()
    r = e.call(op="gen", prompts=[Q, K], timeout=60)  # requests keep succeeding: recomputed
    assert r["tokens"] == [model.cold(Q), model.cold(K)] and r["hit"] == [0, 0]
    assert time.monotonic() - t < 30                  # one RPC timeout, then fail-fast
    s = e.call(op="stats")
    assert s["pool"]["down"] and s["pool"]["down_events"] == 1 and s["pool"]["errors"] >= 1
    assert s["engine"]["put_failures"] >= 1
    assert s["warnings"].get("graphgen.runtime.pool.mooncake") == 1

    ns.server("master", "--port", str(PORT), name="master2")    # empty
    deadline, i, puts = time.monotonic() + 30, 3, s["engine"]["puts"]
    while True:        # the client reconnects after its backoff; puts land once the segment re-mounts
        r = e.call(op="gen", prompts=[FRESH[i]], timeout=60)
        assert r["hit"] == [0]
        s = e.call(op="stats")
        if s["engine"]["puts"] > puts or time.monotonic() > deadline:
            break
        i += 1
        time.sleep(0.3)
    assert s["pool"]["reconnects"] == 1 and not s["pool"]["down"] and s["engine"]["puts"] == puts + 1
    puts = s["engine"]["puts"]
    r = e.call(op="gen", prompts=[P])                 # the new master is empty: a miss, no stale data
    assert r["hit"] == [0] and r["tokens"] == [model.cold(P)]
    assert e.call(op="stats")["engine"]["puts"] == puts + 3
    r = e.call(op="gen", prompts=[P])                 # ... and saving works again
    assert r["hit"] == [3 * BS] and r["tokens"] == [model.cold(P)]
    s = e.call(op="stats")
    assert s["warnings"]["graphgen.runtime.pool.mooncake"] == 2   # down once, back once
    assert s["pool"]["rejected"] == 0


def test_full_segment_fails_puts_counts_them_and_requests_succeed(ns, model):
    ns.serve(PORT, "16MiB", "--lease-ttl-ms", "120000")
    filler = ns.worker(MASTER, name="filler")
    f = filler.call(op="fill", sizes=[1 << 20, 64 << 10, 2048 + 48], timeout=60)   # full, leased
    assert f["stored"] > 0 and f["failed"] > 0
    e = ns.engine(URL, spec=SPEC, weights=model.weights, write="sync")
    r = e.call(op="gen", prompts=[P, P])
    assert r["tokens"] == [model.cold(P)] * 2 and r["hit"] == [0, 0]
    s = e.call(op="stats")
    assert s["engine"]["put_failures"] == 6 and s["engine"]["puts"] == 0    # both prefills saved 3
    assert s["pool"]["segment_full"] == 6 and not s["pool"]["down"]   # full is not an outage


def test_instance_killed_during_async_save_never_leaves_a_bad_block(ns, model):
    ns.serve(PORT)
    a = ns.engine(URL, name="a", spec=SPEC, weights=model.weights, write="async",
                  faults="put_delay=0.2")            # A's commit of K's 8 blocks takes >= 1.6 s
    r = a.call(op="gen", prompts=[K], drain=False)   # the first token does not wait for the save
    assert r["tokens"] == [model.cold(K)]
    time.sleep(0.5)
    a.kill(signal.SIGKILL)                           # mid-commit
    b = ns.engine(URL, name="b", spec=SPEC, weights=model.weights, write="async")
    r = b.call(op="gen", prompts=[K])
    assert r["tokens"] == [model.cold(K)]
    assert 0 < r["hit"][0] < 8 * BS, r               # a leading run of A's complete puts, no more
    s = b.call(op="stats")
    assert s["pool"]["rejected"] == 0 and s["pool"]["errors"] == 0


def test_two_instances_put_the_same_blocks_concurrently(ns, model):
    ns.serve(PORT)
    a = ns.engine(URL, name="a", spec=SPEC, weights=model.weights, write="async", faults="put_delay=0.02")
    b = ns.engine(URL, name="b", spec=SPEC, weights=model.weights, write="async", faults="put_delay=0.02")
    a.send(op="gen", prompts=[K])
    b.send(op="gen", prompts=[K])
    ra, rb = a.result(60), b.result(60)
    assert ra["tokens"] == rb["tokens"] == [model.cold(K)]
    for w in (a, b):
        r = w.call(op="gen", prompts=[K, P])
        assert r["hit"][0] == 8 * BS and r["tokens"] == [model.cold(K), model.cold(P)]
        s = w.call(op="stats")
        assert s["pool"]["rejected"] == 0 and s["engine"]["pool_errors"] == 0
