"""The rank layout: where each rank of ``dp × cp × tp`` sits and every named process group, built once.

Rank order (docs/parallel.md): TP innermost, then CP, then DP: ``rank = (dp_rank × cp + cp_rank) × tp +
tp_rank``. The groups a generated module's collectives name (``group=`` in the IR):

* ``tp``: the ``tp`` consecutive ranks of one DP and CP group -- attention's and the dense MLPs'
  all-reduces, the LM head's vocabulary gather, sequence parallel's token collectives;
* ``cp``: the ranks with the same DP and TP rank in every CP group -- context parallel's KV gather;
* ``dp``: the ranks with the same CP and TP rank in every DP group -- the MoE's token all-gather;
* ``ep``: the ranks the MoE's experts are spread over: every rank of the DP groups with the same CP rank
  (``dp × tp``) under DP attention, else the TP group (EP reuses the TP ranks). ``ep`` is derived: the
  spec's ``parallel.ep`` is 1 (every expert width-sliced over that group) or this group's size.

and one kind no module names, for the host side (`RankLayout.lockstep_groups`): ``lockstep``, the ``cp × tp`` ranks of one DP group (the
ranks that run the same plans: the plan check, the hit MINs, the drain barrier run on it; the whole world
when ``dp = 1``). `RankLayout.lockstep_group` makes it as a gloo group (it agrees on CPU tensors whatever
the forward's backend).

One table for every target: the CPU ranks' collectives resolve ``group=`` in it (gloo,
`graphgen.runtime.parallel.collectives.CollectiveRuntime`), the NPU ranks bind their modules' HCCL
group names from it (`graphgen.npu.run.groups.bind_process_groups`). ``torch.distributed.new_group`` is
collective, so `RankLayout.process_groups` creates every group of size > 1 on every rank in one order
(`GROUP_KINDS`, then `RankLayout.groups` order) and keeps those holding the rank; a group spanning the
world is the world group itself, a group of one rank is None (no collective runs on it: a graph of
group size 1 has none). Torch-free until `process_groups` is called.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GROUP_KINDS", "RankLayout", "RankCoords", "RankGroups"]

GROUP_KINDS = ("tp", "cp", "dp", "ep")


@dataclass(frozen=True)
class RankCoords:
    """One rank's place: its world ``rank`` and its index in each group kind."""
    rank: int
    dp_rank: int
    cp_rank: int
    tp_rank: int
    ep_rank: int


@dataclass(frozen=True)
class RankLayout:
    """``dp × cp × tp`` ranks (see the module doc); ``ep`` (the expert group's size) is derived."""
    dp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self):
        for name in ("dp", "cp", "tp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RankLayout.{name} must be an int >= 1, got {v!r}")

    @classmethod
    def of(cls, parallel) -> "RankLayout":
        """The layout of a spec's ``parallel`` section (`graphgen.modelspec.model.Parallel`)."""
        return cls(dp=parallel.dp, cp=parallel.cp, tp=parallel.tp)

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def ep(self) -> int:
        """The expert group's size: every DP group's ranks (``dp × tp``) under DP attention, else ``tp``."""
        return self.dp * self.tp if self.dp > 1 else self.tp

    def rank_of(self, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.cp + cp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside a world of dp={self.dp} x cp={self.cp} x tp={self.tp}")
        rest, tp_rank = divmod(rank, self.tp)
        dp_rank, cp_rank = divmod(rest, self.cp)
        return RankCoords(rank, dp_rank, cp_rank, tp_rank, dp_rank * self.tp + tp_rank if self.dp > 1 else tp_rank)

    def size(self, kind: str) -> int:
        """The size of every group of ``kind``."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "ep": self.ep}[self._kind(kind)]

    def groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Every group of each kind as ascending rank tuples (so a collective's shards are in rank order)."""
        r, dp, cp, tp = self.rank_of, range(self.dp), range(self.cp), range(self.tp)
        out = {
            "tp": tuple(tuple(r(d, c, t) for t in tp) for d in dp for c in cp),
            "cp": tuple(tuple(r(d, c, t) for c in cp) for d in dp for t in tp),
            "dp": tuple(tuple(r(d, c, t) for d in dp) for c in cp for t in tp),
        }
        out["ep"] = (tuple(tuple(sorted(r(d, c, t) for d in dp for t in tp)) for c in cp) if self.dp > 1
                     else out["tp"])
        return out

    def lockstep_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ``lockstep`` groups (module doc): the ``cp × tp`` ranks of each DP group, ascending."""
        return tuple(tuple(range(d * self.cp * self.tp, (d + 1) * self.cp * self.tp)) for d in range(self.dp))

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The ranks of the group of ``kind`` that holds ``rank``."""
        self.coords(rank)  # in range
        return next(g for g in self.groups()[self._kind(kind)] if rank in g)

    def rank_groups(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The group of each kind that holds ``rank``."""
        return {kind: self.group_of(kind, rank) for kind in GROUP_KINDS}

    def process_groups(self, rank: int, backend=None) -> "RankGroups":
        """This rank's ``torch.distributed`` group of each kind (see the module doc: call it on every rank,
        after ``init_process_group``; ``backend``: new groups' backend, None: the world's)."""
        import torch.distributed as dist

        if dist.get_world_size() != self.world:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks; the layout dp={self.dp} x "
                             f"cp={self.cp} x tp={self.tp} needs {self.world}")
        mine, made = {}, {}
        for kind in GROUP_KINDS:
            for ranks in self.groups()[kind]:
                if ranks not in made:
                    made[ranks] = (None if len(ranks) == 1 else dist.group.WORLD if len(ranks) == self.world
                                   else dist.new_group(list(ranks), backend=backend))
                if rank in ranks:
                    mine[kind] = made[ranks]
        return RankGroups(self, self.coords(rank), mine)

    def lockstep_group(self, rank: int, timeout=None):
        """This rank's ``lockstep`` group as a gloo group (host-side agreement; module doc): None when it is
        the whole world (the world's host group serves) or this rank alone. Collective: every rank calls
        it, after ``init_process_group``, in the same order."""
        import torch.distributed as dist

        if self.dp == 1 or self.world == self.dp:
            return None
        mine = None
        for ranks in self.lockstep_groups():
            kw = {} if timeout is None else {"timeout": timeout}
            g = dist.new_group(list(ranks), backend="gloo", **kw)
            if rank in ranks:
                mine = g
        return mine

    def _kind(self, kind: str) -> str:
        if kind not in GROUP_KINDS:
            raise ValueError(f"no process group {kind!r}: a layout has {', '.join(GROUP_KINDS)}")
        return kind


@dataclass(frozen=True)
class RankGroups:
    """One rank's process groups by name (``handles``: kind -> torch group; None: this rank alone), with
    its layout and coordinates."""
    layout: RankLayout
    coords: RankCoords
    handles: dict

    def __getitem__(self, kind: str):
        return self.handles[self.layout._kind(kind)]
