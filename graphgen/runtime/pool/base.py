"""KV block pool: the backend interface (backends: `host`, `mooncake`, `shared`, `faulty`; keys: `keys`).

A pool maps a **block key** (str) to the packed bytes of one KV block over all layers and components
on one rank (see `graphgen.runtime.core.kvcache.pack_block`). The contract every backend implements
(`PoolBackend`) is deliberately small so a distributed backend (Mooncake Store) can implement it:

* ``put(key, value) -> bool``: store; False on failure (never raises for an ordinary failure). A key is
  visible to readers only once ``put`` returned True — never partially. A put of a key already present
  is harmless: it keeps the old value (blocks are content-addressed, so both values are equal) and
  returns True.
* ``get(key) -> bytes | None``: the value, or None when absent (evicted, never put, failed put).
* ``contains(key) -> bool``.
* ``leading_run(keys) -> int``: how many of the leading keys are present, stopping at the first miss
  (a prefix hit is only usable as a contiguous run from block 0).
* ``stats() -> dict``: counters for logs/benchmarks; keys are backend-specific.
* ``put_many(items) -> list[bool]`` / ``get_many(keys) -> list[bytes | None]``: ``put`` / ``get`` of
  several keys at once, one bool / value per key, for a backend where each call is a round trip (the
  shared pool's proxy, Mooncake's RPCs): the defaults loop (a ``put`` that raised is False, logged).
  The connector puts a commit's blocks with ``put_many``.
* optional ``get_into(keys, dests) -> list[bool]``: values straight into the caller's memory, for a
  backend whose ``get`` would otherwise materialise a ``bytes`` per value (the default loops over
  ``get`` and copies). ``dests[i]`` is a writable buffer of exactly the value's size, or a callable
  given a memoryview of the value (valid only during the call; False from it means not taken).
  One bool per key: True only when the whole value was written / taken; a miss, a size mismatch or
  a callable that raised is False.
* optional ``lend(keys) -> (n, buffer) | None``: the leading ``n >= 1`` values of ``keys`` read in
  place, for a backend that keeps them back to back in its own memory (HostPool's arena): ``buffer``
  exports the buffer protocol and holds the ``n`` values one after another. The backend neither
  evicts nor overwrites them while ``buffer``, or anything made from it (a memoryview or a slice of
  one, a numpy array, a tensor's storage), is alive; the caller must not write it. None (the
  default) when the first value is absent or not held that way: the caller then copies
  (``get_into``). Each lent value counts as a get.

All methods are thread-safe. A hit reported by ``contains``/``leading_run`` may still be evicted
before ``get``: callers must treat a None from ``get`` as a miss and recompute.

What the caller (`graphgen.runtime.engine.connector.KVConnector`) guarantees a backend, and expects:

* ``put`` is called only after the save that filled the value completed (its event was recorded),
  from the connector's host stream (one thread); lookups and gets come from the engine's thread.
* Any exception from any method is treated like an ordinary failure — a lookup or get that raises
  is a miss from there on, a put that raises is a failed put — counted, logged, and paid for with a
  recompute, never with the request. A backend for a remote store may therefore raise on a lost
  connection instead of catching it.
* A value the cache cannot take (wrong size: a foreign or truncated block) is rejected by the
  loader (`kvcache.unpack_block_into`) and recomputed; a backend that can detect corruption itself
  (a checksum) should return None from ``get`` instead.
* Nothing else: no events, staging or layouts cross this interface.

Leases (the P/D handoff, docs/pd.md): ``pin(keys, ttl_s) -> Lease`` protects ``keys`` from the
pool's eviction until ``release(lease_id)`` or ``ttl_s`` has passed (a key pinned before its put is
protected from the put on); ``release`` returns False for an unknown or expired lease. ``leases()``
counts the live ones. The default (`LeaseBook`) only books them — a backend that evicts overrides
``protects`` (HostPool: eviction skips leased keys; MooncakePool: the master's own read lease is
renewed while the lease lives). ``pin`` never raises for a store failure: the lease is booked anyway.
"""
from __future__ import annotations

import abc
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

log = logging.getLogger(__name__)

__all__ = ["Lease", "LeaseBook", "LeaseKeeper", "PoolBackend", "count_leading", "deliver"]


@dataclass(frozen=True)
class Lease:
    """Keys held in a pool until ``expires_ms`` (wall clock, ms since the epoch: it crosses processes)."""

    lease_id: str
    keys: tuple[str, ...]
    expires_ms: int


class LeaseBook:
    """Live leases and the keys they hold (expired ones drop out lazily, counted). Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._held: dict[str, int] = {}     # key -> live leases holding it
        self.counts = dict(pinned=0, released=0, expired=0)

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _expire(self) -> None:
        now = self._now_ms()
        for lease in [l for l in self._leases.values() if l.expires_ms <= now]:
            self._drop(lease.lease_id)
            self.counts["expired"] += 1

    def _drop(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id)
        for k in lease.keys:
            left = self._held[k] - 1
            if left:
                self._held[k] = left
            else:
                del self._held[k]

    def pin(self, keys: Sequence[str], ttl_s: float) -> Lease:
        if not ttl_s > 0:
            raise ValueError(f"a lease needs ttl_s > 0, got {ttl_s!r}")
        with self._lock:
            self._expire()
            lease = Lease(uuid.uuid4().hex, tuple(keys), self._now_ms() + int(ttl_s * 1000))
            self._leases[lease.lease_id] = lease
            for k in lease.keys:
                self._held[k] = self._held.get(k, 0) + 1
            self.counts["pinned"] += 1
            return lease

    def release(self, lease_id: str) -> bool:
        with self._lock:
            self._expire()
            if lease_id not in self._leases:
                return False
            self._drop(lease_id)
            self.counts["released"] += 1
            return True

    def held(self) -> set[str]:
        """The keys under a live lease now."""
        with self._lock:
            self._expire()
            return set(self._held)

    def live(self) -> int:
        with self._lock:
            self._expire()
            return len(self._leases)

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._expire()
            return dict(self.counts, leases=len(self._leases), leased_keys=len(self._held))


class LeaseKeeper:
    """A daemon thread that calls ``renew(keys)`` with the keys under a live lease every
    ``interval_s`` (a store whose protection must be refreshed: Mooncake's read lease)."""

    def __init__(self, book: LeaseBook, renew: Callable[[list[str]], None], interval_s: float):
        self._book, self._renew, self._interval = book, renew, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def pin(self, keys: Sequence[str], ttl_s: float) -> Lease:
        """Book a lease, renew its keys at once, and keep renewing every live lease's keys."""
        lease = self._book.pin(list(keys), ttl_s)
        if lease.keys:
            self._renew(list(lease.keys))
        self.start()
        return lease

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="pool-leases", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            keys = sorted(self._book.held())
            if keys:
                self._renew(keys)

    def stop(self) -> None:
        self._stop.set()


class PoolBackend(abc.ABC):
    """Minimal pool interface (see module docstring for the exact contract)."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes) -> bool: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def contains(self, key: str) -> bool: ...

    def put_many(self, items: Sequence[tuple[str, Any]]) -> list[bool]:
        """Default: ``put`` each; one that raised is False (an ordinary failure, logged), the rest go on."""
        out = []
        for key, value in items:
            try:
                out.append(bool(self.put(key, value)))
            except Exception as e:   # noqa: BLE001 - the contract: a put that raises is a failed put
                log.warning("pool put of %r failed: %s", key, e)
                out.append(False)
        return out

    def get_many(self, keys: Sequence[str]) -> "list[bytes | None]":
        """Default: ``get`` each."""
        return [self.get(k) for k in keys]

    def leading_run(self, keys: Sequence[str]) -> int:
        """Default: probe one by one. Backends with a batch existence query should override."""
        return count_leading(keys, self.contains)

    def stats(self) -> dict[str, Any]:
        return {}

    # -- leases (see the module docstring) --------------------------------------------------
    @property
    def lease_book(self) -> LeaseBook:
        book = self.__dict__.get("_lease_book")
        if book is None:
            book = self.__dict__.setdefault("_lease_book", LeaseBook())
        return book

    def pin(self, keys: Sequence[str], ttl_s: float) -> Lease:
        return self.lease_book.pin(list(keys), ttl_s)

    def release(self, lease_id: str) -> bool:
        return self.lease_book.release(lease_id)

    def leases(self) -> int:
        return self.lease_book.live()

    def lend(self, keys: Sequence[str]) -> "tuple[int, Any] | None":
        """Default: nothing is lent (see the module docstring); the caller copies instead."""
        return None

    def get_into(self, keys: Sequence[str], dests: Sequence[Any]) -> list[bool]:
        """Default: ``get`` each key and copy it into its destination (see the module docstring);
        a backend that can read into its own registered memory overrides this."""
        if len(dests) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        return [deliver(self.get(key), dest) for key, dest in zip(keys, dests)]


def deliver(value: "bytes | None", dest: Any) -> bool:
    """``get_into``'s handover of one value (None: a miss) to its destination: a callable is given a
    memoryview (False from it, or an exception, means not taken), a buffer of exactly the value's
    size gets a copy. True only when the value was taken / written whole."""
    if value is None:
        return False
    if callable(dest):
        try:
            return dest(memoryview(value)) is not False
        except Exception:   # noqa: BLE001 - the caller's unpack failing is a miss
            return False
    target = memoryview(dest).cast("B")
    if len(target) != len(value):
        return False
    target[:] = value
    return True


def count_leading(keys: Iterable[str], present: Callable[[str], bool]) -> int:
    """How many of the leading ``keys`` are ``present``, stopping at the first miss."""
    n = 0
    for k in keys:
        if not present(k):
            break
        n += 1
    return n
