"""A pool with injected put faults (`graphgen.runtime.core.faults.Faults`: ``put_gate``, ``put_delay_s``, ``put_fail``)."""
from __future__ import annotations

import threading
from typing import Any

from ..core.faults import Faults
from .base import PoolBackend

__all__ = ["FaultyPool", "wrap_pool"]


def wrap_pool(backend: PoolBackend, faults: Faults) -> PoolBackend:
    """``backend`` itself when no put fault is set, else a `FaultyPool` around it."""
    if not (faults.put_delay_s or callable(faults.put_fail) or faults.put_fail or faults.put_gate is not None):
        return backend
    return FaultyPool(backend, faults)


class FaultyPool(PoolBackend):
    """Applies ``put_gate`` / ``put_delay_s`` / ``put_fail`` of a `Faults` to any backend.

    A failed put never reaches the inner backend, so nothing of it is visible (a clean failure, as the
    pool contract requires). Reads pass straight through.
    """

    def __init__(self, inner: PoolBackend, faults: Faults):
        self.inner = inner
        self.faults = faults
        self._lock = threading.Lock()
        self._attempts: dict[str, int] = {}
        self.failed_puts = 0

    def put(self, key: str, value: bytes) -> bool:
        with self._lock:
            attempt = self._attempts.get(key, 0)
            self._attempts[key] = attempt + 1
        self.faults.put_sleep()
        if self.faults.put_fails(key, attempt):
            with self._lock:
                self.failed_puts += 1
            return False
        return self.inner.put(key, value)

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def get_into(self, keys, dests) -> list[bool]:
        return self.inner.get_into(keys, dests)

    def lend(self, keys):
        return self.inner.lend(keys)

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def leading_run(self, keys: list[str]) -> int:
        return self.inner.leading_run(keys)

    def pin(self, keys, ttl_s):
        return self.inner.pin(keys, ttl_s)

    def release(self, lease_id: str) -> bool:
        return self.inner.release(lease_id)

    def leases(self) -> int:
        return self.inner.leases()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            failed = self.failed_puts
        return dict(self.inner.stats(), injected_put_failures=failed)
