"""The embedded host pool shared by rank processes: one pool process behind a loopback
`multiprocessing` manager (authkey-protected, 127.0.0.1 only), and `RemotePool`, the `PoolBackend`
a rank process holds (a manager proxy; every call is a round trip, so a commit's puts and a load's gets
go as one call each: ``put_many`` / ``get_many``)."""
from __future__ import annotations

import socket
from multiprocessing import connection, managers
from multiprocessing.managers import BaseManager

from .base import PoolBackend, deliver
from .host import HostPool

__all__ = ["RemotePool", "connect_pool", "serve_pool"]


def _no_delay(conn: connection.Connection) -> connection.Connection:
    """TCP_NODELAY on a manager connection. multiprocessing sends a message over 16 KiB as its 4-byte
    header, then the body: with Nagle on, the body's last partial segment waits for the header's ACK,
    which the peer delays (up to 40 ms on Linux) - a stall on most 64 KiB block puts and gets."""
    s = socket.socket(fileno=conn.fileno())
    try:
        if s.family in (socket.AF_INET, socket.AF_INET6):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        s.detach()   # the connection keeps its descriptor
    return conn


class _NoDelayListener(connection.Listener):
    def accept(self) -> connection.Connection:
        return _no_delay(super().accept())


def _no_delay_client(address, family=None, authkey=None) -> connection.Connection:
    return _no_delay(connection.Client(address, family, authkey))


# the pool manager's (and its proxies') connections: pickle, as the default, with TCP_NODELAY on both ends
_SERIALIZER = "graphgen-nodelay"
managers.listener_client[_SERIALIZER] = (_NoDelayListener, _no_delay_client)  # type: ignore[attr-defined]


class _PoolManager(BaseManager):
    def __init__(self, address=None, authkey=None):
        super().__init__(address=address, authkey=authkey, serializer=_SERIALIZER)


_SHARED_POOL = None
GET_BATCH_BYTES = 256 << 10   # a load's gets go about this many bytes per round trip (see COMMIT_BATCH_BYTES)


def _shared_pool():
    return _SHARED_POOL


def serve_pool(capacity: int, address, authkey: bytes, ready) -> None:  # pragma: no cover - own process
    global _SHARED_POOL
    _SHARED_POOL = HostPool(capacity)
    _PoolManager.register("pool", callable=_shared_pool)
    server = _PoolManager(address=address, authkey=authkey).get_server()
    ready.set()
    server.serve_forever()


class RemotePool(PoolBackend):
    """The shared host pool as a rank process sees it (a manager proxy; every call is a round trip).
    ``get_into`` fetches every value in one ``get_many`` and hands them over here: its destinations
    (buffers, unpack callables) cannot cross processes."""

    def __init__(self, proxy):
        self._proxy = proxy
        self._value_bytes = 0   # the largest value seen: get_many asks for about GET_BATCH_BYTES per call

    def put(self, key, value) -> bool:
        return self._proxy.put(key, value)

    def get(self, key):
        return self._proxy.get(key)

    def put_many(self, items) -> list:
        return self._proxy.put_many(list(items))

    def get_many(self, keys) -> list:
        todo, out = list(keys), []  # type: list[str], list[bytes | None]
        while len(out) < len(todo):
            n = max(1, GET_BATCH_BYTES // self._value_bytes) if self._value_bytes else 1
            got = self._proxy.get_many(todo[len(out):len(out) + n])
            self._value_bytes = max([self._value_bytes] + [len(v) for v in got if v is not None])
            out += got
        return out

    def get_into(self, keys, dests) -> list:
        if len(dests) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        return [deliver(v, d) for v, d in zip(self.get_many(keys), dests)]

    def contains(self, key) -> bool:
        return self._proxy.contains(key)

    def leading_run(self, keys) -> int:
        return self._proxy.leading_run(list(keys))

    def stats(self) -> dict:
        return self._proxy.stats()

    def pin(self, keys, ttl_s):   # the leases live in the pool process, with its eviction
        return self._proxy.pin(list(keys), ttl_s)

    def release(self, lease_id) -> bool:
        return self._proxy.release(lease_id)

    def leases(self) -> int:
        return self._proxy.leases()


def connect_pool(address, authkey: bytes) -> RemotePool:
    _PoolManager.register("pool")
    m = _PoolManager(address=address, authkey=authkey)
    m.connect()
    return RemotePool(m.pool())
