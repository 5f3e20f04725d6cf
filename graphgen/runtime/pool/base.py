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
* optional ``get_into(keys, dests) -> list[bool]``: values straight into the caller's memory, for a
  backend whose ``get`` would otherwise materialise a ``bytes`` per value (the default loops over
  ``get`` and copies). ``dests[i]`` is a writable buffer of exactly the value's size, or a callable
  given a memoryview of the value (valid only during the call; False from it means not taken).
  One bool per key: True only when the whole value was written / taken; a miss, a size mismatch or
  a callable that raised is False.

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
* Nothing else: no pins, events, staging or layouts cross this interface.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Iterable, Sequence

__all__ = ["PoolBackend", "count_leading"]


class PoolBackend(abc.ABC):
    """Minimal pool interface (see module docstring for the exact contract)."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes) -> bool: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def contains(self, key: str) -> bool: ...

    def leading_run(self, keys: Sequence[str]) -> int:
        """Default: probe one by one. Backends with a batch existence query should override."""
        return count_leading(keys, self.contains)

    def stats(self) -> dict[str, Any]:
        return {}

    def get_into(self, keys: Sequence[str], dests: Sequence[Any]) -> list[bool]:
        """Default: ``get`` each key and copy it into its destination (see the module docstring);
        a backend that can read into its own registered memory overrides this."""
        if len(dests) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        ok = []
        for key, dest in zip(keys, dests):
            value = self.get(key)
            if value is None:
                ok.append(False)
            elif callable(dest):
                try:
                    ok.append(dest(memoryview(value)) is not False)
                except Exception:   # noqa: BLE001 - the caller's unpack failing is a miss
                    ok.append(False)
            else:
                target = memoryview(dest).cast("B")
                if len(target) != len(value):
                    ok.append(False)
                else:
                    target[:] = value
                    ok.append(True)
        return ok


def count_leading(keys: Iterable[str], present: Callable[[str], bool]) -> int:
    """How many of the leading ``keys`` are ``present``, stopping at the first miss."""
    n = 0
    for k in keys:
        if not present(k):
            break
        n += 1
    return n
