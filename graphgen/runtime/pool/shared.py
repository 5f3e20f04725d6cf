"""The embedded host pool shared by rank processes: one pool process behind a loopback
`multiprocessing` manager (authkey-protected, 127.0.0.1 only), and `RemotePool`, the `PoolBackend`
a rank process holds (a manager proxy; every call is a round trip)."""
from __future__ import annotations

from multiprocessing.managers import BaseManager

from .base import PoolBackend
from .host import HostPool

__all__ = ["RemotePool", "connect_pool", "serve_pool"]


class _PoolManager(BaseManager):
    pass


_SHARED_POOL = None


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
    ``get_into`` stays the contract's default, run here: its destinations (buffers, unpack callables)
    cannot cross processes."""

    def __init__(self, proxy):
        self._proxy = proxy

    def put(self, key, value) -> bool:
        return self._proxy.put(key, value)

    def get(self, key):
        return self._proxy.get(key)

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
