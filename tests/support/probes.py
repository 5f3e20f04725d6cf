"""Rank probes shared by several rank tests (`DistributedEngine.on_ranks` runs a module-level function in
every rank process, pickled by name, so they live in an importable module)."""

from __future__ import annotations

__all__ = ["async_on", "swap_sp_rows"]


def swap_sp_rows(rank_engine) -> None:
    """Sequence parallel's reduce-scatter over the TP group hands each TP rank the other TP rank's rows
    wherever the cut is even (the gathers that follow still put them in rank order): a negative control that
    the token split inside the TP group is live (with ``sp`` off no reduce-scatter runs over tp and the probe
    changes nothing)."""
    rt = rank_engine.runner.rt
    real = rt.reduce_scatter

    def swapped(x, *, group, size, reduce, dim):
        mine = real(x, group=group, size=size, reduce=reduce, dim=dim)
        cut = rt._cut.get(group, ())
        if group != "tp" or len(set(cut)) != 1:
            return mine
        total = rt.all_reduce(x, group=group, size=size, reduce=reduce)
        other = size - 1 - rt._index(group)
        return total[other * cut[0]:(other + 1) * cut[0]]
    rt.reduce_scatter = swapped


def async_on(rank_engine) -> bool:
    """Does this rank's core plan step N+1 while step N's forward runs (async scheduling)? A test that runs
    ranks with ``async_scheduling`` asserts it on every rank: the rank setup may turn it off (under DP
    attention: `graphgen.runtime.parallel.rank`, "Threads"), and then the test would prove nothing about it."""
    return rank_engine.core.async_scheduling
