"""The `SaveReport` is load-bearing (issue 42 item 6): the scheduler takes every step's report into its
`SaveLedger` and counts a row's blocks as saved only where the runner says it pinned them; over ranks the
reports aggregate per pool-key shard (`RanksSaveReport`). One process, no ranks (the ranks' aggregate
end to end: tests/parallel/test_parallel_ranks.py)."""
from __future__ import annotations

import dataclasses

from graphgen.runtime import open_engine
from graphgen.runtime.engine.step_output import RanksSaveReport, SaveLedger, SaveReport
from support.hf import rand_prompt
from support.paths import REPO

import torch


def _run(ckpt, drop: bool):
    """A prompt with decode-time saves; ``drop``: the runner's reports lose their pins (negative control)."""
    from graphgen.modelspec.loader import load_spec

    spec = load_spec(REPO / "specs/tiny_qwen3.yaml")
    spec = dataclasses.replace(spec, pool=dataclasses.replace(spec.pool, write="sync", save_decode=True))
    with open_engine(spec, ckpt, num_blocks=16) as e:
        if drop:
            runner, collect = e.runner, e.runner.collect
            runner.collect = lambda fut: dataclasses.replace(collect(fut), saves=SaveReport())
        r = e.generate([rand_prompt(torch.Generator().manual_seed(5), 9)], 6)[0]
        assert e.save_report().shards == {(0, 1): e.scheduler.saves}  # one rank: the interface's shape
        return r, e.scheduler.saves, e.stats["puts"]


def test_the_scheduler_counts_what_the_report_says_was_pinned(qwen):
    r, ledger, puts = _run(qwen.dir, drop=False)
    assert ledger.pinned == r.saved_blocks == puts == 3 and ledger.steps >= 6  # 2 prompt blocks + 1 decode-filled
    dropped, none, puts = _run(qwen.dir, drop=True)
    assert puts == 3 and none.pinned == 0 and dropped.saved_blocks == 2  # the decode-time save is unreported


def test_reports_aggregate_per_shard_only_from_the_ranks_that_put():
    a, b, c = SaveLedger(2, 5, 4, 1), SaveLedger(2, 5, 5, 0), SaveLedger(1, 3, 3, 0)
    rep = RanksSaveReport.aggregate([(a, (0, 2), True), (b, (0, 2), False), (c, (1, 2), True)])
    assert rep.shards == {(0, 2): a, (1, 2): c} and rep.ranks == (a, b, c)
    assert rep.pinned == 8 and rep.in_flight == 1
    dp = RanksSaveReport.aggregate([(a, (0, 1), True), (c, (0, 1), True)])  # DP ranks: one key space, summed
    assert dp.shards[(0, 1)] == SaveLedger(3, 8, 7, 1)
