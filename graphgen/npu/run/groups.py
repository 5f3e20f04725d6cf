"""HCCL process groups of a parallel layout, built the same way on every rank (docs/npu.md,
"Process groups under DP attention"): the NPU's view of `graphgen.runtime.parallel.layout.RankLayout`,
which holds the formula and builds the groups for every target.

Rank order (docs/parallel.md): TP innermost, then CP, then DP: ``rank = (dp_rank * cp + cp_rank) * tp +
tp_rank``. The groups a generated module's collectives name (``PROCESS_GROUPS`` in the module):

* ``tp``: the ``tp`` consecutive ranks of one DP (and CP) group -- attention's and the dense MLPs'
  all-reduces, the LM head's vocabulary gather, the MoE's final token gather;
* ``cp``: the ranks with the same TP (and DP) rank in every CP group -- context parallel's per-layer KV gather;
* ``dp``: the ranks with the same TP (and CP) rank in every DP group -- the MoE's token all-gather;
* ``ep``: every rank of the DP groups with the same CP rank (``dp * tp`` ranks; the world when ``cp = 1``)
  -- the MoE's reduce-scatter. Without DP attention EP reuses the TP ranks (``ep`` = the ``tp`` group).

``torch.distributed.new_group`` is collective: every rank must create every group, in the same order,
even the groups it is not in. `RankLayout.process_groups` does so (kinds in its order, groups in
`RankLayout.groups` order) and keeps the ones holding this rank; a group spanning the whole world is the
world group itself, a group of one rank none. `bind_process_groups` writes their names into a loaded module before its first call.
"""
from __future__ import annotations

from ...runtime import RankLayout

GROUP_KINDS = ("tp", "cp", "dp", "ep")  # the kinds an NPU module may name


def layout_groups(tp: int, dp: int = 1, cp: int = 1) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Every group of each NPU kind as ascending rank tuples (`RankLayout.groups`, the one formula)."""
    groups = RankLayout(dp=dp, cp=cp, tp=tp).groups()
    return {kind: groups[kind] for kind in GROUP_KINDS}


def rank_groups(rank: int, tp: int, dp: int = 1, cp: int = 1) -> dict[str, tuple[int, ...]]:
    """The group of each NPU kind that holds ``rank``."""
    groups = RankLayout(dp=dp, cp=cp, tp=tp).rank_groups(rank)
    return {kind: groups[kind] for kind in GROUP_KINDS}


def build_process_groups(rank: int, tp: int, dp: int = 1, cp: int = 1) -> dict:
    """This rank's ``torch.distributed`` group of each NPU kind with peers (`RankLayout.process_groups`:
    every group created on every rank in one order; call it on every rank, after ``init_process_group``)."""
    return process_group_names(RankLayout(dp=dp, cp=cp, tp=tp).process_groups(rank))


def process_group_names(groups) -> dict:
    """The groups of a `RankGroups` that an NPU module can name: its kinds with peers (a group of one rank
    carries no collective)."""
    return {kind: groups.handles[kind] for kind in GROUP_KINDS if groups.handles[kind] is not None}


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
