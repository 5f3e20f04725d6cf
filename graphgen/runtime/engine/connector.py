"""The KV connector: between the paged KV cache and a pool (`PoolBackend`).

Modelled on the worker side of vLLM's ``KVConnectorBase_V1`` (``start_load_kv`` /
``save_kv_layer`` / ``wait_for_save``), at block granularity:

* **load** — the scheduler side (`block_keys`, `lookup`, `load`): how many leading blocks of a
  prompt the pool holds, then those blocks fetched and unpacked into load staging (one block each,
  validated there) at admission. The request keeps them and its step plan carries them to the
  runner; the cache itself is written by the prefill's graph (its ``kv_load`` nodes on the
  ``kv_load`` stream, ordered against the forward by events). A request preempted or aborted
  before its prefill simply drops them.
* **save** — the worker side, driven by the runner (`prepare_save` before the step, `handoff`
  after it, `cancel` if it failed): the save's blocks are pinned and a staging area is made for the
  module's save program to copy into; after the step, the commit — a ``pool.put`` per block — runs
  once the save's event (the module's ``HOST_EVENT``) is recorded: inline for ``write: sync``, on
  the ``host`` stream for ``write: async`` (the first token never waits for it). The pins are
  released when the commit is done, never before. What a commit waits on is a `SaveHandle`.
* **stats**: `stats` (this connector's counters) and `pool_stats()` (the backend's own).

A pool that is down or full costs a recompute, never a request: a lookup that raises counts as no
hit, a load that fails stops the loaded run there, a put that fails (False or an exception) leaves
the block invisible. Each is counted (``pool_errors``, ``put_failures``), none is raised.

This is the seam a distributed pool (Mooncake Store) plugs into: it only needs the small
`PoolBackend` contract of `graphgen.runtime.pool.base`; everything about events, pins and staging stays
here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from ...ir.graph import HOST_STREAM
from ..core.kvcache import BlockAllocator, PagedKVCache, pack_block, unpack_block_into
from ..core.streams import Job, Stream
from ..pool.base import PoolBackend
from ..pool.keys import KVShard, block_keys

__all__ = ["KVConnector", "PendingSave", "SaveHandle", "WRITE_MODES"]

log = logging.getLogger("graphgen.connector")

WRITE_MODES = ("off", "sync", "async")


class SaveHandle(Protocol):
    """What a commit waits on (the CPU runner: the save program's `Job` and its bound event; the NPU
    runner: its commit copies): ``exception()`` blocks until the save program ended and returns its
    error (None if it succeeded); ``wait()`` blocks until the save's event is recorded."""

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]: ...
    def wait(self, timeout: Optional[float] = None) -> None: ...


@dataclass(frozen=True)
class PendingSave:
    """One step's save: cache blocks ``block_ids`` (pinned) go to ``keys``, via ``staging``."""

    block_ids: tuple[int, ...]
    keys: tuple[str, ...]
    staging: list  # per layer, per component: [len(block_ids), *shape]


class KVConnector:
    def __init__(self, pool: PoolBackend, cache: PagedKVCache, alloc: BlockAllocator, *, model: str,
                 write: str, shard: KVShard = KVShard()):
        if write not in WRITE_MODES:
            raise ValueError(f"write must be one of {WRITE_MODES}, got {write!r}")
        self.pool = pool
        self.cache = cache
        self.alloc = alloc
        self.model = model
        self.write = write
        self.shard = shard  # the part of each layer's KV this connector's cache holds (its keys say it)
        self.host_stream = Stream(HOST_STREAM)  # async commits, in step order
        self._pending: deque[Job] = deque()    # async commits in flight, oldest first
        self._lock = threading.Lock()          # stats are bumped from the host stream too
        self.observer = None                   # a graphgen.trace.StepObserver: commit spans and latency
        self.stats = {"puts": 0, "put_failures": 0, "save_failures": 0, "hit_blocks": 0,
                      "loaded_blocks": 0, "pool_errors": 0}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats[name] += n

    def pool_stats(self) -> dict:
        try:
            return self.pool.stats()
        except Exception as e:  # stats are for logs: a pool that is down must not fail them
            return {"error": str(e)}

    # ---- load -------------------------------------------------------------------------------
    def block_keys(self, prompt: Sequence[int]) -> list[str]:
        """Pool keys of the prompt's full blocks (model and cache layout are part of every key)."""
        return block_keys(prompt, self.cache.block_size, model=self.model, layout=self.cache.layout, shard=self.shard)

    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the pool holds; 0 when the pool cannot be asked."""
        try:
            return self.pool.leading_run(list(keys))
        except Exception as e:
            log.warning("pool lookup failed, recomputing: %s", e)
            self._count("pool_errors")
            return 0

    def load(self, keys: Sequence[str]) -> list:
        """Fetch ``keys`` in order into load staging (one block each), stopping at the first block
        that is gone (evicted since the lookup), unreadable or foreign. Returns the leading blocks
        loaded; the rest is recomputed. The cache is not touched: the prefill's graph copies the
        staged blocks in (the step plan carries them there)."""
        staged = [self.cache.make_staging(1) for _ in keys]

        def into(i, s):  # unpack straight from the pool's buffer (one copy); a foreign size is a miss
            def unpack(view):
                try:
                    unpack_block_into(s, 0, view)
                except Exception as e:
                    log.warning("pool block %d unreadable, recomputing from there: %s", i, e)
                    self._count("pool_errors")
                    raise
            return unpack

        try:  # one batch: a backend with registered memory (Mooncake) reads every block in one call
            ok = self.pool.get_into(list(keys), [into(i, s) for i, s in enumerate(staged)])
        except Exception as e:
            log.warning("pool load failed, recomputing: %s", e)
            self._count("pool_errors")
            ok = []
        loaded = []
        for hit, s in zip(ok, staged):
            if not hit:  # gone since the lookup, unreadable or foreign: recompute from here
                break
            loaded.append(s)
        self._count("hit_blocks", len(loaded))
        self._count("loaded_blocks", len(loaded))
        return loaded

    # ---- save -------------------------------------------------------------------------------
    def prepare_save(self, block_ids: Sequence[int], keys: Sequence[str]) -> PendingSave:
        """Before the step runs: pin the blocks its save reads and make the staging it writes."""
        if len(block_ids) != len(keys):
            raise ValueError(f"{len(block_ids)} save blocks but {len(keys)} keys")
        save = PendingSave(tuple(block_ids), tuple(keys), self.cache.make_staging(len(block_ids)))
        if save.block_ids:
            self.alloc.pin(save.block_ids)
        return save

    def cancel(self, save: PendingSave) -> None:
        """The step failed before its save was handed off: nothing is committed, pins go."""
        if save.block_ids:
            self.alloc.unpin(save.block_ids)

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
            for j, key in enumerate(save.keys):
                try:
                    ok = self.pool.put(key, pack_block(save.staging, j))
                except Exception as e:
                    log.warning("pool put failed: %s", e)
                    ok = False
                puts += bool(ok)
                self._count("puts" if ok else "put_failures")  # a failed block is recomputed later
            if obs is not None:
                obs.commit(t0, time.perf_counter(), blocks=len(save.keys), puts=puts)
        finally:
            if save.block_ids:
                self.alloc.unpin(save.block_ids)

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

    def reap(self) -> None:
        while self._pending and self._pending[0].done():
            err = self._pending.popleft().exception()
            if err is not None:
                log.warning("pool commit failed: %s", err)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.host_stream.close()
