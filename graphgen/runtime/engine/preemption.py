"""The scheduler's block holding (a part of `graphgen.runtime.engine.scheduler.Scheduler`): where a
step's blocks come from — free blocks (evicting device-cached ones first, waiting for the commits whose
pins hold the next free ones), or another request's, preempted — and how a request gives its blocks back
once no step in flight still writes them."""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

from ..core.kvcache import BlockAllocator, OutOfBlocks
from .block_life import BlockLife
from .request import Request

__all__ = ["Preemption"]


class Preemption:
    # the Scheduler's state these methods use (see its __init__)
    alloc: BlockAllocator
    blocks: BlockLife
    block_size: int
    waiting: deque[Request]
    prefill: list[Request]
    running: list[Request]
    failed: list[Request]
    deferred: list[Request]
    num_preemptions: int
    wait_for_commits = True  # an allocation held up by pins alone waits for their commits (False: preempt)

    def abort(self, r: Request, reason: str = "abort") -> None:
        raise NotImplementedError  # the Scheduler's

    def _cannot_fit(self, r: Request, num_tokens: int) -> None:
        """Every other admitted request gives its blocks back; if ``r`` still does not fit it is
        failed (it can never run in this cache)."""
        for other in [o for o in self.prefill if o is not r][::-1]:
            self._preempt(other)
        if self.reserve(r, num_tokens):
            return
        err = None
        try:
            self._alloc(math.ceil(num_tokens / self.block_size) - len(r.table))
        except OutOfBlocks as e:
            err = e
        r.error = err
        self.abort(r, "error")
        self.failed.append(r)

    def _victim(self, exclude: list[Request]) -> Optional[Request]:
        """The newest request holding blocks that no step in flight uses: admitted ones first
        (they are newer than every running one), then running ones."""
        for r in [*self.prefill[::-1], *self.running[::-1]]:
            if r.table and r.in_steps == 0 and r not in exclude:
                return r
        return None

    def _preempt(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
            r.result.preemptions += 1
            self.num_preemptions += 1
        else:
            if r.cached > r.hit_blocks * self.block_size:  # mid-prompt: its chunks are recomputed
                r.result.preemptions += 1
                self.num_preemptions += 1
            self.prefill.remove(r)
        self._release(r)
        r.cached, r.hit_blocks, r.keys, r.loaded, r.shared_blocks, r.computed, r.device_blocks = 0, 0, None, [], 0, 0, 0
        self.waiting.appendleft(r)  # preempted newest first: the oldest ends up at the head

    def _alloc(self, n: int) -> list[int]:
        while True:
            try:
                return self.alloc.alloc(n)
            except OutOfBlocks:
                # num_unheld counts pinned free blocks, ``coming`` those held for write-backs: eviction
                # never depends on when a commit landed
                if self.blocks.evict(n - self.alloc.num_unheld - self.blocks.coming):
                    continue  # cached blocks nobody uses went back (a dirty one once written back)
                # only commits in flight hold the next free blocks: wait for them (a test turns it off)
                if not (self.wait_for_commits and self.alloc.wait_unpinned(n)):
                    raise

    def reserve(self, r: Request, num_tokens: int) -> bool:
        """Blocks for ``r``'s first ``num_tokens`` positions if they can be had (also the recursive drafts' MTP KV)."""
        need = math.ceil(num_tokens / self.block_size) - len(r.table)
        if need > 0:
            try:
                r.table.extend(self._alloc(need))
            except OutOfBlocks:
                return False
        return True

    def _release(self, r: Request) -> None:
        if r.table:
            r.loaded = []  # loaded blocks its prefill never took (preempted, aborted) are dropped
            self.blocks.release(r)  # device prefix cache, write-back: before the references go
            self.alloc.free(r.table)  # a pinned block is handed out again only once committed
            r.table = []

    def _maybe_release(self, r: Request) -> None:
        if r.in_steps > 0:
            if r.table and r not in self.deferred:
                self.deferred.append(r)
            return
        if r in self.deferred:
            self.deferred.remove(r)
        self._release(r)
