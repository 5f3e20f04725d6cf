"""Ranks across nodes, as two hosts on one machine (`support.hosts.TwoHosts`: two network namespaces
joined by a veth pair, 192.0.2.1 and .2): ``graphgen run --nnodes 2 --node-rank R --master-addr A``
with node 0 in one namespace and node 1 in the other, each running its half of the ranks.

Proved here: a tiny spec at 2 nodes x 2 ranks gives the tokens of its 4 ranks on one node (an engine in
this process), for Qwen3 at tp 4 (``serve``: HTTP from node 0) and DeepSeek-V3 at dp 4 x ep 4 (``run``;
tp 1 per DP group: what the DP ranks run), and the ranks' traffic crossed the veth pair (its byte
counter); a node killed mid-run is reported by the other within seconds, in one sentence naming it, both
ways (node 1 killed: node 0's stream and node 0 name it, node 0 exits with that one sentence and no
traceback, also while it is idle; node 0 killed: node 1 names the driver); a node that never joins, and a driver that never answers, are reported at the start deadline;
under torchrun (one process per rank, its environment instead of the flags) ``serve`` answers HTTP on
node 0 with the one-rank engine's tokens.
"""
from __future__ import annotations

import json
import re
import sys
import time

import pytest

from support.hosts import TwoHosts
from support.paths import SPECS, TINY_QWEN3

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 11, 3, 7, 2, 8], [40, 41, 42], [7] * 13]
N_NEW = 6
START_S = 180
DSV3 = SPECS / "tiny_deepseek_v3_dp2ep2.yaml"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = TwoHosts(str(tmp_path_factory.mktemp("hosts")))
    try:
        yield h
    finally:
        h.close()


def _node(host, rank, port, *args, master, log):
    return host.graphgen("run", *args, "--nnodes", "2", "--node-rank", rank, "--master-addr", master,
                         "--master-port", port, "--torch-threads", "1", log=log)


def _cluster(hosts, port, *args, prompts=PROMPTS, n_new=N_NEW, pools=()):
    """Node 1 in the second namespace, node 0 (``--json``) in the first: (node 0, node 1). ``pools``: node 0's
    and node 1's ``--pool`` (each its own address in a Mooncake URL)."""
    a, b = hosts.hosts
    own = [("--pool", p) for p in pools] or [(), ()]
    n1 = _node(b, 1, port, *args, *own[1], master=a.addr, log=f"node1-{port}")
    ids = [x for p in prompts for x in ("--prompt-ids", ",".join(map(str, p)))]
    n0 = _node(a, 0, port, *args, *own[0], "--json", "--max-new-tokens", n_new, *ids, master=a.addr,
               log=f"node0-{port}")
    return n0, n1


def _tokens(n0, count):
    return [json.loads(n0.wait_line("{", START_S))["tokens"] for _ in range(count)]


def _reference(spec, weights, **layout):
    from graphgen.runtime import open_engine

    with open_engine(spec, weights, **layout) as eng:
        return [r.tokens for r in eng.generate(PROMPTS, N_NEW)]


def _both_exit_0(hosts, n0, n1, port):
    a, b = hosts.hosts
    assert n0.p.wait(60) == 0, a.log(f"node0-{port}")
    assert n1.p.wait(60) == 0, b.log(f"node1-{port}")


def test_qwen3_tp4_serve_on_two_nodes_equals_four_ranks_on_one_and_a_lost_node_ends_it(hosts, ckpt):
    """``serve --nnodes 2``: node 0 answers HTTP (the ``openai`` client, in node 0's namespace) with the tokens
    of the 4-rank engine on one node; then node 1 dies mid-stream: the stream ends with the error naming it,
    and node 0's server exits 2 within seconds with the same sentence."""
    import sys

    from support.paths import TESTS

    a, b = hosts.hosts
    before = b.rx_bytes()
    args = ("serve", "--spec", TINY_QWEN3, "--weights", ckpt, "--tp", 4, "--nnodes", 2, "--master-addr", a.addr,
            "--master-port", 29610, "--torch-threads", 1)
    n1 = b.graphgen(*args, "--node-rank", 1, log="qwen-node1")
    n0 = a.graphgen(*args, "--node-rank", 0, "--host", a.addr, "--port", 0, log="qwen-node0")
    want = _reference(TINY_QWEN3, ckpt, tp=4)  # meanwhile
    url = n0.wait_line("graphgen serve: listening on", START_S).rsplit(" ", 1)[-1]
    jobs = [{"op": "complete", "base": url, "prompt": p, "max_tokens": N_NEW} for p in PROMPTS]
    jobs.append({"op": "complete", "base": url, "prompt": [3, 1, 4], "max_tokens": 1000, "stream": True,
                 "progress": True})
    client = a.start(sys.executable, str(TESTS / "serve" / "pd_client.py"), json.dumps(jobs), log="client")
    got = [json.loads(client.wait_line("{", 120))["tokens"] for _ in PROMPTS]
    assert got == want
    assert "node 1 (ranks 2-3) joined node 0 at 192.0.2.1:29611" in b.log("qwen-node1")
    # the collectives crossed the pair (~650 KB here; the channel's pings alone: ~100 B/s each way)
    assert b.rx_bytes() - before > 100_000
    assert json.loads(client.wait_line("{", 60)) == {"first_chunk": True}
    n1.kill()  # node 1 dies mid-stream: its process group (follower, forkserver, ranks)
    t = time.monotonic()
    stream = json.loads(client.wait_line("{", 30))
    # noticed in the step, or in the loop's poll between steps (no command running: the idle case's words)
    lost = r"node 1 \(ranks 2-3\) was lost: its connection to the driver closed (during step|\(between commands\))"
    assert re.search(lost, stream["error"]), stream
    assert n0.p.wait(15) == 2 and time.monotonic() - t < 15
    log = a.log("qwen-node0")  # the sentence once, and no traceback before it (issue 43 item 5)
    assert re.findall(f"graphgen serve: {lost}", log) and log.count("graphgen serve: node 1") == 1, log[-3000:]
    assert "Traceback" not in log and "engine loop died" not in log, log[-3000:]


def test_a_node_lost_while_serve_is_idle_ends_it_in_the_promised_sentence(hosts, ckpt):
    """The newcomer's case (issue 43 item 5): ``serve --nnodes 2`` that never had a request; node 1 is SIGKILLed
    while node 0's server is idle: node 0 exits 2 within seconds with docs/parallel.md's sentence, ending
    ``(between commands)``, said once and with no traceback (before the fix: ``engine loop died``, two chained
    tracebacks, then the sentence ending ``during core``). tp 2, one rank per node: the fewest processes."""
    a, b = hosts.hosts
    args = ("serve", "--spec", TINY_QWEN3, "--weights", ckpt, "--tp", 2, "--nnodes", 2, "--master-addr", a.addr,
            "--master-port", 29640, "--torch-threads", 1)
    n1 = b.graphgen(*args, "--node-rank", 1, log="idle-node1")
    n0 = a.graphgen(*args, "--node-rank", 0, "--host", a.addr, "--port", 0, log="idle-node0")
    n0.wait_line("graphgen serve: listening on", START_S)
    n1.kill()
    t = time.monotonic()
    assert n0.p.wait(15) == 2 and time.monotonic() - t < 15, a.log("idle-node0")[-3000:]
    log = a.log("idle-node0")
    lost = "graphgen serve: node 1 (rank 1) was lost: its connection to the driver closed (between commands)"
    assert log.count(lost) == 1 and log.count("graphgen serve: node 1") == 1, log[-3000:]
    assert "Traceback" not in log and "engine loop died" not in log, log[-3000:]


def test_deepseek_dp4_ep4_on_two_nodes_equals_four_ranks_on_one(hosts, tiny_dsv3):
    """``run --nnodes 2`` of the DP + EP layout; meanwhile a follower whose driver never answers (another
    port) gives up at its start deadline."""
    a, b = hosts.hosts
    lonely = _node(b, 1, 29660, "--spec", DSV3, "--weights", tiny_dsv3.dir, "--dp", 4, "--ep", 4,
                   "--rank-timeout", "start=2", master=a.addr, log="lonely")
    n0, n1 = _cluster(hosts, 29620, "--spec", DSV3, "--weights", tiny_dsv3.dir, "--dp", 4, "--ep", 4)
    got = _tokens(n0, len(PROMPTS))
    _both_exit_0(hosts, n0, n1, 29620)
    assert got == _reference(DSV3, tiny_dsv3.dir, dp=4, ep=4)
    code, line, _ = _reported(lonely, b, "lonely", 60)
    assert code == 2 and "node 0 never answered at 192.0.2.1:29661 within 2 s" in line, line


def _reported(proc, host, log, within_s):
    """(exit code, the last stderr line) once ``proc`` exits, which must happen within ``within_s``."""
    t0 = time.monotonic()
    code = proc.p.wait(within_s)
    return code, host.log(log).strip().splitlines()[-1], time.monotonic() - t0


def test_a_node_that_never_joins_fails_the_driver_at_its_start_deadline(ckpt):
    """Node 0 alone (in this process, on loopback: its ranks wait in the rendezvous for node 1's)."""
    from graphgen.runtime import Deadlines, RankFailure, open_engine
    from graphgen.runtime.parallel.cluster import Placement

    here = Placement.of(2, nnodes=2, master_addr="127.0.0.1", master_port=29680, environ={})
    t = time.monotonic()
    with pytest.raises(RankFailure, match=r"^node 1 \(rank 1\) never joined: nothing connected to "
                                          r"127\.0\.0\.1:29681 within 2 s"):
        open_engine(TINY_QWEN3, ckpt, tp=2, placement=here, rank_timeout=Deadlines(start=2))
    assert time.monotonic() - t < 30


def test_torchrun_serve_on_two_nodes_serves_http_from_rank_0(hosts, ckpt):
    """torchrun (``python -m torch.distributed.run``, static rendezvous on node 0's address) starts one
    ``graphgen serve`` per rank: RANK 0's drives and serves HTTP on node 0, RANK 1's follows on node 1.
    Greedy completions equal the one-rank engine's (tp 2 equals tp 1: tests/parallel/test_parallel_ranks.py).
    Then node 0 dies (its torchrun and everything under it, SIGKILL): node 1 names the lost driver within
    seconds and its torchrun fails."""
    import sys

    from graphgen.runtime import open_engine
    from support.paths import TESTS

    a, b = hosts.hosts
    procs = []
    for host, rank in ((b, 1), (a, 0)):
        procs.append(host.start(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--node-rank", str(rank), "--master-addr", a.addr, "--master-port", "29670", "-m",
                                "graphgen", "serve", "--spec", str(TINY_QWEN3), "--weights", str(ckpt), "--tp", "2",
                                "--host", a.addr, "--port", "0", "--torch-threads", "1", log=f"torchrun{rank}"))
    t1, t0 = procs
    url = t0.wait_line("graphgen serve: listening on", START_S).rsplit(" ", 1)[-1]
    assert url.startswith(f"http://{a.addr}:"), url
    jobs = [{"op": "complete", "base": url, "prompt": p, "max_tokens": N_NEW, "stream": False, "model": "tiny_qwen3"}
            for p in PROMPTS]
    client = a.start(sys.executable, str(TESTS / "serve" / "pd_client.py"), json.dumps(jobs), log="client")
    got = [json.loads(client.wait_line("{", 120))["tokens"] for _ in jobs]
    with open_engine(TINY_QWEN3, ckpt) as eng:
        assert got == [r.tokens for r in eng.generate(PROMPTS, N_NEW)]
    assert "rank 1 joined node 0 at 192.0.2.1:29671" in b.log("torchrun1")
    a.kill_all()  # torchrun's workers are in sessions of their own: everything on node 0
    t = time.monotonic()
    assert t1.p.wait(30) != 0 and time.monotonic() - t < 15
    assert ("graphgen serve: rank 1: node 0 (the driver at 192.0.2.1:29671) was lost: its connection closed"
            in b.log("torchrun1")), b.log("torchrun1")[-2000:]


MOONCAKE_PORT = 50150
RANK_LINE = re.compile(r"mooncake pool: rank (\d)'s client at (\S+): (\d+) puts \((\d+) failed\), (\d+) of (\d+) gets "
                       r"hit, (\d+) errors")


def _rank_clients(log: str) -> dict[int, tuple]:
    """``graphgen run``'s per-rank client lines: rank -> (address, puts, failed puts, errors)."""
    return {int(m[1]): (m[2], int(m[3]), int(m[4]), int(m[7])) for m in RANK_LINE.finditer(log)}


def _store(host, port: int, log: str):
    store = host.start(sys.executable, "-m", "graphgen.runtime.pool.mooncake_server", "serve", "--host", host.addr,
                       "--port", str(port), "--segment", "32MiB", log=log)
    assert f"master={host.addr}:{port}" in store.wait_line("ready", 60)
    return f"{host.addr}:{port}"


def test_ranks_on_mooncake_across_two_nodes_each_announce_their_own_node(hosts, ckpt):
    """Ranks on Mooncake across nodes (issue 37 item 4, part 1): ``run --tp 2 --nnodes 2 --pool mooncake://...``
    with one master (and its segment) on node 0's host; every rank opens its own client with a segment of its
    own (the seed's shape: each rank's memory in the pool), so a block may live on either node and the other
    node's client writes it to the address its owner announced. Node 1's URL names its own address
    (``local_hostname``), node 0's none (filled in: node 0's address towards the master). Both ranks' clients
    put every block of their KV shards, each announcing its own node. The negative control (meanwhile, on a
    master of its own: a wrong address spoils its master's placements): a client on node 1 announcing node 0's
    address (what node 1's ranks did before, with the driver's URL) makes the puts of a client on node 0 that
    land in node 1's segment fail."""
    from support.netns import WORKER, Worker

    a, b = hosts.hosts
    master = _store(a, MOONCAKE_PORT, "mc-store")
    url = f"mooncake://{master}?segment=16MiB"
    prompts = [[(3 + 7 * i + 3 * j) % 250 + 1 for j in range(17)] for i in range(12)]  # 4 blocks each
    n0, n1 = _cluster(hosts, 29690, "--spec", TINY_QWEN3, "--weights", ckpt, "--tp", 2, prompts=prompts, n_new=2,
                      pools=(url, f"{url}&local_hostname={b.addr}"))
    other = _store(a, MOONCAKE_PORT + 1, "mc-store-control")
    workers = []
    for host, opts in ((b, {"segment_bytes": 16 << 20, "local_hostname": a.addr}), (a, {"local_hostname": a.addr})):
        w = Worker(host.argv(sys.executable, WORKER), stdin=True, log=open(f"{host.logdir}/mc-{host.name}.log", "a"))
        host.procs.append(w)
        assert w.call(op="open", master=other, opts=opts, timeout=30)["ok"]
        workers.append(w)
    control = workers[1].call(op="put", keys=[f"control@{i}" for i in range(48)], seed=1, size=4096, timeout=60)
    assert control["ok"].count(False) > 0, control  # those that landed in node 1's segment
    assert len(_tokens(n0, len(prompts))) == len(prompts)
    _both_exit_0(hosts, n0, n1, 29690)
    clients = _rank_clients(a.log("node0-29690"))
    # every rank's own client, at its own node's address; rank 1's shard put from node 1
    assert {r: c[0] for r, c in clients.items()} == {0: a.addr, 1: b.addr}, a.log("node0-29690")[-2000:]
    assert all(puts == len(prompts) * 4 and failed == errors == 0 for _, puts, failed, errors in clients.values()), \
        clients
