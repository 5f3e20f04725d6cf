"""``rt`` of every CPU rank: the generated module's collectives on torch.distributed (gloo), each
``group=`` looked up by name in the rank's `graphgen.runtime.parallel.layout.RankGroups`, plus the
rank-aware ops of `graphgen.runtime.parallel.ops` (given this rank's coordinates).

One runtime whatever the layout: tp, sequence parallel, cp, DP attention + EP differ only in which
groups their graphs name and in how a token gather learns each rank's rows.

**Token collectives** (``all_gather(dim=0, length=None)``, ``reduce_scatter(dim=0)``) move a step's
token rows, and the ranks of a group may hold different counts; every gather is one counts-padded
all-gather (`CollectiveRuntime._gather_rows`: pad to the largest count, gather, keep each rank's real
rows in rank order), so no step input is padded. The counts come from, in order:

1. the step's split given by a rank feature (`set_rows`: context parallel's head-tail counts, set by the
   CP split before each prefill step);
2. the split the last reduce-scatter on the group cut (sequence parallel: the step's ``T`` rows in
   ``ceil(T/size)``-row chunks, rank r taking chunk r, the last ones short or empty);
3. else an all-gather of the counts first (DP attention: each DP group's step has its own batch); the
   reduce-scatter after it, on the ``ep`` group, gives each rank back its own rows of those counts: at tp 1
   (``ep`` = the ``dp`` ranks) its DP group's rows; at tp > 1 (``ep`` = ``dp × tp`` ranks, DP-major) each DP
   group's rows cut over its ``tp`` ranks as sequence parallel cuts them (``ceil(T/tp)``-row chunks, TP rank
   t taking chunk t), and that cut is kept for the graph's TP token gather that follows (2.), which gives
   every TP rank its whole group's rows back.

gloo has no reduce_scatter: an all_reduce and this rank's rows give the same sums (the wire cost of a
reduce-scatter is not what the CPU ranks show).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..core.cpu_runtime import CpuRuntime
from . import ops as ops_parallel
from .layout import RankGroups

__all__ = ["CollectiveRuntime", "gather_rows"]


def gather_rows(x: torch.Tensor, counts, rank_in_group: int, group) -> torch.Tensor:
    """Every rank's ``counts[i]`` rows of ``x`` (this rank's: ``counts[rank_in_group]``), concatenated in
    rank order: one all-gather of ``x`` padded to ``max(counts)`` (a collective over ``group``)."""
    if x.shape[0] != counts[rank_in_group]:
        raise RuntimeError(f"token gather of {x.shape[0]} rows, but the step's split gives this rank "
                           f"{counts[rank_in_group]} (counts {tuple(counts)})")
    padded = x.new_zeros((max(counts), *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)], dim=0)


def _even_cut(t: int, size: int) -> tuple[int, ...]:
    """``t`` rows in ``ceil(t/size)``-row chunks over ``size`` ranks (the last ones short or empty)."""
    chunk = -(-t // size)
    return tuple(max(0, min(chunk, t - r * chunk)) for r in range(size))


class CollectiveRuntime(CpuRuntime):
    """``rt`` of one CPU rank of ``groups.layout`` (see the module doc). ``expert_owner``: whose experts
    ``moe`` takes its weight slices for (the EP index; a test swaps it to prove the layout is observable)."""

    def __init__(self, *args, groups: RankGroups, **kwargs):
        super().__init__(*args, **kwargs)
        self.groups, self.layout, self.coords = groups, groups.layout, groups.coords
        self.rank, self.size = self.coords.tp_rank, self.layout.tp  # the vocabulary slice's (embedding_shard)
        self.expert_owner = self.coords.ep_rank
        self._ranks = self.layout.rank_groups(self.coords.rank)  # kind -> the ranks of this rank's group
        self._given: dict[str, tuple[int, ...]] = {}   # group -> the step's rows per rank (a rank feature's)
        self._cut: dict[str, tuple[int, ...]] = {}     # group -> the rows its last reduce-scatter cut
        self._gathered: Optional[tuple[tuple[int, ...], tuple[int, ...]]] = None  # (ranks, counts) of the last
        # gather that had to ask for the counts

    # ---- the group table -----------------------------------------------------------------------
    def _group(self, group: str, size: int):
        """The process group named ``group``, after checking the module was generated for this layout."""
        try:
            expect = self.layout.size(group)
        except ValueError:
            raise RuntimeError(f"collective on group {group!r}: not a group of a rank layout") from None
        if size != expect:
            raise RuntimeError(f"collective of a {size}-rank {group!r} graph on a {expect}-rank {group!r} group "
                               f"(layout dp={self.layout.dp} cp={self.layout.cp} tp={self.layout.tp}: "
                               f"a module of another layout?)")
        return self.groups[group]

    def _index(self, group: str) -> int:
        return self._ranks[group].index(self.coords.rank)

    def set_rows(self, group: str, counts) -> None:
        """The step's rows per rank of ``group`` (context parallel's split), for its token gathers."""
        self._given[group] = tuple(int(c) for c in counts)

    # ---- the collectives the generated modules call ---------------------------------------------
    def all_reduce(self, x: torch.Tensor, *, group: str, size: int, reduce: str) -> torch.Tensor:
        pg = self._group(group, size)
        if reduce != "sum":
            raise ValueError(f"all_reduce: unsupported reduce {reduce!r}")
        y = x.contiguous().clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=pg)
        return y

    def all_gather(self, x: torch.Tensor, *, group: str, size: int, dim: int, length) -> torch.Tensor:
        pg = self._group(group, size)
        if length is not None:  # a fixed-size shard (the LM head's vocabulary slices): cut to ``length``
            x = x.contiguous()
            parts = [torch.empty_like(x) for _ in range(size)]
            dist.all_gather(parts, x, group=pg)
            return torch.cat(parts, dim=dim).narrow(dim, 0, length)
        if dim != 0:
            raise ValueError(f"all_gather of tokens: dim must be 0, got {dim}")
        return gather_rows(x, self._counts(group, x.shape[0], pg), self._index(group), pg)

    def reduce_scatter(self, x: torch.Tensor, *, group: str, size: int, reduce: str, dim: int) -> torch.Tensor:
        if dim != 0:
            raise ValueError(f"reduce_scatter: only the tokens (dim 0) are scattered, got dim {dim}")
        total = self.all_reduce(x, group=group, size=size, reduce=reduce)
        ranks, t = self._ranks[group], total.shape[0]
        if self._gathered is not None and self._gathered[0] == ranks:  # back to the rows the gather took
            counts = self._gathered[1]
        elif self._gathered is not None and group == "ep" and self._gathered[0] == self._ranks["dp"]:
            # DP attention at tp > 1: each DP group's rows cut over its TP ranks (ep is DP-major), this
            # rank's group's cut kept for the TP gather after it
            cuts = [_even_cut(n, self.layout.tp) for n in self._gathered[1]]
            counts = tuple(c for cut in cuts for c in cut)
            self._cut["tp"] = cuts[self.coords.dp_rank]
        else:  # sequence parallel: even chunks of the step's rows, kept for the gathers that follow
            counts = _even_cut(t, size)
            self._cut[group] = counts
        if sum(counts) != t:
            raise RuntimeError(f"reduce_scatter of {t} rows over {group!r}, but the split is {counts}")
        first = sum(counts[:self._index(group)])
        return total[first:first + counts[self._index(group)]]

    def _counts(self, group: str, mine: int, pg) -> tuple[int, ...]:
        if group in self._given:
            if len(self._given[group]) != self.layout.size(group):
                raise RuntimeError(f"the step's split of group {group!r} has {len(self._given[group])} counts, "
                                   f"the group {self.layout.size(group)} ranks")
            return self._given[group]
        if group in self._cut:
            return self._cut[group]
        n = torch.tensor([mine], dtype=torch.int64)
        every = [torch.empty_like(n) for _ in range(self.layout.size(group))]
        dist.all_gather(every, n, group=pg)
        counts = tuple(int(c) for c in every)
        self._gathered = (self._ranks[group], counts)
        return counts

    # ---- the rank-aware ops ---------------------------------------------------------------------
    def embedding_shard(self, weight, input_ids, *, vocab_size: int):
        return ops_parallel.embedding_shard(weight, input_ids, vocab_size=vocab_size, rank=self.rank, size=self.size)

    def moe(self, *args, **kwargs):
        return ops_parallel.moe(*args, rank=self.expert_owner, size=self.layout.ep, **kwargs)

    def __getattr__(self, name: str):  # the shard pass's ops (residual_add, ...) are the parallel ones
        if name in ops_parallel.__all__:
            return getattr(ops_parallel, name)
        return super().__getattr__(name)
