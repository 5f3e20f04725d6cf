"""The KV connector's worker side: a step's save, from the paged KV cache to a pool (`PoolBackend`).

Modelled on the worker side of vLLM's ``KVConnectorBase_V1`` (``save_kv_layer`` /
``wait_for_save``), at block granularity; the scheduler side (keys, lookup, load at admission) is
`graphgen.runtime.engine.kv_load.KVLoader`, which shares this connector's counters:

* **save** — driven by the model runner alone (`prepare_save` before the step, `handoff` after it,
  `cancel` if it failed; `save_filled` for the blocks a plan saves from the cache after its
  forward: decode-time saves, write-backs; the NPU runner's commit path makes the same calls):
  the save's blocks are pinned and a staging area is made for the module's save program to copy
  into; after the step, the commit — a ``pool.put`` per block — runs once the save's event (the
  module's ``HOST_EVENT``) is recorded: inline for ``write: sync``, on the ``host`` stream for
  ``write: async`` (the first token never waits for it). The pins are released when the commit is
  done, never before (an allocation that needs those blocks waits for it:
  `BlockAllocator.wait_unpinned`). What a commit waits on is a `SaveHandle`.
* **stats**: `stats` (the counters it shares with the loader) and `pool_stats()` (the backend's own).

A pool that is down or full costs a recompute, never a request: a lookup that raises counts as no
hit, a load that fails stops the loaded run there, a put that fails (False or an exception) leaves
the block invisible. Each is counted (``pool_errors``, ``put_failures``), none is raised.

This is the seam a distributed pool (Mooncake Store) plugs into: it only needs the small
`PoolBackend` contract of `graphgen.runtime.pool.base`; everything about events, pins and staging stays
here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from ...ir.graph import HOST_STREAM
from ..core.kvcache import BlockAllocator, PagedKVCache, pack_block
from ..core.streams import Job, Stream
from ..pool.base import PoolBackend
from .kv_load import Counters

__all__ = ["KVConnector", "PendingSave", "SaveHandle", "WRITE_MODES"]

log = logging.getLogger("graphgen.connector")

WRITE_MODES = ("off", "sync", "async")
# a commit's blocks go to the pool in batches of at most this many blocks and about this many bytes (one put_many:
# one round trip to the shared pool's process or the Mooncake master); small blocks are round-trip bound, big ones
# bandwidth bound, where bigger messages gain nothing. At most one batch of packed blocks is alive at once.
COMMIT_BATCH = 32
COMMIT_BATCH_BYTES = 256 << 10


class SaveHandle(Protocol):
    """What a commit waits on (the CPU runner: the save program's `Job` and its bound event; the NPU
    runner: its commit copies): ``exception()`` blocks until the save program ended and returns its
    error (None if it succeeded); ``wait()`` blocks until the save's event is recorded."""

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]: ...
    def wait(self, timeout: Optional[float] = None) -> None: ...


@dataclass(frozen=True)
class PendingSave:
    """One step's save: cache blocks ``block_ids`` (pinned) go to ``keys``, via ``staging`` (or
    straight from the cache, ``from_cache``: a decode-time save of a step that has landed)."""

    block_ids: tuple[int, ...]
    keys: tuple[str, ...]
    staging: list  # per layer, per component: [len(block_ids), *shape]; the cache when from_cache
    from_cache: bool = False
    # called once the commit is over (puts done, failed or cancelled): the NPU runner frees the
    # host-ring slot its staging lives in (graphgen.npu.run.staging)
    on_committed: Optional[Callable[[], None]] = None

    def pack(self, j: int) -> bytes:
        """The pool value of the ``j``-th saved block."""
        return pack_block(self.staging, self.block_ids[j] if self.from_cache else j)


class _Landed:
    """The `SaveHandle` of KV already in the cache (the step that wrote it has landed)."""

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        return None

    def wait(self, timeout: Optional[float] = None) -> None:
        return None


_LANDED = _Landed()


class KVConnector:
    def __init__(self, pool: PoolBackend, cache: PagedKVCache, alloc: BlockAllocator, *, write: str,
                 stats: Optional[Counters] = None):
        if write not in WRITE_MODES:
            raise ValueError(f"write must be one of {WRITE_MODES}, got {write!r}")
        self.pool = pool
        self.cache = cache
        self.alloc = alloc
        self.write = write
        # async: the commit thread reads the staging with the GIL released (a memfd, os.pread), so it
        # does not stall the forward's Python; sync has no thread to yield to, and a numpy memcpy is
        # the cheaper copy (benchmarks/bench_commit.py; bench_long_serving.py --async-staging A/Bs it)
        self.shared_staging = write == "async"
        self.host_stream = Stream(HOST_STREAM)  # async commits, in step order
        self._pending: deque[Job] = deque()    # async commits in flight, oldest first
        self.observer = None                   # a graphgen.trace.StepObserver: commit spans and latency
        self.counters = stats if stats is not None else Counters()  # bumped from the host stream too

    @property
    def stats(self) -> dict:
        return self.counters.values

    def _count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    def pool_stats(self) -> dict:
        try:
            return self.pool.stats()
        except Exception as e:  # stats are for logs: a pool that is down must not fail them
            return {"error": str(e)}

    # ---- save -------------------------------------------------------------------------------
    def prepare_save(self, block_ids: Sequence[int], keys: Sequence[str], *, staging: Optional[list] = None,
                     on_committed: Optional[Callable[[], None]] = None) -> PendingSave:
        """Before the step runs: pin the blocks its save reads and make the staging it writes
        (``staging``: the runner's own, e.g. the NPU runner's pinned host-ring rows; then none is made)."""
        if len(block_ids) != len(keys):
            raise ValueError(f"{len(block_ids)} save blocks but {len(keys)} keys")
        if staging is None:
            staging = self.cache.make_staging(len(block_ids), shared_memory=self.shared_staging)
        save = PendingSave(tuple(block_ids), tuple(keys), staging, on_committed=on_committed)
        if save.block_ids:
            self.alloc.pin(save.block_ids)
        return save

    def cancel(self, save: PendingSave) -> None:
        """The step failed before its save was handed off: nothing is committed, pins go."""
        try:
            if save.block_ids:
                self.alloc.unpin(save.block_ids)
        finally:
            if save.on_committed is not None:
                save.on_committed()

    def handoff(self, save: PendingSave, save_job: Optional[SaveHandle], save_done: SaveHandle) -> None:
        """After the step: commit ``save`` once ``save_done`` (the save's event, bound to this step)
        is recorded. ``save_job`` is the step's save program; if it failed, nothing is put."""
        if self.write == "async":
            self._pending.append(self.host_stream.launch(self._commit, save, save_job, save_done))
        else:
            self._commit(save, save_job, save_done)

    def _commit(self, save: PendingSave, save_job: Optional[SaveHandle], save_done: SaveHandle) -> None:
        try:
            # the job first: a failed save never records its event, so waiting on it would hang
            err = save_job.exception() if save_job is not None else None
            if err is not None:
                self._count("save_failures")
                log.warning("KV save failed; its blocks are not committed: %s", err)
                return
            save_done.wait()  # visibility rule: a block is put only after its save's event
            obs = self.observer
            t0 = time.perf_counter() if obs is not None else 0.0
            puts = 0
            batch: list = []   # (key, value) packed, put once COMMIT_BATCH or COMMIT_BATCH_BYTES is reached
            for j, key in enumerate(save.keys):
                batch.append((key, save.pack(j)))
                if j + 1 < len(save.keys) and len(batch) < COMMIT_BATCH and \
                        sum(len(v) for _, v in batch) < COMMIT_BATCH_BYTES:
                    continue
                try:
                    oks = self.pool.put_many(batch)
                except Exception as e:
                    log.warning("pool put failed: %s", e)
                    oks = [False] * len(batch)
                for ok in oks:
                    puts += bool(ok)
                    self._count("puts" if ok else "put_failures")  # a failed block is recomputed later
                batch = []
            if obs is not None:
                obs.commit(t0, time.perf_counter(), blocks=len(save.keys), puts=puts)
        finally:
            if save.block_ids:
                self.alloc.unpin(save.block_ids)
            if save.on_committed is not None:
                save.on_committed()

    def save_filled(self, block_ids: Sequence[int], keys: Sequence[str]) -> None:
        """Save blocks whose KV is in the cache already (the runner, once a step's forward is done: the
        blocks its decode rows filled, decode graphs having no save program; write-backs, held by the
        scheduler until this step has landed): the blocks are pinned now (before the scheduler can
        free them), packed straight from the cache and put, then unpinned — on the host stream for
        ``async`` (after every earlier commit), inline otherwise."""
        if self.write == "off" or not block_ids:
            return
        if len(block_ids) != len(keys):
            raise ValueError(f"{len(block_ids)} save blocks but {len(keys)} keys")
        self.alloc.pin(block_ids)
        save = PendingSave(tuple(block_ids), tuple(keys), self.cache, from_cache=True)
        if self.write == "async":
            self._pending.append(self.host_stream.launch(self._commit, save, None, _LANDED))
        else:
            self._commit(save, None, _LANDED)

    # ---- commits in flight ------------------------------------------------------------------
    def wait_oldest(self) -> bool:
        """Block until the oldest pending commit is done (its pins released). False if none."""
        if not self._pending:
            return False
        self._pending[0].wait()
        self.reap()
        return True

    def drain(self, timeout: Optional[float] = None) -> None:
        """Wait for every pending commit (failures are logged and counted, never raised)."""
        for job in list(self._pending):
            job.wait(timeout)
        self.reap()

    def reap(self) -> int:
        """Drop the finished commits from the front of the queue (logging a failed one); how many."""
        n = 0
        while self._pending and self._pending[0].done():
            err = self._pending.popleft().exception()
            n += 1
            if err is not None:
                log.warning("pool commit failed: %s", err)
        return n

    @property
    def pending(self) -> int:
        return len(self._pending)

    def in_flight(self) -> int:
        """Commits not finished yet (``pending`` also counts finished ones not reaped); safe to call
        from another thread (the P/D handoff waits on it)."""
        try:
            return sum(not job.done() for job in list(self._pending))
        except RuntimeError:  # the deque changed while it was copied: say busy, ask again later
            return 1

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.host_stream.close()
