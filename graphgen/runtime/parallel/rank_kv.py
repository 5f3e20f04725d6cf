"""The KV side of a rank, for any target: its KV shard, its connector's two sides (per-shard pool keys,
prefix hits agreed by every rank of its lockstep group, save-once for replicated KV, the drain barrier).

Pool keys ``{model}@{layout}@r{owner}of{tp}@{chained hash}``, ``owner`` the lowest TP rank holding the same
KV shard (`graphgen.families.parallel.kv_shard_owner`): the rank itself where each rank's KV differs; rank 0
where it is the same on every rank (the MLA latent); the first rank of its group where KV heads are
replicated because tp exceeds them (Qwen3 with 2 KV heads at tp=4: ranks 0,1 use r0of4, ranks 2,3 r2of4).
Only the owner puts (`SaveOncePool` on the others), and at cp > 1 only CP rank 0 (the other CP ranks hold
the same KV: the graph's ``writers=cp0``): each distinct shard is saved once, and loaded on every rank
that holds it. A prefix hit counts only as far as every rank of the lockstep group hits: the leading-run
length is agreed with an all_reduce MIN before loading, and the loaded length again after (a block
evicted between lookup and load on one rank shortens the hit for all). Each rank commits its own blocks
after its own save event (the connector's rule).

The lockstep group is the ranks that run the same plans: the whole world when ``dp = 1``; under DP
attention each DP group plans its own requests, so at tp = cp = 1 a DP rank's KV side is the single-rank one
(keys ``r0of1``: a prefix saved through one DP rank hits on every other), and at tp > 1 it is the TP side
above on its DP group's ranks (`RankLayout.lockstep_group`): keys per TP shard (the MLA latent ``r0of{tp}``,
put by TP rank 0 of each group; a prefix saved through one DP group hits on every other), hits agreed inside
the group.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ...families.parallel import kv_shard_owner, rank_kv_components
from ..engine.connector import KVConnector
from ..engine.kv_load import KVLoader, LoadedBlocks
from ..pool.keys import KVShard
from .layout import RankCoords, RankLayout

__all__ = ["agree_min", "SaveOncePool", "RankLoader", "RankConnector", "RankParts", "rank_parts"]


def agree_min(n: int, group=None) -> int:
    """The smallest ``n`` over the ranks (a collective: every rank must call it)."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


class SaveOncePool:
    """A pool as a rank sees it when another rank holds the same KV shard and puts it (the MLA latent,
    KV heads replicated because tp exceeds them, a CP rank other than 0): reads go to the pool, puts are
    dropped (the shard's owner puts the same bytes under the same key)."""

    def __init__(self, pool):
        self._pool = pool
        self.skipped_puts = 0

    def put(self, key: str, value: bytes) -> bool:
        self.skipped_puts += 1
        return True

    def put_many(self, items) -> list[bool]:   # not the inner pool's: every put is dropped
        return [self.put(k, v) for k, v in items]

    def __getattr__(self, name: str):
        return getattr(self._pool, name)


class RankLoader(KVLoader):
    """Pool keys of this rank's KV shard (named by ``owner``, the lowest rank holding the same shard),
    hits agreed by every rank of ``group``."""

    def __init__(self, *args, owner: int, size: int, group=None, **kwargs):
        super().__init__(*args, shard=KVShard(owner, size), **kwargs)
        self.group = group

    def lookup(self, keys: Sequence[str]) -> int:
        return agree_min(super().lookup(keys), self.group)

    def load(self, keys: Sequence[str]) -> LoadedBlocks:
        loaded = super().load(keys)
        return loaded[:agree_min(len(loaded), self.group)]  # loaded here, but not on every rank: recomputed


class RankConnector(KVConnector):
    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def drain(self, timeout=None) -> None:
        super().drain(timeout)
        dist.barrier(group=self.group)  # every rank's commits are visible before any rank looks the pool up again


@dataclasses.dataclass(frozen=True)
class RankParts:
    """The KV side of one rank (see the module doc): ``kv_shapes`` (component -> per-block shape), the
    connector's two sides as factories (None: the single-rank ones), ``shard``: the pool-key shard this
    rank's KV is saved under (``(owner, tp)``) and whether it puts it (``writes``)."""
    kv_shapes: Optional[dict]
    make_loader: Optional[Callable]
    make_connector: Optional[Callable]
    shard: tuple[int, int]
    writes: bool

    def engine_options(self) -> dict:
        """What a target's engine builder takes from it (`graphgen.runtime.engine.assembly.build_engine`'s)."""
        opts = {"kv_shapes": self.kv_shapes, "make_loader": self.make_loader, "make_connector": self.make_connector}
        return {k: v for k, v in opts.items() if v is not None}


def rank_parts(spec, layout: RankLayout, coords: RankCoords, group=None) -> RankParts:
    """Rank ``coords``'s KV side; ``group``: the host-side gloo group of its lockstep ranks (None: the world's,
    at dp = 1)."""
    if layout.dp > 1 and layout.world == layout.dp:  # DP ranks of one rank each: the single-rank KV side (keys r0of1, no agreement)
        return RankParts(None, None, None, (0, 1), True)
    if layout.dp > 1 and group is None:
        raise ValueError("a DP group of several ranks agrees its hits on its lockstep group: none given")
    tp, dims = layout.tp, dataclasses.asdict(spec.dims)
    comps = rank_kv_components(spec.family, dims, tp)
    owner = kv_shard_owner(spec.family, dims, tp, coords.tp_rank)
    writes = owner == coords.tp_rank and coords.cp_rank == 0

    def make_loader(pool, cache, counters):
        return RankLoader(pool, cache, model=spec.name, owner=owner, size=tp, group=group, stats=counters)

    def make_connector(pool, cache, alloc, counters):
        if not writes:  # another rank holds the same shard and puts it
            pool = SaveOncePool(pool)
        return RankConnector(pool, cache, alloc, write=spec.pool.write, stats=counters, group=group)

    return RankParts({name: (spec.kv_cache.block_size, *shape) for name, shape in comps}, make_loader,
                     make_connector, (owner, tp), writes)
