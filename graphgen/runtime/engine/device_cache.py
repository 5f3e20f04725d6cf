"""The device prefix cache (``pool.device_cache: true``): full KV blocks of finished (or preempted)
requests stay in the device cache, found by their pool key, so a later prompt's leading blocks are
shared from the device instead of loaded from the pool.

It holds one `BlockAllocator` reference per cached block (the same refcounts forks share): a block
a request uses is never evicted (refcount above the cache's one), and a block goes back to the free
list only when the cache drops it and nobody else holds it. Eviction is LRU (a hit or an insert
makes a block the most recent); the evicted block's key is handed to ``on_evict`` first (the write-
back policy saves it there, pinning it until its commit). Thread: the scheduler's only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional, Sequence

from ..core.kvcache import BlockAllocator

__all__ = ["DevicePrefixCache"]


class DevicePrefixCache:
    def __init__(self, alloc: BlockAllocator, on_evict: Callable[[int, str], None] = lambda block, key: None):
        self.alloc = alloc
        self.on_evict = on_evict
        self._blocks: OrderedDict[str, int] = OrderedDict()  # key -> block id, least recent first
        self._keys: dict[int, str] = {}  # block id -> key

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: str) -> bool:
        return key in self._blocks

    def lru_keys(self) -> list[str]:
        """Cached keys, least recently used first (what eviction takes first)."""
        return list(self._blocks)

    def holds(self, block_id: int) -> bool:
        return block_id in self._keys

    def block(self, key: str) -> Optional[int]:
        """The block cached under ``key`` (no reference taken, recency unchanged), or None."""
        return self._blocks.get(key)

    def leading(self, keys: Sequence[str]) -> list[int]:
        """The blocks of the leading run of ``keys`` cached here, each given one more reference (the
        caller's) and made most recent."""
        out = []
        for k in keys:
            b = self._blocks.get(k)
            if b is None:
                break
            out.append(b)
        if out:
            self.alloc.share(out)
            for k in keys[:len(out)]:
                self._blocks.move_to_end(k)
        return out

    def insert(self, block_id: int, key: str) -> None:
        """Keep ``block_id`` (full, its KV complete) under ``key`` with a reference of the cache's own;
        a key cached already (the same block, or another copy of the same KV) is only made recent."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        if block_id in self._keys:  # one block under one key only (its KV is that key's)
            return
        self.alloc.share([block_id])
        self._blocks[key] = block_id
        self._keys[block_id] = key

    def evict(self, n: int) -> int:
        """Drop up to ``n`` least recently used blocks nobody else holds; returns how many."""
        done = 0
        for key in list(self._blocks):
            if done >= n:
                break
            b = self._blocks[key]
            if self.alloc.refcount(b) != 1:  # a request uses it: it stays
                continue
            self._drop(key)
            done += 1
        return done

    def clear(self) -> None:
        """Drop every block nobody else holds (shutdown, after an error)."""
        self.evict(len(self._blocks))

    def _drop(self, key: str) -> None:
        b = self._blocks.pop(key)
        del self._keys[b]
        self.on_evict(b, key)  # before the free: a write-back save pins it first
        self.alloc.free([b])
