"""Mooncake Store as the KV pool: a ``PoolBackend`` shared by separate processes through one master.

``MooncakePool("127.0.0.1:50051")`` talks to a running ``mooncake_master`` (start one with
``python -m graphgen.runtime.pool.mooncake_server serve``, see docs/mooncake.md). Blocks live in the
*global segments* that clients contribute; an engine contributes none by default
(``segment_bytes=0``) so its blocks outlive it in the segment that ``mooncake_server`` holds.

Every value is ``header + payload`` (``pool_codec``): a foreign, truncated or corrupt value is
rejected — a miss, recomputed — and counted in ``stats()["rejected"]``. ``get_into`` reads values
into the caller's memory (or hands a view of the registered buffer to a callable): no ``bytes``.

Failure behaviour (the ``PoolBackend`` contract): nothing here raises for a store failure. A put
that fails returns False (``put_failures``; ``segment_full`` for Mooncake's -200), a get that fails
returns None (``get_failures``), a failed existence check reports no hit (``lookup_failures``). An
RPC failure (master down, timeout) marks the pool *down*: it is logged once, every operation then
fails at once without touching the network (``skipped_down``) until a backoff (0.5 s doubling to
``max_backoff_s``) expires; then a TCP probe of the master and a cheap existence query decide
whether it is back (logged once: reconnected). The Mooncake client itself re-registers with a
restarted master; when the first ``setup`` never succeeded, it is retried the same way.

Leases (``pin``, P/D handoff): Mooncake pins only at put; a `LeaseKeeper` renews the master's read
lease (``batch_is_exist``) of leased keys instead. Why and the limits: docs/pd.md "Leases".
"""
from __future__ import annotations

import ctypes
import logging
import socket
import threading
import time
from typing import Any, Callable, Sequence

from .base import Lease, LeaseKeeper, PoolBackend
from .codec import HEADER, check_value, copy_with_checksum, write_header
from .mooncake_options import MooncakeOptions

__all__ = ["MooncakeOptions", "MooncakePool"]

log = logging.getLogger(__name__)

# Mooncake error codes met on this path (mooncake-transfer-engine 0.3.13)
E_NO_SPACE = -200          # no segment has room (NO_AVAILABLE_HANDLE)
E_BUFFER = -600            # a buffer too small / invalid params
E_NOT_FOUND = -704         # OBJECT_NOT_FOUND
E_RPC = -900               # RPC_FAIL: master unreachable or timed out
LEASE_RENEW_S = 1.0        # below the master's default read-lease TTL (default_kv_lease_ttl)


# ---------------------------------------------------------------------------------- the pool

_ALIGN = 64                # values start on cache lines in the registered buffers


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Arena:
    """A pinned (registered) host buffer with its own lock."""

    def __init__(self, nbytes: int):
        self.raw = (ctypes.c_char * nbytes)()
        self.ptr = ctypes.addressof(self.raw)
        self.view = memoryview(self.raw).cast("B")
        self.size = nbytes
        self.lock = threading.Lock()


def _default_store_factory():
    from mooncake.store import MooncakeDistributedStore   # optional dependency: import lazily
    return MooncakeDistributedStore()


class MooncakePool(PoolBackend):
    """A ``PoolBackend`` on Mooncake Store (see the module docstring for values and failures)."""

    _COUNTERS = ("puts", "put_failures", "segment_full", "too_large", "gets", "get_hits",
                 "get_misses", "get_failures", "rejected", "lookups", "lookup_failures", "errors",
                 "skipped_down", "setups", "down_events", "reconnects", "lease_renewals")

    def __init__(self, master: str, options: MooncakeOptions | None = None, *,
                 store_factory: Callable[[], Any] = _default_store_factory):
        host, sep, port = master.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"master must be HOST:PORT, got {master!r}")
        self.master = master
        self._addr = (host, int(port))
        self.options, self._factory = options or MooncakeOptions(), store_factory
        self._lock = threading.Lock()          # state + counters
        self._setup_lock = threading.Lock()
        self._c = dict.fromkeys(self._COUNTERS, 0)
        self._reject_reasons: dict[str, int] = {}
        self._store: Any = None
        self._down, self._retry_at, self._backoff, self._last_error = False, 0.0, 0.5, ""
        self._put, self._get = _Arena(self.options.buffer_bytes), _Arena(self.options.buffer_bytes)
        self._slot = 0                         # largest value seen: get_many's slot size
        self._keeper = LeaseKeeper(self.lease_book, self._renew, LEASE_RENEW_S)
        self._ensure_store()

    # -- state ---------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def _master_reachable(self) -> bool:
        try:
            with socket.create_connection(self._addr, timeout=self.options.probe_timeout_s):
                return True
        except OSError:
            return False

    def _ensure_store(self) -> bool:
        """Set the client up once the master accepts connections (Mooncake's own setup retries
        for ~90 s against a dead master, so it is never called before a TCP probe succeeds)."""
        with self._setup_lock:
            if self._store is not None:
                return True
            if not self._master_reachable():
                self._mark_down(f"master {self.master} not reachable")
                return False
            o = self.options
            try:
                store = self._factory()
                rc = store.setup(o.local_hostname, o.metadata, o.segment_bytes,
                                 o.local_buffer_bytes, o.protocol, o.device, self.master)
                if rc != 0:
                    raise RuntimeError(f"setup returned {rc}")
                for arena in (self._put, self._get):
                    rc = store.register_buffer(arena.ptr, arena.size)
                    if rc != 0:
                        raise RuntimeError(f"register_buffer returned {rc}")
            except Exception as e:   # noqa: BLE001 - any setup failure means: not available yet
                self._count("errors")
                self._mark_down(f"setup failed: {e}")
                return False
            self._store = store
            self._count("setups")
            self._mark_up()
            return True

    def _mark_down(self, why: str) -> None:
        with self._lock:
            self._last_error = why
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.options.max_backoff_s)
            if self._down:
                return
            self._down = True
            self._c["down_events"] += 1
        log.warning("mooncake pool %s unavailable (%s): lookups miss, saves are dropped, "
                    "requests recompute; retrying with backoff up to %.1f s",
                    self.master, why, self.options.max_backoff_s)

    def _mark_up(self) -> None:
        with self._lock:
            was_down, self._down, self._backoff = self._down, False, 0.5
            if was_down:
                self._c["reconnects"] += 1
        if was_down:
            log.warning("mooncake pool %s reachable again", self.master)

    def _available(self):
        """The store when operations may go to it now, else None (counted as skipped)."""
        with self._lock:
            down, retry_at = self._down, self._retry_at
        if down:
            if time.monotonic() < retry_at:
                self._count("skipped_down")
                return None
            if self._store is None:
                if not self._ensure_store():
                    self._count("skipped_down")
                    return None
            elif not self._master_reachable() or not self._probe(self._store):
                self._mark_down(self._last_error or "master not reachable")
                self._count("skipped_down")
                return None
            else:
                self._mark_up()
        elif self._store is None and not self._ensure_store():
            self._count("skipped_down")
            return None
        return self._store

    @staticmethod
    def _probe(store) -> bool:
        try:
            return store.batch_is_exist(["graphgen.probe"])[0] >= 0
        except Exception:   # noqa: BLE001
            return False

    def _failed(self, counter: str, rc: int | str) -> None:
        """Count a store failure; an RPC failure or exception marks the pool down."""
        with self._lock:
            self._c[counter] += 1
            self._c["errors"] += 1
        if not isinstance(rc, int) or rc <= E_RPC:
            self._mark_down(f"error {rc}")

    def _reject(self, reason: str) -> None:
        with self._lock:
            self._c["rejected"] += 1
            self._reject_reasons[reason] = self._reject_reasons.get(reason, 0) + 1

    # -- PoolBackend -----------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> bool:
        return self.put_many([(key, value)])[0]

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Put several values with ``batch_put_from`` from the registered put buffer, in as many
        batches as the buffer needs. One bool per item, as ``put``."""
        ok = [False] * len(items)
        arena = self._put
        todo = []
        for i, (key, value) in enumerate(items):
            if not isinstance(key, str) or not key:
                raise TypeError(f"pool keys must be non-empty str, got {key!r}")
            if HEADER.size + len(value) > arena.size:
                self._count("put_failures")
                self._count("too_large")
            else:
                todo.append(i)
        store = self._available() if todo else None
        if store is None:
            if todo:
                self._count("put_failures", len(todo))
            return ok
        layout = self.options.layout
        with arena.lock:
            while todo:
                off, batch, ptrs, sizes = 0, [], [], []
                while todo:
                    key, value = items[todo[0]]
                    payload = memoryview(value).cast("B")
                    n = HEADER.size + len(payload)
                    if off + n > arena.size:
                        break
                    # one copy into the registered buffer, the checksum over it (still in cache),
                    # the header packed in place: no intermediate bytes
                    csum = copy_with_checksum(arena.view[off + HEADER.size:off + n], payload)
                    write_header(arena.view, off, key, len(payload), csum, layout)
                    batch.append(todo.pop(0)); ptrs.append(arena.ptr + off); sizes.append(n)
                    off = _align(off + n)
                try:
                    rcs = store.batch_put_from([items[i][0] for i in batch], ptrs, sizes)
                except Exception as e:   # noqa: BLE001
                    rcs = [repr(e)] * len(batch)
                for i, rc, n in zip(batch, rcs, sizes):
                    if rc == 0:
                        ok[i] = True
                        self._count("puts")
                        self._slot = max(self._slot, n)
                    elif rc == E_NO_SPACE:
                        self._count("put_failures")
                        self._count("segment_full")
                    else:
                        self._failed("put_failures", rc)
                if any(not isinstance(rc, int) or rc <= E_RPC for rc in rcs):
                    self._count("put_failures", len(todo))   # down: the rest is not tried
                    break
        return ok

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` (None: absent, rejected or failed) with ``batch_get_into`` into the
        registered get buffer, in slots of the largest value size seen (one key alone when none
        was seen yet or a value outgrew its slot); validated in place, copied out once."""
        out: list[bytes | None] = [None] * len(keys)
        self._fetch(keys, lambda i, payload: out.__setitem__(i, bytes(payload)) or True)
        return out

    def get_into(self, keys: Sequence[str], dests: Sequence[Any]) -> list[bool]:
        """``get_many`` without ``bytes``: validated in the registered buffer, then copied once into
        ``dests[i]`` (another size: a miss, rejected ``size``) or handed to a callable ``dests[i]``
        (a view valid during the call). Contract: ``PoolBackend.get_into``."""
        if len(dests) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        ok = [False] * len(keys)

        def take(i: int, payload: memoryview) -> bool:
            dest = dests[i]
            if callable(dest):
                try:
                    ok[i] = dest(payload) is not False
                except Exception as e:   # noqa: BLE001 - the caller's unpack: a miss, not ours
                    log.warning("mooncake pool get_into: destination of %r raised: %s", keys[i], e)
                return ok[i]
            target = memoryview(dest).cast("B")
            if len(target) != len(payload):
                self._reject("size")
                return False
            target[:] = payload
            ok[i] = True
            return True
        self._fetch(keys, take)
        return ok

    def _fetch(self, keys: Sequence[str], take: Callable[[int, memoryview], bool]) -> None:
        """``batch_get_into`` the registered get buffer, validate each value in place and call
        ``take(i, payload_view)`` for the intact ones (under the buffer's lock)."""
        self._count("gets", len(keys))
        store = self._available() if keys else None
        if store is None:
            if keys:
                self._count("get_failures", len(keys))
            return
        arena = self._get
        layout = self.options.layout
        todo = list(range(len(keys)))
        with arena.lock:
            while todo:
                slot = self._slot or arena.size
                per = max(1, arena.size // _align(slot)) if slot <= arena.size else 1
                batch, todo = todo[:per], todo[per:]
                slot = arena.size // len(batch) // _ALIGN * _ALIGN
                try:
                    rcs = store.batch_get_into([keys[i] for i in batch],
                                               [arena.ptr + j * slot for j in range(len(batch))],
                                               [slot] * len(batch))
                except Exception as e:   # noqa: BLE001
                    rcs = [repr(e)] * len(batch)
                for j, (i, rc) in enumerate(zip(batch, rcs)):
                    if isinstance(rc, int) and rc >= 0:
                        value = arena.view[j * slot:j * slot + rc]
                        reason = check_value(keys[i], value, layout)
                        if reason is None:
                            self._slot = max(self._slot, rc)
                            if take(i, value[HEADER.size:]):
                                self._count("get_hits")
                        else:
                            self._reject(reason)
                    elif rc == E_NOT_FOUND:
                        self._count("get_misses")
                    elif rc == E_BUFFER and len(batch) > 1:
                        todo.insert(0, i)        # outgrew its slot: retry alone, whole buffer
                        self._slot = 0
                    else:
                        self._failed("get_failures", rc)
                if any(not isinstance(rc, int) or rc <= E_RPC for rc in rcs):
                    self._count("get_failures", len(todo))
                    break

    def contains(self, key: str) -> bool:
        return self.leading_run([key]) == 1

    def leading_run(self, keys: Sequence[str]) -> int:
        """One ``batch_is_exist`` for all keys; the run of present keys from the first one."""
        keys = list(keys)
        if not keys:
            return 0
        self._count("lookups")
        store = self._available()
        if store is None:
            self._count("lookup_failures")
            return 0
        try:
            found = store.batch_is_exist(keys)
        except Exception as e:   # noqa: BLE001
            self._failed("lookup_failures", repr(e))
            return 0
        n = 0
        for rc in found:
            if rc != 1:
                if rc < 0:
                    self._failed("lookup_failures", rc)
                break
            n += 1
        return n

    def pin(self, keys: Sequence[str], ttl_s: float) -> Lease:
        return self._keeper.pin(keys, ttl_s)   # booked, renewed at once, then each tick

    def _renew(self, keys) -> None:   # batch_is_exist grants each object the master's read lease
        store = self._available()
        try:
            if store is not None and store.batch_is_exist(list(keys)) is not None:
                self._count("lease_renewals")
        except Exception as e:   # noqa: BLE001 - retried next tick
            self._failed("lookup_failures", repr(e))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._c, down=self._down, last_error=self._last_error, master=self.master,
                        local_hostname=self.options.local_hostname,  # the address this client announces
                        reject_reasons=dict(self._reject_reasons), **self.lease_book.stats())

    def close(self) -> None:
        """Unregister and close the client (Mooncake's close waits ~5 s when the master is
        gone; a process that exits without it loses nothing: the values live elsewhere)."""
        self._keeper.stop()
        with self._setup_lock:
            store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:   # noqa: BLE001
                pass

    def __repr__(self) -> str:
        return f"MooncakePool({self.master}, down={self._down})"
