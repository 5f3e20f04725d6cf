"""The embedded host-memory pool (the default ``--pool host``): LRU eviction by bytes."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Sequence

from .arena import SlotArena
from .base import PoolBackend, count_leading, deliver

__all__ = ["HostPool"]

log = logging.getLogger("graphgen.pool")


def _as_bytes(value: Any) -> bytes:
    # an immutable copy: the caller may reuse/mutate its buffer after put() returns
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"pool values must be bytes-like, got {type(value).__name__}")


class HostPool(PoolBackend):
    """Embedded host-memory pool with LRU eviction by bytes.

    ``capacity_bytes`` bounds the sum of stored value sizes (keys are not counted). Recency is
    refreshed by a successful ``get``/``lend``, by a ``contains``/``leading_run`` hit and by a
    duplicate put. A value larger than the whole capacity is refused (put returns False) without
    evicting anything; so is one that only evicting leased or lent keys (``pin``, the P/D handoff;
    ``lend``, a load reading the pool in place) would make room for.

    Values of the size of the first one put (one cache layout's blocks all have one size) are kept
    in a `SlotArena`, where a save's blocks, put in order, lie back to back: ``lend`` gives such a
    run as one buffer, which a pool hit's load staging is laid over (no copy). Values of other sizes
    are kept as ``bytes``.
    """

    def __init__(self, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        # oldest first; a value is its bytes or, for the arena's size, its arena slot (an int)
        self._data: OrderedDict[str, "bytes | int"] = OrderedDict()
        self._arena: "SlotArena | None | bool" = None   # False: the map could not be made
        self._used = 0
        self._c = dict(puts=0, put_refused=0, put_duplicate=0, evictions=0, evicted_bytes=0,
                       gets=0, get_hits=0, lookups=0, lookup_hits=0)

    @staticmethod
    def _check_key(key: Any) -> str:
        if not isinstance(key, str) or not key:
            raise TypeError(f"pool keys must be non-empty str, got {key!r}")
        return key

    def _size(self, entry: "bytes | int") -> int:
        return self._arena.slot_bytes if isinstance(entry, int) else len(entry)

    def _arena_for(self, size: int) -> SlotArena | None:
        if self._arena is None and 0 < size <= self.capacity_bytes:
            try:
                self._arena = SlotArena(size, self.capacity_bytes // size)
            except (OSError, ValueError, OverflowError) as e:   # cannot map it: keep bytes, as before
                log.warning("host pool: no arena of %d-byte slots (%s); values stay bytes", size, e)
                self._arena = False
        return self._arena if self._arena and self._arena.slot_bytes == size else None

    def put(self, key: str, value: bytes) -> bool:
        key = self._check_key(key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"pool values must be bytes-like, got {type(value).__name__}")
        size = memoryview(value).nbytes
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self._c["put_duplicate"] += 1
                return True
            if size > self.capacity_bytes:
                self._c["put_refused"] += 1
                return False
            if self._used + size > self.capacity_bytes and not self._evict_for(size):
                self._c["put_refused"] += 1   # the rest is leased or lent: never evicted
                return False
            arena = self._arena_for(size)
            slot = arena.alloc() if arena is not None else None
            if slot is None:   # the caller may reuse its buffer after put() returns: a copy
                self._data[key] = _as_bytes(value)
                self._used += size
                self._c["puts"] += 1
                return True
            self._used += size   # the slot is reserved: neither free nor visible while it is filled
        try:   # the copy outside the lock (and the GIL): lookups and loads meanwhile go on
            arena.write(slot, value if isinstance(value, bytes) else _as_bytes(value))
        except BaseException:
            with self._lock:
                arena.free(slot)
                self._used -= size
            raise
        with self._lock:
            if key in self._data:   # another thread put it meanwhile: keep its value
                arena.free(slot)
                self._used -= size
                self._c["put_duplicate"] += 1
            else:
                self._data[key] = slot   # visible from here on, whole
                self._c["puts"] += 1
            return True

    def _evict_for(self, size: int) -> bool:
        """Evict least recently used values, skipping leased keys and lent or read slots, until
        ``size`` more bytes fit; False (nothing evicted) when the others cannot make room. A lent
        slot is never freed while lent: freeing is what lets a later put overwrite it."""
        held = self.lease_book.held()
        busy = self._arena.busy() if self._arena else set()
        need, victims = self._used + size - self.capacity_bytes, []
        for key, entry in self._data.items():   # oldest first
            if need <= 0:
                break
            if key not in held and not (isinstance(entry, int) and entry in busy):
                victims.append(key)
                need -= self._size(entry)
        if need > 0:
            return False
        for key in victims:
            old = self._data.pop(key)
            n = self._size(old)
            if isinstance(old, int):
                self._arena.free(old)
            self._used -= n
            self._c["evictions"] += 1
            self._c["evicted_bytes"] += n
        return True

    def get(self, key: str) -> bytes | None:
        key = self._check_key(key)
        with self._lock:
            return self._copy(self._get(key))

    def _copy(self, entry: "bytes | int | None") -> bytes | None:
        """An entry's value as ``bytes`` (an arena slot copied out; under the lock)."""
        return bytes(self._arena.view(entry)) if isinstance(entry, int) else entry

    def get_many(self, keys: Sequence[str]) -> "list[bytes | None]":
        """``get`` of every key under one lock (the shared pool's proxy answers a load in one round trip)."""
        keys = [self._check_key(k) for k in keys]
        with self._lock:
            return [self._copy(self._get(k)) for k in keys]

    def _get(self, key: str) -> "bytes | int | None":
        self._c["gets"] += 1
        v = self._data.get(key)
        if v is not None:
            self._data.move_to_end(key)
            self._c["get_hits"] += 1
        return v

    def get_into(self, keys: Sequence[str], dests: Sequence[Any]) -> list[bool]:
        """The contract's ``get_into`` with one lock for all ``keys`` (a 2048-token hit is 127 of
        them, the loader's whole run), not one per key. The values are handed over after the lock
        is released, so the copy never holds up another thread's put or lookup: a ``bytes`` value
        is immutable (an eviction only drops it from the map), an arena slot is held (not freed,
        so not overwritten) until the handover is over."""
        if len(dests) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        keys = [self._check_key(k) for k in keys]
        with self._lock:
            entries = [self._get(k) for k in keys]
            slots = [e for e in entries if isinstance(e, int)]
            if slots:
                self._arena.hold(slots)
            values = [self._arena.view(e) if isinstance(e, int) else e for e in entries]
        try:
            return [deliver(v, d) for v, d in zip(values, dests)]
        finally:
            if slots:
                with self._lock:
                    self._arena.unhold(slots)

    def lend(self, keys: Sequence[str]) -> "tuple[int, Any] | None":
        """The contract's ``lend``: the leading ``keys`` whose values lie in consecutive arena slots,
        as ``(n, buffer)``; their recency is refreshed and each counts as a get."""
        keys = [self._check_key(k) for k in keys]
        with self._lock:
            first = self._data.get(keys[0]) if keys else None
            if not isinstance(first, int):
                return None
            arena, n = self._arena, 1
            while n < len(keys) and self._data.get(keys[n]) == first + n:
                n += 1
            for k in keys[:n]:
                self._get(k)
            return n, arena.lend(first, n)

    def contains(self, key: str) -> bool:
        key = self._check_key(key)
        with self._lock:
            return self._lookup(key)

    def _lookup(self, key: str) -> bool:
        self._c["lookups"] += 1
        if key in self._data:
            self._data.move_to_end(key)
            self._c["lookup_hits"] += 1
            return True
        return False

    def leading_run(self, keys: Sequence[str]) -> int:
        # one lock for the whole run: a consistent snapshot, not interleaved with puts/evictions
        keys = [self._check_key(k) for k in keys]
        with self._lock:
            return count_leading(keys, self._lookup)

    def keys(self) -> list[str]:
        """Keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._data)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._c, capacity_bytes=self.capacity_bytes, used_bytes=self._used,
                          num_keys=len(self._data))
            if self._arena:
                counts.update(self._arena.stats())
        return dict(counts, **self.lease_book.stats())

    def __repr__(self) -> str:
        s = self.stats()
        return f"HostPool({s['used_bytes']}/{s['capacity_bytes']} bytes, {s['num_keys']} keys)"
