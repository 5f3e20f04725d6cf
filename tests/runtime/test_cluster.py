"""Where ranks run across nodes (`graphgen.runtime.parallel.cluster.Placement`), without processes: the
``--nnodes`` flags and torchrun's environment (its variable names and meaning: torch/distributed/run.py
sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT), and what the
CLI refuses in one sentence before anything starts. The processes themselves: tests/parallel/test_nodes.py."""
from __future__ import annotations

import pytest

from graphgen.runtime.parallel.cluster import Placement, cluster_key, interface_towards
from support.inproc import cli_inproc
from support.paths import TINY_QWEN3


def test_flags_place_node_major_ranks_and_name_the_ports():
    here = Placement.of(8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500, environ={})
    assert here.ranks == (4, 5, 6, 7) and here.local_world == 4 and not here.driver and here.multi_node
    assert [here.device_index(r) for r in here.ranks] == [0, 1, 2, 3]
    assert (here.store_port, here.channel_port, here.pool_port) == (29500, 29501, 29502)
    node0 = Placement.of(8, nnodes=2, node_rank=0, master_addr="10.0.0.1", environ={})
    assert node0.driver and node0.members() == {1: (4, 5, 6, 7)} and node0.describe(1) == "node 1 (ranks 4-7)"
    one = Placement.of(4, environ={})
    assert one.ranks == (0, 1, 2, 3) and one.driver and not one.multi_node


TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}


def test_torchrun_environment_places_one_rank_per_process():
    here = Placement.of(4, environ=TORCHRUN)
    assert (here.ranks, here.local_rank, here.node_rank, here.nnodes, here.torchrun) == ((3,), 1, 1, 2, True)
    assert here.device_index(3) == 1 and not here.driver and here.master_port == 29400
    driver = Placement.of(4, environ={**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"})
    assert driver.driver and driver.members() == {1: (1,), 2: (2,), 3: (3,)} and driver.describe(2) == "rank 2"


@pytest.mark.parametrize("world, kw, env, message", [
    (4, {"nnodes": 3}, {}, "--nnodes 3 does not divide"),
    (4, {"nnodes": 2, "node_rank": 2}, {}, "--node-rank must be in [0, 2)"),
    (4, {"nnodes": 0}, {}, "--nnodes must be >= 1"),
    (4, {"nnodes": 2, "master_addr": "node0.local"}, {}, "an IPv4 address of node 0"),
    (4, {"nnodes": 2, "master_port": 65535}, {}, "must be in [1, 65533]"),
    (8, {}, TORCHRUN, "torchrun started 4 processes (WORLD_SIZE) but the layout has 8 ranks"),
    (4, {"nnodes": 2}, TORCHRUN, "are torchrun's when torchrun launched this process"),
])
def test_placements_that_cannot_be_are_one_sentence(world, kw, env, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Placement.of(world, environ=env, **kw)


def test_cluster_key_is_the_shared_secret_else_derived_from_the_master():
    here = Placement.of(4, nnodes=2, master_addr="10.0.0.1", environ={})
    assert cluster_key(here, {"GRAPHGEN_CLUSTER_KEY": "s3"}) != cluster_key(here, {})
    assert cluster_key(here, {}) == cluster_key(Placement.of(4, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                                                             environ={}), {})  # every node derives the same


def test_the_interface_towards_loopback_is_lo():
    assert interface_towards("127.0.0.1") == ("lo", "127.0.0.1")


def test_every_node_names_the_one_pool_and_announces_its_own_address():
    """Ranks on Mooncake across nodes (issue 37 item 4): node 0 admits a follower only on its pool (the same
    master and options; each node's own ``local_hostname``/``device`` may differ), and a URL without a
    ``local_hostname`` gets the node's own address towards the master (Mooncake's default, 127.0.0.1, is
    no address another node reaches); a single node's URL is left as given."""
    from graphgen.runtime.parallel.cluster import node_pool_url, pool_difference

    url = "mooncake://10.0.3.1:50051?protocol=tcp&buffer=32MiB"
    assert pool_difference(url, url + "&local_hostname=10.0.1.2") is None
    assert pool_difference("host", "host") is None
    assert "node 0 has --pool host, this node --pool mooncake://" in pool_difference("host", url)
    assert "master is 10.0.3.1:50051, this node's 10.0.3.1:50052" in pool_difference(
        url, "mooncake://10.0.3.1:50052?protocol=tcp&buffer=32MiB")
    assert "option buffer_bytes is 16777216, node 0's 33554432" in pool_difference(
        url, "mooncake://10.0.3.1:50051?protocol=tcp&buffer=16MiB")
    assert "unknown mooncake pool option 'bogus'" in pool_difference(url, url + "&bogus=1")
    two = Placement.of(4, nnodes=2, master_addr="127.0.0.1", environ={})
    assert node_pool_url(url, two) == url + "&local_hostname=127.0.0.1"  # the interface towards the master's
    assert node_pool_url(url + "&local_hostname=10.0.1.2", two) == url + "&local_hostname=10.0.1.2"
    assert node_pool_url(url, Placement.of(4, environ={})) == url and node_pool_url("host", two) == "host"


def test_the_driver_refuses_a_follower_on_another_pool():
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.parallel.bringup import _check_hello
    from graphgen.runtime.parallel.cluster import spec_digest

    spec = load_spec(TINY_QWEN3).with_overrides(tp=4)
    here = Placement.of(4, nnodes=2, master_addr="10.0.0.1", environ={})
    url = "mooncake://10.0.0.1:50051"
    hello = {"member": 1, "ranks": (2, 3), "spec": spec_digest(spec), "spec_name": spec.name,
             "pool": url + "?local_hostname=10.0.0.2"}
    assert _check_hello(hello, here, spec, here.members(), url) is None
    why = _check_hello(hello, here, spec, here.members(), "host")
    assert why.startswith("node 1 (ranks 2-3) is on another pool than node 0: node 0 has --pool host"), why


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "3"], "--nnodes 3 does not divide"),
    (["--nnodes", "2", "--master-addr", "localhost"], "an IPv4 address of node 0"),
])
def test_run_refuses_a_placement_in_one_sentence(flags, message, tmp_path):
    res = cli_inproc("run", "--spec", TINY_QWEN3, "--weights", tmp_path, "--tp", "4", "--prompt-ids", "1",
                     *flags, timeout=60)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_serve_refuses_a_placement_in_one_sentence(tmp_path):
    res = cli_inproc("serve", "--spec", TINY_QWEN3, "--weights", tmp_path, "--tp", "4", "--nnodes", "3",
                     "--port", "0", timeout=60)
    assert res.returncode == 2 and "--nnodes 3 does not divide" in res.stderr and "Traceback" not in res.stderr


def test_a_node_lost_between_commands_ends_the_engine_and_tells_on_failure():
    """`DistributedEngine._node_lost`'s rule, on the state it reads (no processes; the real loss of a node:
    tests/parallel/test_nodes.py): while a command waits on the ranks its `_collect` reports the loss, so
    nothing happens here; between commands the engine ends at once and ``on_failure`` hears the sentence,
    which the next command raises; a follower leaving after ``close`` began is no failure."""
    import threading
    from types import SimpleNamespace

    from graphgen.runtime import RankFailure
    from graphgen.runtime.parallel.launcher import DistributedEngine

    eng = object.__new__(DistributedEngine)
    killed, told = [], []
    eng._closing, eng._closed, eng._failure, eng._busy = False, False, None, threading.Lock()
    eng._kill = lambda why=None: (killed.append(why), setattr(eng, "_closed", True))
    eng.on_failure = told.append
    link = SimpleNamespace(lost="node 1 (ranks 2-3) was lost: its connection to the driver closed")
    with eng._busy:  # a command is waiting
        eng._node_lost(link)
    assert killed == told == []
    eng._closing = True
    eng._node_lost(link)
    assert killed == told == []
    eng._closing = False
    eng._node_lost(link)
    assert killed == told == [f"{link.lost} (between commands)"]
    with pytest.raises(RankFailure, match=r"was lost: its connection to the driver closed \(between commands\)"):
        eng._command("core")


def test_a_node_lost_during_an_idle_poll_is_between_commands_and_during_a_step_is_not():
    """Issue 43 item 5: ``graphgen serve``'s loop polls ``has_work`` and ``stats`` all the time, so a node lost
    while the server is idle is mostly noticed inside a poll; its sentence says ``(between commands)``, as
    `_node_lost`'s does (above), and a loss during a step says ``during step`` (once: ``core`` named nothing).
    The engine's state as `_collect` reads it, one follower's rank whose link is lost (no processes)."""
    import io
    import threading
    import time
    from types import SimpleNamespace

    from graphgen.runtime import Deadlines, RankFailure
    from graphgen.runtime.parallel.launcher import DistributedCore, DistributedEngine
    from graphgen.runtime.progress import Board, RankPhases

    lost = "node 1 (ranks 2-3) was lost: its connection to the driver closed"

    def engine():
        eng = object.__new__(DistributedEngine)
        eng._closing, eng._closed, eng._failure, eng._busy = False, False, None, threading.Lock()
        eng._channel, eng.world, eng._clock, eng.on_failure = None, 1, time.monotonic, None
        eng._phases, eng._board = RankPhases(1, Deadlines(), 10.0), Board(1, io.StringIO())
        eng._ends = [SimpleNamespace(rank=0, send=lambda msg: None, recv=lambda: None, failure=lambda since: lost)]
        eng._kill = lambda why=None: setattr(eng, "_closed", True)
        return eng

    for call, words in (("has_work", "(between commands)"), ("stats", "(between commands)"), ("step", "during step")):
        core = DistributedCore(engine())
        with pytest.raises(RankFailure) as e:
            getattr(core, call)()
        assert str(e.value) == f"{lost} {words}", call
