"""NPU rank start-up across nodes (audit 4 M2, M9, M10): the post-load barrier on a fake clock, and the
environment the launcher gives NPU ranks.  The barrier's store is a dict-backed fake with the ``add`` contract
of ``torch.distributed.Store`` (add returns the new value); no HCCL here: what CANN does with these variables
is unverified (docs/npu.md, hardware checklist)."""
from __future__ import annotations

import pytest

from graphgen.npu.run.startup import (BarrierTimeout, hccl_connect_timeout, loaded_barrier, npu_rank_env,
                                      rank_environment)


class FakeStore:
    def __init__(self):
        self.values: dict = {}

    def add(self, key, n):
        self.values[key] = self.values.get(key, 0) + n
        return self.values[key]


class FakeClock:
    """Time that passes only when a rank sleeps; ``arrivals``: {time: rank} of the other ranks' arrivals."""

    def __init__(self, store, arrivals):
        self.t, self.store, self.arrivals = 0.0, store, dict(arrivals)

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s
        for at in [a for a in self.arrivals if a <= self.t]:
            self.arrivals.pop(at)
            self.store.add("graphgen/npu/loaded", 1)  # that rank finished loading and arrived


def test_a_rank_that_finishes_loading_minutes_later_still_joins():
    """Rank 0 loads first; rank 1 (another node) arrives 7 minutes later, far past HCCL's default connect
    timeout (120 s): the barrier holds rank 0 until then, so neither enters the first conversion alone."""
    store = FakeStore()
    clock = FakeClock(store, {420.0: 1})
    beats = []
    waited = loaded_barrier(store, 2, deadline=3600, clock=clock, sleep=clock.sleep, poll=5,
                            on_wait=lambda n, w: beats.append(n))
    assert 420 <= waited < 430 and waited > 120
    assert beats and set(beats) == {1}  # told "1 of 2 arrived" while waiting


def test_a_rank_that_never_arrives_is_named_within_the_load_deadline():
    store = FakeStore()
    clock = FakeClock(store, {5000.0: 1})
    with pytest.raises(BarrierTimeout, match=r"1 of 2 ranks finished loading within 3600 s.*--rank-timeout load"):
        loaded_barrier(store, 2, deadline=3600, clock=clock, sleep=clock.sleep, poll=5)
    assert clock.t <= 3600 + 5


def test_the_last_rank_to_arrive_does_not_wait():
    store = FakeStore()
    store.add("graphgen/npu/loaded", 3)
    clock = FakeClock(store, {})
    assert loaded_barrier(store, 4, deadline=1, clock=clock, sleep=clock.sleep) == 0


@pytest.mark.parametrize("deadline, want", [(7200.0, 7200), (60, 120), (600, 600), (14400, 7200)])
def test_hccl_connect_timeout_follows_the_warmup_deadline_inside_canns_range(deadline, want):
    assert hccl_connect_timeout(deadline) == want


def test_the_rank_environment_sets_hccl_per_node_and_keeps_what_the_operator_exported():
    towards = {"10.0.0.1": ("eth7", "10.0.0.2")}
    add = rank_environment({}, warmup_deadline=7200, multi_node=True, master_addr="10.0.0.1",
                           interface=towards.__getitem__)
    assert add == {"ENABLE_DYNAMIC_SHAPE_MULTI_STREAM": "1", "HCCL_CONNECT_TIMEOUT": "7200",
                   "HCCL_SOCKET_IFNAME": "eth7", "HCCL_IF_IP": "10.0.0.2"}
    one = rank_environment({}, warmup_deadline=900, multi_node=False, master_addr="127.0.0.1",
                           interface=towards.__getitem__)
    assert one == {"ENABLE_DYNAMIC_SHAPE_MULTI_STREAM": "1", "HCCL_CONNECT_TIMEOUT": "900"}  # one node: no NIC
    mine = rank_environment({"HCCL_IF_IP": "192.168.1.5", "HCCL_CONNECT_TIMEOUT": "1800"}, warmup_deadline=7200,
                            multi_node=True, master_addr="10.0.0.1", interface=towards.__getitem__)
    assert mine == {"ENABLE_DYNAMIC_SHAPE_MULTI_STREAM": "1"}  # the operator's choice of NIC and timeout wins


def test_the_npu_target_registers_its_rank_environment_and_the_cpu_target_none():
    import graphgen.npu.run  # noqa: F401  (registers the "npu" rank target)
    from graphgen.runtime.parallel.cluster import Placement
    from graphgen.runtime.parallel.rank import RANK_TARGETS
    from graphgen.runtime.progress import Deadlines

    assert RANK_TARGETS["npu"].env is npu_rank_env and RANK_TARGETS["cpu"].env is None
    add = RANK_TARGETS["npu"].env({}, Placement.single(2), Deadlines(warmup=1800))
    assert add["HCCL_CONNECT_TIMEOUT"] == "1800" and "HCCL_IF_IP" not in add


def test_a_spawned_rank_starts_in_the_launchers_environment(tmp_path):
    """M9: a spawned interpreter starts in the launcher's child environment (`procs._started_in`), so a variable is
    there before the child's first ``import torch`` (torch_npu's autoload), not only after `_child` runs.  The
    probe's parent environment never holds it: without `_started_in` the child reads None."""
    import multiprocessing as mp

    from graphgen.runtime.parallel import procs

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    env = {"GRAPHGEN_I36_PROBE": "before-import", "PATH": "/usr/bin:/bin"}
    import os
    import sys

    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    from support.env_probe import probe  # torch-free: the child imports nothing heavy to unpickle it

    p = ctx.Process(target=probe, args=(q, "GRAPHGEN_I36_PROBE"))
    with procs._started_in(ctx, env):
        p.start()
    assert "GRAPHGEN_I36_PROBE" not in os.environ  # the launcher's own environment is restored
    p.join(60)
    assert q.get(timeout=5) == "before-import"

