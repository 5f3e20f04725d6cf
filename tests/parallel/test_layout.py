"""`graphgen.runtime.parallel.layout.RankLayout`: each rank's coordinates and the one table of named
groups every rank (CPU gloo, NPU stand-in and HCCL) builds its process groups from. No processes:
the groups are checked as rank tuples, and built on torch's fake process group."""
from __future__ import annotations

import itertools

import pytest

from graphgen.runtime.parallel.layout import GROUP_KINDS, RankLayout

LAYOUTS = [RankLayout(), RankLayout(tp=2), RankLayout(cp=2), RankLayout(cp=2, tp=2), RankLayout(dp=2),
           RankLayout(dp=2, tp=2), RankLayout(dp=3, cp=2, tp=2)]


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda l: f"dp{l.dp}cp{l.cp}tp{l.tp}")
def test_every_kind_partitions_the_world_in_rank_order_and_coords_invert_the_rank(lay):
    groups = lay.groups()
    assert set(groups) == set(GROUP_KINDS)
    for kind, gs in groups.items():
        assert sorted(r for g in gs for r in g) == list(range(lay.world)), kind  # each rank once per kind
        assert all(list(g) == sorted(g) and len(g) == lay.size(kind) for g in gs), kind
    for d, c, t in itertools.product(range(lay.dp), range(lay.cp), range(lay.tp)):
        co = lay.coords(lay.rank_of(d, c, t))
        assert (co.dp_rank, co.cp_rank, co.tp_rank) == (d, c, t)
        mine = lay.rank_groups(co.rank)
        # a rank's index in its group is its coordinate of that kind (the shard order of a collective)
        assert mine["tp"].index(co.rank) == t and mine["cp"].index(co.rank) == c and mine["dp"].index(co.rank) == d
        assert mine["ep"].index(co.rank) == co.ep_rank


def test_the_groups_of_the_documented_layouts():
    lay = RankLayout(dp=16, tp=2)
    assert lay.rank_groups(5) == {"tp": (4, 5), "cp": (5,), "dp": tuple(range(1, 32, 2)), "ep": tuple(range(32))}
    assert lay.ep == 32 and lay.coords(5).ep_rank == 5
    assert RankLayout(tp=4).groups()["ep"] == RankLayout(tp=4).groups()["tp"] == ((0, 1, 2, 3),)  # EP reuses TP
    cp = RankLayout(cp=2, tp=2)  # rank = cp_rank * tp + tp_rank
    assert cp.rank_groups(3) == {"tp": (2, 3), "cp": (1, 3), "dp": (3,), "ep": (2, 3)}
    # negative control: a CP-major order (rank = tp_rank * cp + cp_rank) is not the layout's
    assert cp.rank_groups(1)["tp"] != (0, 2) and cp.coords(1).tp_rank == 1


def test_bad_layouts_and_kinds_are_refused_in_one_sentence():
    with pytest.raises(ValueError, match="outside a world of dp=2 x cp=1 x tp=2"):
        RankLayout(dp=2, tp=2).coords(4)
    with pytest.raises(ValueError, match="must be an int >= 1"):
        RankLayout(tp=0)
    with pytest.raises(ValueError, match="no process group 'pp'"):
        RankLayout(tp=2).size("pp")


def test_process_groups_make_each_group_once_world_for_the_world_none_for_one_rank(fake_world):
    import torch.distributed as dist

    fake_world(8)
    groups = RankLayout(dp=2, cp=2, tp=2).process_groups(0)
    assert {k: dist.get_world_size(h) for k, h in groups.handles.items()} == {"tp": 2, "cp": 2, "dp": 2, "ep": 4}
    assert groups.coords.rank == 0 and groups["tp"] is not dist.group.WORLD
    dist.destroy_process_group()
    fake_world(2)
    tp2 = RankLayout(tp=2).process_groups(1)
    assert tp2["tp"] is dist.group.WORLD and tp2["ep"] is dist.group.WORLD and tp2["cp"] is None
    with pytest.raises(ValueError, match="needs 4"):
        RankLayout(tp=4).process_groups(0)


def test_a_streamed_rank_holds_its_ep_index_experts_at_cp_inside_dp():
    """dp 2 × cp 2 × tp 2 (ep 4): the CP ranks of one DP and TP rank hold the same experts; a streamed
    checkpoint's slice index is the EP index ``dp_rank × tp + tp_rank`` (the world rank only at cp = 1), its TP
    chunk the TP rank."""
    from types import SimpleNamespace

    from graphgen.runtime.checkpoint.plan import RankSlicing

    par = SimpleNamespace(dp=2, cp=2, tp=2, ep=4)
    got = [(s.tp_rank, s.ep_rank) for s in (RankSlicing.of(par, r) for r in range(8))]
    assert got == [(0, 0), (1, 1), (0, 0), (1, 1), (0, 2), (1, 3), (0, 2), (1, 3)]
    one = SimpleNamespace(dp=2, cp=1, tp=2, ep=4)
    assert [RankSlicing.of(one, r).ep_rank for r in range(4)] == [0, 1, 2, 3]   # cp 1: the world rank
    for dp, cp, tp in itertools.product((1, 2, 3), (1, 2), (1, 2, 4)):   # the layout's coordinates, one rank order
        lay, ep = RankLayout(dp, cp, tp), (dp * tp if dp > 1 else tp)
        for r in range(lay.world):
            s, c = RankSlicing.of(SimpleNamespace(dp=dp, cp=cp, tp=tp, ep=ep), r), lay.coords(r)
            assert (s.tp_rank, s.ep_rank) == (c.tp_rank, c.ep_rank), (dp, cp, tp, r)
