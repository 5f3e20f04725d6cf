"""KV block pool: the backend interface, the embedded host-memory backend, and block keys.

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
import hashlib
import struct
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

__all__ = ["PoolBackend", "HostPool", "block_keys", "count_leading", "KEY_SEP"]


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
    A value larger than the whole capacity is refused (put returns False) without evicting anything.
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
            while self._used + size > self.capacity_bytes:
                _, old = self._data.popitem(last=False)
                self._used -= len(old)
                self._c["evictions"] += 1
                self._c["evicted_bytes"] += len(old)
            self._data[key] = value
            self._used += size
            self._c["puts"] += 1
            return True

    def get(self, key: str) -> bytes | None:
        key = self._check_key(key)
        with self._lock:
            self._c["gets"] += 1
            v = self._data.get(key)
            if v is not None:
                self._data.move_to_end(key)
                self._c["get_hits"] += 1
            return v

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
            return dict(self._c, capacity_bytes=self.capacity_bytes, used_bytes=self._used,
                        num_keys=len(self._data))

    def __repr__(self) -> str:
        s = self.stats()
        return f"HostPool({s['used_bytes']}/{s['capacity_bytes']} bytes, {s['num_keys']} keys)"


# ------------------------------------------------------------------------------------------ keys

KEY_SEP = "@"
# root of every hash chain; versioned so a change of the hashing scheme never matches old keys
_CHAIN_ROOT = hashlib.sha256(b"graphgen.block_keys.v1").digest()


def block_keys(token_ids: Iterable[int], block_size: int, *, model: str, layout: str,
               rank: int = 0, world: int = 1) -> list[str]:
    """One pool key per FULL block of ``token_ids`` (a trailing partial block gets no key).

    Block i's digest is ``sha256(digest[i-1] + token ids of block i as little-endian int64)``, so a
    key identifies the whole prefix up to and including its block: two prompts share key i only if
    they agree on every token of blocks 0..i. Stable across processes and ``PYTHONHASHSEED``
    (never Python ``hash()``). The key is ``{model}@{layout}@r{rank}of{world}@{hexdigest}`` so
    different models, cache layouts (dtype/shape version, see ``kvcache.layout_version``) and ranks
    never collide. ``model``/``layout`` must not contain ``@`` (that would make keys ambiguous).
    Which blocks to save or look up (e.g. at most ``(len - 1) // block_size``, so the last token is
    always recomputed) is the caller's choice: slice the result.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
    for what, s in (("model", model), ("layout", layout)):
        if not isinstance(s, str) or not s or KEY_SEP in s:
            raise ValueError(f"{what} must be a non-empty str without {KEY_SEP!r}, got {s!r}")
    if not (isinstance(rank, int) and isinstance(world, int) and world >= 1 and 0 <= rank < world):
        raise ValueError(f"need 0 <= rank < world, got rank={rank!r} world={world!r}")
    if hasattr(token_ids, "tolist"):          # torch / numpy without importing either
        token_ids = token_ids.tolist()
    ids = [int(t) for t in token_ids]
    prefix = f"{model}{KEY_SEP}{layout}{KEY_SEP}r{rank}of{world}{KEY_SEP}"
    pack = struct.Struct(f"<{block_size}q").pack   # raises struct.error outside int64
    keys: list[str] = []
    parent = _CHAIN_ROOT
    for b in range(len(ids) // block_size):
        parent = hashlib.sha256(parent + pack(*ids[b * block_size:(b + 1) * block_size])).digest()
        keys.append(prefix + parent.hex())
    return keys
