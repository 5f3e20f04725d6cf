"""The torch-light parts of DP attention (graphgen/runtime/parallel/data_parallel.py), no processes: each
rank's expert slice by its EP index (not its TP rank), and the DP-aware choice of rank (prefix affinity,
bounded imbalance). The ranks themselves: tests/parallel/test_data_parallel.py."""

from __future__ import annotations

import random

import torch

from graphgen.modelspec.model import Parallel
from graphgen.runtime.parallel.data_parallel import DPRouter, prefix_affinity_key
from graphgen.runtime.parallel.dp_rank import DPLayout, dp_rank_weights
from graphgen.runtime.parallel.ops import rank_weights


def test_expert_weights_are_sliced_by_the_ep_index_under_dp():
    full = {"experts": torch.arange(8.0)[:, None].expand(8, 3).contiguous(), "router": torch.ones(2, 2)}
    names = ["experts[d0/2]", "router"]
    for rank in (0, 1):
        mine = dp_rank_weights(full, names, DPLayout.of(Parallel(dp=2, ep=2), rank))
        assert mine["experts[d0/2]"][:, 0].tolist() == [4.0 * rank + i for i in range(4)]
        assert torch.equal(mine["router"], full["router"])
    # the TP-rank slicing (rank r of tp=1 holds chunk r*parts//tp) is out of range for DP rank 1:
    # why DP needs its own (the pre-DP bug this guards)
    wrong = rank_weights(full, names, 1, 1)["experts[d0/2]"]
    assert wrong.abs().sum() == 0  # a zero-padded chunk past the end, not rank 1's experts


def test_layout_numbers_ranks_dp_major():
    lay = [DPLayout.of(Parallel(dp=2, tp=2, ep=4), r) for r in range(4)]
    assert [(x.dp_rank, x.tp_rank, x.ep_rank) for x in lay] == [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]
    # cp inside DP groups (issue 38): a group's CP ranks are one DP rank and hold the same experts (ep = dp x tp)
    cp = [DPLayout.of(Parallel(dp=2, cp=2, ep=2), r) for r in range(4)]
    assert [(x.dp_rank, x.tp_rank, x.ep_rank) for x in cp] == [(0, 0, 0), (0, 0, 0), (1, 0, 1), (1, 0, 1)]


def test_router_keeps_a_prefix_on_one_rank_and_bounds_the_imbalance():
    router = DPRouter(2, block_size=4, max_imbalance=2)
    rng = random.Random(0)
    heads = [[rng.randrange(256) for _ in range(16)] for _ in range(20)]
    # prompts sharing their first 4 blocks go to one rank, whatever follows
    for h in heads[:5]:
        assert len({router.choose(h + [rng.randrange(256) for _ in range(rng.randrange(9))]) for _ in range(4)}) == 1
    assert prefix_affinity_key([1, 2, 3], 4) == "1,2,3" and prefix_affinity_key([1, 2, 3, 4, 5], 4) == "1,2,3,4"
    picks = [router.choose(h) for h in heads]
    assert set(picks) == {0, 1}  # different prefixes spread over both ranks
    r = picks[0]
    router.begin(r)
    assert router.choose(heads[0]) == r  # one more in flight: affinity still wins
    router.begin(r)
    assert router.choose(heads[0]) == 1 - r  # two more: the least-loaded rank takes it
    router.end(r)
    assert router.choose(heads[0]) == r
