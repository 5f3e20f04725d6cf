"""A save/commit contract that stays right when steps overlap (audit risk 4).

The generated saving graphs copy the blocks they save into a ``staging`` graph input on the save
stream; the pool commit reads staging after the graph.  With ONE staging buffer reused every step, an
engine that launches step N+1 before step N's commit has run (any async engine) commits step N+1's KV
under step N's keys.  Here:

* ``StagingRing``: a fixed set of K persistent staging buffers (fixed addresses: aclgraph replays a
  capture only while its mutated inputs keep their addresses, so K captures at most).  A step takes a
  free buffer; a buffer is free again only when the commit that reads it has completed.  ``acquire``
  never waits: with K >= commits in flight + 1 a free one exists; otherwise it raises (size K up).
* ``Committer``: a host thread per engine; ``submit(wait_saved, index, commit)`` returns at once (the
  next step's launch never waits for a commit); the thread waits for the step's save (an NPU event's
  ``synchronize`` on hardware), commits from that step's buffer, then releases it.

vllm-ascend's alternative (no staging: an event after the KV writes, a thread that puts straight from
the cache blocks, the blocks pinned until the put completes) needs the lowering to drop the staging
copy; see docs/npu.md.  Nothing here ran on an NPU: the tests drive it with the CPU stand-in.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence


class StagingExhausted(RuntimeError):
    """Every staging buffer still has a commit in flight: K is smaller than the commits in flight + 1."""


class StagingRing:
    def __init__(self, buffers: Sequence):
        if not buffers:
            raise ValueError("StagingRing needs at least one staging buffer set")
        self.buffers = list(buffers)
        self._free = list(range(len(self.buffers)))
        self._lock = threading.Lock()

    def acquire(self) -> tuple[int, object]:
        """A staging buffer no commit is reading; never blocks."""
        with self._lock:
            if not self._free:
                raise StagingExhausted(f"all {len(self.buffers)} staging buffers have a commit in flight; "
                                       f"use more buffers (commits in flight + 1)")
            i = self._free.pop(0)
        return i, self.buffers[i]

    def release(self, index: int) -> None:
        with self._lock:
            if index in self._free:
                raise ValueError(f"staging buffer {index} released twice")
            self._free.append(index)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self.buffers) - len(self._free)


class Committer:
    """Host thread running commits in submission order, off the launch path."""

    def __init__(self, ring: StagingRing):
        self.ring = ring
        self._q: queue.Queue = queue.Queue()
        self.errors: list[BaseException] = []
        self._t = threading.Thread(target=self._run, name="graphgen-npu-commit", daemon=True)
        self._t.start()

    def submit(self, wait_saved: Callable[[], None], index: int, commit: Callable[[object], None]) -> None:
        """Queue step's commit: ``wait_saved()`` (the save event), ``commit(staging)``, then release."""
        self._q.put((wait_saved, index, commit))

    def _run(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            wait_saved, index, commit = item
            try:
                wait_saved()
                commit(self.ring.buffers[index])
            except BaseException as e:  # recorded, surfaced by close(): a lost commit must not pass silently
                self.errors.append(e)
            finally:
                self.ring.release(index)
                self._q.task_done()

    def close(self) -> None:
        self._q.join()
        self._q.put(None)
        self._t.join()
        if self.errors:
            raise RuntimeError(f"{len(self.errors)} commit(s) failed: {self.errors[0]!r}") from self.errors[0]
