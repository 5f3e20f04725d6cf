"""Every rank issues the same collectives in the same order: recorded, not assumed.

Each rank process wraps its ``torch.distributed`` collectives (``all_reduce``, ``all_gather``,
``barrier``: the forward's through `CollectiveRuntime`, the connector's hit agreement and drain barrier)
to log ``(op, shape, dtype)`` as it issues them, through a probe run in every rank
(`DistributedEngine.on_ranks`); after a tp=2 run covering prefill, a pool hit (splitfuse) and
decode, the logs must be equal across ranks and non-empty.

Negative control: rank 1 skips one all_reduce of its forward (its ``rt.all_reduce`` replaced, in that
rank only, by one that returns its input for the N-th call). The ranks' collectives then no longer
pair up: a rank waits in a collective its peer never issues, gloo's timeout ends it, and the run
fails with `RankFailure` naming the rank and the timeout -- what the real engine does (the comparison
above is never reached: the mismatch cannot get past the collectives themselves). The engine starts
with the usual timeout; the process group's is then cut to ``GLOO_TIMEOUT`` seconds in the ranks, so
the control waits seconds, not the engine's timeout.
"""
from __future__ import annotations

import pytest

from graphgen.runtime import open_engine
from graphgen.runtime.parallel.launcher import RankFailure
from support.paths import REPO

SPEC = REPO / "specs/tiny_qwen3_tp2.yaml"
TIMEOUT = 60
GLOO_TIMEOUT = 2    # the negative control's collective timeout (the ranks' collectives of a 10-token
                    # prefill pair up within milliseconds of each other)
PROMPT = list(range(1, 11))   # two full blocks of 4 + 2 tokens


# ---- probes, run in each rank process ----------------------------------------------------------

def _install_collective_log(eng) -> None:
    import torch.distributed as dist

    log = eng._collective_log = []
    eng._collective_originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "barrier")}

    def wrap(name, orig):
        def issued(*args, **kwargs):
            t = args[1] if name == "all_gather" else (args[0] if args else None)
            log.append((name, tuple(t.shape), str(t.dtype)) if t is not None else (name,))
            return orig(*args, **kwargs)
        return issued

    for name in ("all_reduce", "all_gather", "barrier"):   # rank_kv.py, features.py and CollectiveRuntime call dist.<name>
        setattr(dist, name, wrap(name, getattr(dist, name)))


def _collective_log(eng) -> list:
    return list(eng._collective_log)


def _remove_collective_log(eng) -> None:
    """The rank's collectives as they were (a shared engine is left as found)."""
    import torch.distributed as dist

    for name, orig in eng.__dict__.pop("_collective_originals").items():
        setattr(dist, name, orig)
    del eng._collective_log


def _gloo_timeout(eng, seconds: float) -> None:
    """This rank's process group times a collective out after ``seconds`` (torch's private
    ``_set_pg_timeout``: the public API fixes it when the group is made)."""
    import datetime

    import torch.distributed as dist

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))


def _skip_one_all_reduce(eng, n: int) -> None:
    """On rank 1 only: its ``n``-th forward all_reduce returns its input (a rank that skips one)."""
    if eng.runner.rt.rank != 1:
        return
    rt, orig = eng.runner.rt, eng.runner.rt.all_reduce
    calls = [0]

    def all_reduce(x, **kw):
        calls[0] += 1
        return x.contiguous().clone() if calls[0] == n else orig(x, **kw)

    rt.all_reduce = all_reduce


# ---- the tests ---------------------------------------------------------------------------------

def _run(eng):
    eng.generate([PROMPT], 3)
    eng.drain()
    eng.generate([PROMPT], 2)   # every full block in the pool: hit agreed by all_reduce MIN, splitfuse
    eng.drain()


@pytest.mark.parametrize("spec", ["specs/tiny_qwen3_tp2.yaml", "specs/tiny_qwen3_tp2_sp.yaml"], ids=["tp2", "tp2_sp"])
def test_every_rank_issues_the_same_collectives_in_the_same_order(qwen_tp2, spec):
    """tp2_sp: sequence parallel, whose token shards differ in length across ranks at odd step sizes
    (decode: 1 token): the gathers are padded, so every rank issues the same shapes. On the session's
    shared engine (tests/parallel/conftest.py): the log is installed and removed around this test's run."""
    eng = qwen_tp2(spec)
    eng.on_ranks(_install_collective_log)
    try:
        _run(eng)
        logs = eng.on_ranks(_collective_log)
    finally:
        eng.on_ranks(_remove_collective_log)
    assert len(logs) == 2 and logs[0], "no collective recorded"
    ops = {e[0] for e in logs[0]}
    assert {"all_reduce", "all_gather", "barrier"} <= ops, ops
    assert logs[1] == logs[0], next(((i, a, b) for i, (a, b) in enumerate(zip(*logs)) if a != b),
                                    (len(logs[0]), len(logs[1])))


def test_a_rank_that_skips_one_all_reduce_is_caught(qwen):
    # a private engine: the control breaks it
    eng = open_engine(SPEC, qwen.dir, num_blocks=32, timeout=TIMEOUT)   # started: not the failure
    eng.on_ranks(_install_collective_log)
    eng.on_ranks(_gloo_timeout, GLOO_TIMEOUT)
    eng.on_ranks(_skip_one_all_reduce, 2)
    try:
        # a rank waits in a collective its peer never issues: gloo's (now short) timeout ends it
        with pytest.raises(RankFailure, match=r"rank \d failed during generate") as failed:
            _run(eng)
    finally:
        eng.close()
    # gloo's own message, at the short timeout: the collectives did not pair up (not a slow start)
    assert f"Timed out waiting {GLOO_TIMEOUT * 1000}ms" in str(failed.value), str(failed.value)[-2000:]
