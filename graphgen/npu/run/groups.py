"""HCCL process groups of a parallel layout, built the same way on every rank (docs/npu.md,
"Process groups under DP attention").

Rank order (docs/parallel.md): TP innermost, then CP, then DP: ``rank = (dp_rank * cp + cp_rank) * tp +
tp_rank``. The groups a generated module's collectives name (``PROCESS_GROUPS`` in the module):

* ``tp``: the ``tp`` consecutive ranks of one DP (and CP) group -- attention's and the dense MLPs'
  all-reduces, the LM head's vocabulary gather, the MoE's final token gather;
* ``dp``: the ranks with the same TP (and CP) rank in every DP group -- the MoE's token all-gather;
* ``ep``: every rank of the DP groups with the same CP rank (``dp * tp`` ranks; the world when ``cp = 1``)
  -- the MoE's reduce-scatter. Without DP attention EP reuses the TP ranks (``ep`` = the ``tp`` group).

``torch.distributed.new_group`` is collective: every rank must create every group, in the same order,
even the groups it is not in. `build_process_groups` does so (kinds in ``GROUP_KINDS`` order, groups in
`layout_groups` order) and keeps the ones holding this rank; a group spanning the whole world is the
world group itself. `bind_process_groups` writes their names into a loaded module before its first call.
"""
from __future__ import annotations

GROUP_KINDS = ("tp", "dp", "ep")


def layout_groups(tp: int, dp: int = 1, cp: int = 1) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Every group of each kind as ascending rank tuples (so a collective's shards are in rank order)."""
    def rank(d, c, t):
        return (d * cp + c) * tp + t

    groups = {
        "tp": tuple(tuple(rank(d, c, t) for t in range(tp)) for d in range(dp) for c in range(cp)),
        "dp": tuple(tuple(rank(d, c, t) for d in range(dp)) for c in range(cp) for t in range(tp)),
    }
    groups["ep"] = (tuple(tuple(sorted(rank(d, c, t) for d in range(dp) for t in range(tp))) for c in range(cp))
                    if dp > 1 else groups["tp"])
    return groups


def rank_groups(rank: int, tp: int, dp: int = 1, cp: int = 1) -> dict[str, tuple[int, ...]]:
    """The group of each kind that holds ``rank``."""
    if not 0 <= rank < tp * dp * cp:
        raise ValueError(f"rank {rank} outside a world of dp={dp} x cp={cp} x tp={tp}")
    return {kind: next(g for g in groups if rank in g) for kind, groups in layout_groups(tp, dp, cp).items()}


def build_process_groups(rank: int, tp: int, dp: int = 1, cp: int = 1) -> dict:
    """This rank's ``torch.distributed`` group of each kind, creating every group of the layout on every
    rank in one order (call it on every rank, after ``init_process_group``, before compiling)."""
    import torch.distributed as dist

    world = tp * dp * cp
    if dist.get_world_size() != world:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks; the layout dp={dp} x cp={cp} "
                         f"x tp={tp} needs {world}")
    mine, made = {}, {}
    for kind, groups in layout_groups(tp, dp, cp).items():
        for ranks in groups:
            if ranks not in made:
                made[ranks] = dist.group.WORLD if len(ranks) == world else dist.new_group(list(ranks))
            if rank in ranks:
                mine[kind] = made[ranks]
    return mine


def bind_process_groups(module, groups: dict) -> None:
    """Fill ``module.PROCESS_GROUPS`` (the groups its collectives name) with the HCCL group names of
    ``groups`` (from `build_process_groups`); a module without the dict needs only the world group."""
    needed = getattr(module, "PROCESS_GROUPS", None)
    if needed is None:
        return
    missing = sorted(set(needed) - set(groups))
    if missing:
        raise ValueError(f"{module.__name__}: no process group for {', '.join(missing)}")
    for kind in needed:
        needed[kind] = groups[kind].group_name
