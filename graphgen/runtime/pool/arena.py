"""Fixed-size slots in one anonymous memory map: where `HostPool` keeps the values of its block
size, so that a run of blocks put one after another lies back to back and can be lent as one buffer
(`HostPool.lend`: a pool hit's load staging is then a view of the pool, not a copy of it).

The map spans ``max_slots`` slots (the pool's capacity in values) but reserves nothing
(``MAP_NORESERVE`` on Linux): pages are backed only once a put fills them, so the arena holds no
more than the pool does at its fullest. Torch-free: a lent run is a ctypes array over the map,
which exports the buffer protocol and is referenced by every buffer made from it (a memoryview, a
slice of one, a numpy array, a torch tensor's storage): its reference count says whether anything
still reads the run.
"""
from __future__ import annotations

import ctypes
import heapq
import mmap
import sys

__all__ = ["SlotArena", "reference_counts"]

# Linux's MAP_NORESERVE (the same value on every architecture it defines it for); Python 3.11's
# mmap module does not export it
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0


def reference_counts(objs: list) -> list[int]:
    """Each object's reference count, read the same way for an idle probe and for the check (a
    buffer's holders: the arena's lends here, `KVLoader`'s kept staging buffers)."""
    return [sys.getrefcount(o) for o in objs]


class SlotArena:
    """``max_slots`` slots of ``slot_bytes`` (``arena_bytes`` in `stats`: the slots ever filled,
    at most what is backed). Not thread-safe: the pool's lock guards it.

    ``alloc`` prefers the slot after the last one it handed out (a save's blocks, put in order,
    then lie back to back), then the lowest freed slot, then a fresh one. ``lend(first, n)`` gives
    slots ``first .. first + n - 1`` as one writable buffer and books it; ``busy``
    says which slots a live lend (or an open read, ``hold``/``unhold``) covers: the pool must not
    free those, since freeing is what lets a later put overwrite them."""

    def __init__(self, slot_bytes: int, max_slots: int):
        if slot_bytes <= 0 or max_slots <= 0:
            raise ValueError(f"an arena needs slot_bytes > 0 and max_slots > 0, got {slot_bytes}, {max_slots}")
        self.slot_bytes = slot_bytes
        self.max_slots = max_slots
        flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0) | _MAP_NORESERVE
        self._map = mmap.mmap(-1, max_slots * slot_bytes, flags=flags) if flags else mmap.mmap(-1, max_slots * slot_bytes)
        self._view = memoryview(self._map)
        self._base_ref = ctypes.c_ubyte.from_buffer(self._map)   # held: the map stays exported
        self._base = ctypes.addressof(self._base_ref)
        self._fresh = 0            # slots below this were handed out at least once
        self._last = -1            # the slot handed out last
        self._freed: list[int] = []   # a heap of freed slots (lazily deleted: see _free_set)
        self._free_set: set[int] = set()
        self._lent: list[tuple[int, int, object]] = []   # (first slot, n, exporter) per lend
        self._held: dict[int, int] = {}                  # slot -> open reads
        probe = [(0, 0, ctypes.c_ubyte())]   # an exporter only its booking holds, read as busy() reads
        self._idle_refs = reference_counts([entry[2] for entry in probe])[0]
        self.counts = dict(lends=0, lent_slots=0)

    # -- slots ---------------------------------------------------------------------------------
    def view(self, slot: int) -> memoryview:
        """Slot ``slot``'s bytes (a view: valid while the slot holds its value)."""
        return self._view[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def alloc(self) -> int | None:
        """A slot to write a value into, or None when all ``max_slots`` hold values."""
        nxt = self._last + 1
        if nxt in self._free_set:
            self._free_set.discard(nxt)
            slot = nxt
        elif nxt == self._fresh < self.max_slots:
            slot, self._fresh = nxt, nxt + 1
        else:
            slot = None
            while self._freed:
                cand = heapq.heappop(self._freed)
                if cand in self._free_set:
                    self._free_set.discard(cand)
                    slot = cand
                    break
            if slot is None:
                if self._fresh >= self.max_slots:
                    return None
                slot, self._fresh = self._fresh, self._fresh + 1
        self._last = slot
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free_set or not 0 <= slot < self._fresh:
            raise ValueError(f"slot {slot} is not in use")
        self._free_set.add(slot)
        heapq.heappush(self._freed, slot)

    def write(self, slot: int, value: bytes) -> None:
        """Slot ``slot`` := ``value`` (exactly ``slot_bytes``), copied with the GIL released (a
        ctypes call): a commit thread's puts then do not stall the forward thread's Python. Safe
        without the pool's lock for a slot that is allocated and not yet published."""
        if len(value) != self.slot_bytes or not 0 <= slot < self._fresh:
            raise ValueError(f"slot {slot}: a value of {len(value)} bytes, slots hold {self.slot_bytes}")
        ctypes.memmove(self._base + slot * self.slot_bytes, value, self.slot_bytes)

    # -- lends and reads ------------------------------------------------------------------------
    def lend(self, first: int, n: int):
        """Slots ``first .. first + n - 1`` as one ctypes array of their bytes, booked as lent."""
        if n <= 0 or first < 0 or first + n > self._fresh:
            raise ValueError(f"a lend of {n} slots from {first}: only slots below {self._fresh} hold values")
        exporter = (ctypes.c_ubyte * (n * self.slot_bytes)).from_buffer(self._map, first * self.slot_bytes)
        self._prune()   # the bookings stay as many as the live lends, not one per lend ever made
        self._lent.append((first, n, exporter))
        self.counts["lends"] += 1
        self.counts["lent_slots"] += n
        return exporter

    def hold(self, slots) -> None:
        for s in slots:
            self._held[s] = self._held.get(s, 0) + 1

    def unhold(self, slots) -> None:
        for s in slots:
            left = self._held[s] - 1
            if left:
                self._held[s] = left
            else:
                del self._held[s]

    def _prune(self) -> None:
        """Drop the bookings of lends nothing references any more."""
        refs = reference_counts([entry[2] for entry in self._lent])
        self._lent = [entry for entry, r in zip(self._lent, refs) if r > self._idle_refs]

    def busy(self) -> set[int]:
        """Slots a live lend or an open read covers."""
        self._prune()
        out = set(self._held)
        for first, n, _ in self._lent:
            out.update(range(first, first + n))
        return out

    def live_lends(self) -> int:
        self._prune()
        return len(self._lent)

    def stats(self) -> dict[str, int]:
        return dict(self.counts, slot_bytes=self.slot_bytes, slots_mapped=self._fresh,
                    arena_bytes=self._fresh * self.slot_bytes, live_lends=self.live_lends())
