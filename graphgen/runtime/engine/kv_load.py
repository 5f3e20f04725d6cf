"""The KV connector's scheduler side: which leading blocks of a prompt the pool holds, and those
blocks fetched at admission.

`KVLoader.block_keys` names a prompt's full blocks (model, cache layout, this cache's KV shard:
`graphgen.runtime.pool.keys`), `lookup` counts the leading run the pool holds, `load` fetches it
into load staging (one block each, unpacked and validated there). The request keeps the staged
blocks and its step plan carries them to the runner; the cache itself is written by the prefill's
graph (its ``kv_load`` nodes on the ``kv_load`` stream, ordered against the forward by events). A
request preempted or aborted before its prefill simply drops them. The save side is
`graphgen.runtime.engine.connector.KVConnector`; both bump one `Counters`.

A pool that is down or full costs a recompute, never a request: a lookup that raises counts as no
hit, a load that fails stops the loaded run there. Each is counted (``pool_errors``), none raised.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

from ..core.kvcache import PagedKVCache, unpack_block_into
from ..pool.base import PoolBackend
from ..pool.keys import KVShard, block_keys

__all__ = ["KVLoader", "Counters"]

log = logging.getLogger("graphgen.connector")


class Counters:
    """The connector's counters (both sides), safe to bump from any thread."""

    NAMES = ("puts", "put_failures", "save_failures", "hit_blocks", "loaded_blocks", "pool_errors")

    def __init__(self):
        self._lock = threading.Lock()
        self.values = {n: 0 for n in self.NAMES}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n


class KVLoader:
    def __init__(self, pool: PoolBackend, cache: PagedKVCache, *, model: str, shard: KVShard = KVShard(),
                 stats: "Counters | None" = None):
        self.pool = pool
        self.cache = cache
        self.model = model
        self.shard = shard  # the part of each layer's KV this cache holds (its keys say it)
        self.counters = stats if stats is not None else Counters()

    @property
    def stats(self) -> dict:
        return self.counters.values

    def _count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    def block_keys(self, prompt: Sequence[int]) -> list[str]:
        """Pool keys of the prompt's full blocks (model and cache layout are part of every key)."""
        return block_keys(prompt, self.cache.block_size, model=self.model, layout=self.cache.layout, shard=self.shard)

    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the pool holds; 0 when the pool cannot be asked."""
        try:
            return self.pool.leading_run(list(keys))
        except Exception as e:
            log.warning("pool lookup failed, recomputing: %s", e)
            self._count("pool_errors")
            return 0

    def load(self, keys: Sequence[str]) -> list:
        """Fetch ``keys`` in order into load staging (one block each), stopping at the first block
        that is gone (evicted since the lookup), unreadable or foreign. Returns the leading blocks
        loaded; the rest is recomputed. The cache is not touched: the prefill's graph copies the
        staged blocks in (the step plan carries them there)."""
        staged = [self.cache.make_staging(1) for _ in keys]

        def into(i, s):  # unpack straight from the pool's buffer (one copy); a foreign size is a miss
            def unpack(view):
                try:
                    unpack_block_into(s, 0, view)
                except Exception as e:
                    log.warning("pool block %d unreadable, recomputing from there: %s", i, e)
                    self._count("pool_errors")
                    raise
            return unpack

        try:  # one batch: a backend with registered memory (Mooncake) reads every block in one call
            ok = self.pool.get_into(list(keys), [into(i, s) for i, s in enumerate(staged)])
        except Exception as e:
            log.warning("pool load failed, recomputing: %s", e)
            self._count("pool_errors")
            ok = []
        loaded = []
        for hit, s in zip(ok, staged):
            if not hit:  # gone since the lookup, unreadable or foreign: recompute from here
                break
            loaded.append(s)
        self._count("hit_blocks", len(loaded))
        self._count("loaded_blocks", len(loaded))
        return loaded
