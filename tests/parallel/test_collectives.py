"""`graphgen.runtime.parallel.collectives.CollectiveRuntime` in one process, on torch's fake process group
(its collectives move nothing): what it refuses (a module of another layout, a group no layout has, a split
of the wrong size) and how a token reduce-scatter cuts the step's rows. The numerics over real ranks:
tests/parallel/test_parallel_ranks.py, test_context_parallel.py, test_data_parallel.py."""
from __future__ import annotations

import pytest
import torch

from graphgen.runtime.core.faults import Faults
from graphgen.runtime.parallel.collectives import CollectiveRuntime
from graphgen.runtime.parallel.layout import RankLayout


def _rt(layout: RankLayout) -> CollectiveRuntime:
    return CollectiveRuntime(Faults(), groups=layout.process_groups(0))


def test_a_collective_of_another_layout_or_group_is_refused(fake_world):
    fake_world(2)
    rt = _rt(RankLayout(tp=2))
    x = torch.ones(3, 4)
    assert rt.all_reduce(x, group="tp", size=2, reduce="sum").shape == (3, 4)
    with pytest.raises(RuntimeError, match="4-rank 'tp' graph on a 2-rank 'tp' group"):
        rt.all_reduce(x, group="tp", size=4, reduce="sum")
    with pytest.raises(RuntimeError, match="'pp': not a group of a rank layout"):
        rt.all_reduce(x, group="pp", size=2, reduce="sum")
    rt.close()


def test_sequence_parallel_cuts_ceil_rows_and_a_given_split_must_fit_the_group(fake_world):
    fake_world(2)
    rt = _rt(RankLayout(tp=2))
    x = torch.arange(5.0)[:, None]
    mine = rt.reduce_scatter(x, group="tp", size=2, reduce="sum", dim=0)  # rank 0 of 5 rows: ceil(5/2) = 3
    assert mine.flatten().tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="split gives this rank 3"):  # the gather checks this rank's rows
        rt.all_gather(torch.zeros(2, 1), group="tp", size=2, dim=0, length=None)
    rt.set_rows("tp", (1, 1, 1))
    with pytest.raises(RuntimeError, match="has 3 counts, the group 2 ranks"):
        rt.all_gather(torch.zeros(1, 1), group="tp", size=2, dim=0, length=None)
    rt.close()
