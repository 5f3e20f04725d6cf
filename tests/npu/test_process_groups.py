"""Process groups under DP attention (graphgen/npu/run/groups.py): which ranks form the TP, DP and EP
groups, that the MoE's collective sequence over them (dp all-gather, ep reduce-scatter, tp all-gather)
hands every rank back its own DP group's tokens, and that a loaded module gets their names.  Plain
tensors stand in for the collectives (their documented rank-major semantics): no HCCL, no NPU."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphgen.npu.run.groups import bind_process_groups, build_process_groups, layout_groups, rank_groups

ROOT = Path(__file__).resolve().parents[2]


def test_dp_ep_layout_groups_partition_the_ranks_in_rank_order():
    groups = layout_groups(tp=2, dp=16)
    assert rank_groups(5, tp=2, dp=16) == {"tp": (4, 5), "cp": (5,), "dp": tuple(range(1, 32, 2)),
                                           "ep": tuple(range(32))}
    for kind, gs in groups.items():
        flat = sorted(r for g in gs for r in g)
        assert flat == list(range(32)), kind  # each rank in exactly one group of each kind
        assert all(list(g) == sorted(g) for g in gs)
    assert layout_groups(tp=4)["ep"] == layout_groups(tp=4)["tp"] == ((0, 1, 2, 3),)  # EP reuses TP without DP
    with pytest.raises(ValueError, match="outside a world"):
        rank_groups(32, tp=2, dp=16)


def _moe_collectives(tokens, groups, world, tp):
    """Each rank's result of the MoE's collectives (shard pass, DP attention + EP) on the given groups:
    every rank's partial is its rank-weighted copy of the gathered tokens ((r+1) * x), so the sum says
    which rank contributed."""
    owner = {r: g for g in groups["dp"] for r in g}
    gathered = {r: torch.cat([tokens[q // tp] for q in owner[r]]) for r in range(world)}  # dp all_gather
    total = sum((r + 1) * gathered[r] for r in range(world))                                 # ep reduce-scatter: sum
    chunk = total.shape[0] // world
    shard = {r: total[r * chunk:(r + 1) * chunk] for r in range(world)}                      # ... rank r's rows
    tp_of = {r: g for g in groups["tp"] for r in g}
    return {r: torch.cat([shard[q] for q in tp_of[r]]) for r in range(world)}              # tp all_gather


def test_moe_collectives_over_the_groups_return_each_dp_groups_own_tokens():
    tp, dp = 2, 4
    world = tp * dp
    tokens = [torch.randn(6, 3) for _ in range(dp)]  # each DP group's step, 6 tokens (a multiple of tp)
    weight = sum(r + 1 for r in range(world))
    out = _moe_collectives(tokens, layout_groups(tp=tp, dp=dp), world, tp)
    for r in range(world):
        torch.testing.assert_close(out[r], weight * tokens[r // tp])
    # negative control: DP groups listed out of rank order gather the groups' tokens in the wrong order
    bad = dict(layout_groups(tp=tp, dp=dp))
    bad["dp"] = tuple(tuple(reversed(g)) for g in bad["dp"])
    wrong = _moe_collectives(tokens, bad, world, tp)
    assert not torch.allclose(wrong[0], weight * tokens[0])


def test_build_and_bind_the_dp_ep_modules_groups(fake_world):
    import torch.distributed as dist

    from graphgen.npu.run.compile import load_module
    from graphgen.npu.standin import fakes as standin

    fake_world(32)
    groups = build_process_groups(0, tp=2, dp=16)
    assert {k: dist.get_world_size(g) for k, g in groups.items()} == {"tp": 2, "dp": 16, "ep": 32}
    assert groups["ep"] is dist.group.WORLD
    standin.install()
    try:
        with standin.fresh_tags():
            mod = load_module(ROOT / "generated/deepseek_v3_1_dp_ep/npu/max_autotune/decode.py")
    finally:
        standin.uninstall()
    assert mod.PROCESS_GROUPS == {"dp": None, "tp": None}  # the world group (ep) needs no name
    bind_process_groups(mod, groups)
    assert mod.PROCESS_GROUPS == {"dp": groups["dp"].group_name, "tp": groups["tp"].group_name}
    with pytest.raises(ValueError, match="no process group for dp"):
        bind_process_groups(mod, {"tp": groups["tp"]})
    with pytest.raises(ValueError, match="needs 64"):
        build_process_groups(0, tp=2, dp=32)
