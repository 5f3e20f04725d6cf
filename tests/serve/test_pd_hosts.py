"""P/D across hosts (docs/pd.md, "Across hosts"): two network namespaces joined by a veth pair
(`support.hosts.TwoHosts`, 192.0.2.1 and .2), the Mooncake master and its segment with the prefill
instance on the first, the decode instance, the router and the client (the official ``openai`` client,
``pd_client.py``) on the second. Each instance's Mooncake client announces its own host's address
(``local_hostname``), the store its own (``mooncake_server --host``).

Proved here: through the router, greedy tokens equal a cold engine's (the engine one ``both`` instance
serves; ``test_serve_run_parity.py`` holds the server to it), streamed and not, and D loaded every block P
handed off (``cached_tokens``: the KV came from the other host's store, not recomputed; the handoff
counters agree).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from serve_util import SPEC
from support.hosts import TwoHosts

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PORT = 50190
BS = 4
N_NEW = 5
PROMPTS = [[(5 * n + 3 * i) % 150 + 1 for i in range(n)] for n in (9, 16, 29)]


@pytest.fixture
def hosts(tmp_path):
    h = TwoHosts(str(tmp_path))
    try:
        yield h
    finally:
        h.close()


def _url(proc, what="serve") -> str:
    return proc.wait_line(f"graphgen {what}: listening on", 180).rsplit(" ", 1)[-1]


def test_prefill_and_decode_on_two_hosts_equal_one_instance(hosts, ckpt):
    import torch

    from graphgen.runtime import open_engine

    a, b = hosts.hosts
    store = a.start(sys.executable, "-m", "graphgen.runtime.pool.mooncake_server", "serve", "--host", a.addr,
                    "--port", str(PORT), "--segment", "64MiB", log="store")
    assert f"master={a.addr}:{PORT}" in store.wait_line("ready", 60)
    pool = f"mooncake://{a.addr}:{PORT}?local_hostname="
    serve = ("serve", "--spec", SPEC, "--weights", ckpt, "--port", 0, "--torch-threads", 1)
    p = a.graphgen(*serve, "--host", a.addr, "--pool", pool + a.addr, "--role", "prefill", log="p")
    d = b.graphgen(*serve, "--pool", pool + b.addr, "--role", "decode", log="d")
    torch.set_num_threads(1)
    with open_engine(SPEC, ckpt, write="off") as eng:  # meanwhile: the reference, a cold engine
        want = [eng.generate([q], N_NEW)[0].tokens for q in PROMPTS]
    p_url, d_url = _url(p), _url(d)
    assert p_url.startswith(f"http://{a.addr}:"), p_url
    router = _url(b.graphgen("route", "--prefill", p_url, "--decode", d_url, "--port", 0, "--health-interval", 0.5,
                             log="router"), "route")
    jobs = [{"op": "complete", "base": router, "prompt": q, "max_tokens": N_NEW, "stream": stream}
            for stream in (False, True) for q in PROMPTS]
    jobs.append({"op": "metrics", "base": d_url, "prefixes": ["graphgen_pd_handoff"]})
    client = b.start(sys.executable, str(HERE / "pd_client.py"), json.dumps(jobs), log="client")
    out = [json.loads(client.wait_line("{", 120)) for _ in jobs]
    *got, handoffs = out
    for job, r in zip(jobs, got):
        q = job["prompt"]
        assert r["tokens"] == want[PROMPTS.index(q)], (len(q), job["stream"], r, b.log("d"), a.log("p"))
        assert r["cached"] == (len(q) - 1) // BS * BS, (len(q), r)  # D loaded P's blocks from host A's store
    assert handoffs['graphgen_pd_handoffs_total{result="accepted"}'] == len(got)
    assert handoffs['graphgen_pd_handoff_blocks_total{result="recomputed"}'] == 0
