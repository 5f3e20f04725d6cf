"""The embedded host-memory pool (the default ``--pool host``): LRU eviction by bytes."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

from .base import PoolBackend, count_leading, deliver

__all__ = ["HostPool"]


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
    refreshed by a successful ``get``, by a ``contains``/``leading_run`` hit and by a duplicate put.
    A value larger than the whole capacity is refused (put returns False) without evicting anything;
    so is one that only evicting leased keys (``pin``, the P/D handoff) would make room for.
    """

    def __init__(self, capacity_bytes: int):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._data: OrderedDict[str, bytes] = OrderedDict()   # oldest first
        self._used = 0
        self._c = dict(puts=0, put_refused=0, put_duplicate=0, evictions=0, evicted_bytes=0,
                       gets=0, get_hits=0, lookups=0, lookup_hits=0)

    @staticmethod
    def _check_key(key: Any) -> str:
        if not isinstance(key, str) or not key:
            raise TypeError(f"pool keys must be non-empty str, got {key!r}")
        return key

    def put(self, key: str, value: bytes) -> bool:
        key = self._check_key(key)
        value = _as_bytes(value)
        size = len(value)
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self._c["put_duplicate"] += 1
                return True
            if size > self.capacity_bytes:
                self._c["put_refused"] += 1
                return False
            if self._used + size > self.capacity_bytes and not self._evict_for(size):
                self._c["put_refused"] += 1   # the rest is leased (a P/D handoff): never evicted
                return False
            self._data[key] = value
            self._used += size
            self._c["puts"] += 1
            return True

    def _evict_for(self, size: int) -> bool:
        """Evict least recently used values, skipping leased keys, until ``size`` more bytes fit;
        False (nothing evicted) when the unleased values cannot make room."""
        held = self.lease_book.held()
        need, victims = self._used + size - self.capacity_bytes, []
        for key, value in self._data.items():   # oldest first
            if need <= 0:
                break
            if key not in held:
                victims.append(key)
                need -= len(value)
        if need > 0:
            return False
        for key in victims:
            old = self._data.pop(key)
            self._used -= len(old)
            self._c["evictions"] += 1
            self._c["evicted_bytes"] += len(old)
        return True

    def get(self, key: str) -> bytes | None:
        key = self._check_key(key)
        with self._lock:
            return self._get(key)

    def _get(self, key: str) -> bytes | None:
        self._c["gets"] += 1
        v = self._data.get(key)
        if v is not None:
            self._data.move_to_end(key)
            self._c["get_hits"] += 1
        return v

    def get_into(self, keys: Sequence[str], dests: Sequence[Any]) -> list[bool]:
        """The contract's ``get_into`` with one lock for all ``keys`` (a 2048-token hit is 127 of
        them, the loader's whole run), not one per key. The values are handed over after the lock
        is released: they are immutable ``bytes``, which a put or an eviction meanwhile only drops
        from the map, so the copy never holds up another thread's put or lookup."""
        if len(dests) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        keys = [self._check_key(k) for k in keys]
        with self._lock:
            values = [self._get(k) for k in keys]
        return [deliver(v, d) for v, d in zip(values, dests)]

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
        return dict(counts, **self.lease_book.stats())

    def __repr__(self) -> str:
        s = self.stats()
        return f"HostPool({s['used_bytes']}/{s['capacity_bytes']} bytes, {s['num_keys']} keys)"
