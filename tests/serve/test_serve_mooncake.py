"""Two ``graphgen serve`` instances on one Mooncake master share a prefix: instance B's first
request loads the blocks instance A's request saved, and both answer with the tokens of a cold run.

Everything runs in a private network namespace (tests/support/netns.py: held by an ``unshare -n``
sleeper, entered with ``nsenter``): the master and its segment, both servers, and the ``openai``
client (a process of its own, ``ns_client.py``, since the servers are reachable only in there).
The reference tokens come from a cold ``Engine`` (write off, no pool) in this process."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from serve_util import SPEC
from support.netns import Namespace, _env, _Proc

HERE = Path(__file__).resolve().parent

PORT = 50150
URL = f"mooncake://127.0.0.1:{PORT}"
BS = 4
P = list(range(1, 14))          # 13 tokens: 3 full blocks saved
Q = P[:8] + [40, 41, 42]        # shares P's first 2 blocks
N_NEW = 4


@pytest.fixture
def ns(tmp_path):
    try:
        n = Namespace()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)  # never a silent skip, as the Mooncake tests
    n.logdir = str(tmp_path)
    try:
        yield n
    finally:
        n.close()


def _serve(ns, ckpt, name) -> tuple[_Proc, str]:
    # private: inside the test's own network namespace, on its own master (not a shared server)
    p = _Proc(ns.argv(sys.executable, "-m", "graphgen", "serve", "--spec", str(SPEC), "--weights", str(ckpt),
                      "--port", "0", "--pool", URL, "--write", "sync", "--torch-threads", "1"), log=ns._log(name))
    ns.procs.append(p)
    line = p.wait_line("graphgen serve: listening on", 120)
    return p, line.rsplit(" ", 1)[-1]


def _ask(ns, base, prompts) -> list[dict]:
    res = subprocess.run(ns.argv(sys.executable, str(HERE / "ns_client.py"), base, json.dumps(prompts), str(N_NEW)),
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(s) for s in res.stdout.splitlines() if s.startswith("{")]


def test_two_servers_share_a_prefix_through_one_master(ns, ckpt):
    import torch

    from graphgen.runtime import Engine, open_engine

    torch.set_num_threads(1)
    with open_engine(SPEC, ckpt, write="off") as eng:
        cold = {tuple(p): eng.generate([p], N_NEW)[0].tokens for p in (P, Q)}
    ns.serve(PORT)
    a, base_a = _serve(ns, ckpt, "serve_a")
    b, base_b = _serve(ns, ckpt, "serve_b")
    (ra,) = _ask(ns, base_a, [P])                       # A: cold prefill, sync save to the master
    assert ra == {"tokens": cold[tuple(P)], "cached": 0}
    rq, rp = _ask(ns, base_b, [Q, P])                   # B: another process loads A's blocks
    assert rq == {"tokens": cold[tuple(Q)], "cached": 2 * BS}
    assert rp == {"tokens": cold[tuple(P)], "cached": 3 * BS}
    for p in (a, b):                                    # SIGTERM drains: exit 0
        p.p.send_signal(signal.SIGTERM)
        assert p.p.wait(60) == 0
