"""The KV connector's scheduler side: which leading blocks of a prompt the pool holds, and those
blocks fetched at admission.

`KVLoader.block_keys` names a prompt's full blocks (model, cache layout, this cache's KV shard:
`graphgen.runtime.pool.keys`), `lookup` counts the leading run the pool holds, `load` fetches it
into one load staging for the whole run (`LoadedBlocks`: each block unpacked and validated into its
row, one memcpy from the pool's buffer) — or, where the pool lends the run (`PoolBackend.lend`:
HostPool's arena), lays the staging over the pool's own memory, with no copy. The request keeps the staged blocks and its step plan
carries them to the runner, which hands the run's per-layer views to the graph without a copy; the cache itself is written by the prefill's
graph (its ``kv_load`` nodes on the ``kv_load`` stream, ordered against the forward by events). A
request preempted or aborted before its prefill simply drops them. The save side is
`graphgen.runtime.engine.connector.KVConnector`; both bump one `Counters`.

A pool that is down or full costs a recompute, never a request: a lookup that raises counts as no
hit, a load that fails stops the loaded run there. Each is counted (``pool_errors``), none raised.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence

import numpy
import torch

from ..core.kvcache import PagedKVCache, block_nbytes, unpack_block_into
from ..pool.arena import reference_counts
from ..pool.base import PoolBackend
from ..pool.keys import KVShard, block_keys

__all__ = ["KVLoader", "Counters", "LoadedBlocks", "StagingBuffers"]

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


class LoadedBlocks(Sequence):
    """The blocks one load fetched, in key order: rows ``[start, stop)`` of one load staging (per
    layer, per component ``[n, *shape]``: a host `PackedStaging` of the whole run, so a 127-block
    hit is one staging, not 127). ``layers()`` gives the run per layer, per component ``[len, *shape]``
    as views (what the CPU graph's kv_load copies into the cache: no stacking copy); item ``j`` is
    block j's own staging (``[1, *shape]`` views, made on demand: what a target that stages block by
    block reads); a slice is the same kind of run (a load cut short, the ranks' agreed length)."""

    __slots__ = ("staging", "start", "stop")

    def __init__(self, staging: list, start: int = 0, stop: "int | None" = None):
        n = staging[0][0].shape[0] if staging else 0
        self.staging, self.start, self.stop = staging, start, n if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, j):
        if isinstance(j, slice):
            a, b, step = j.indices(len(self))
            if step != 1:
                raise ValueError("a run of loaded blocks is sliced without a step")
            return LoadedBlocks(self.staging, self.start + a, self.start + max(a, b))
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(f"block {j} of a run of {len(self)} loaded blocks")
        i = self.start + j
        return [tuple(t[i:i + 1] for t in layer) for layer in self.staging]

    def layers(self) -> list:
        """The run per layer, per component ``[len(self), *shape]`` (views of the staging)."""
        if not self.staging or (self.start == 0 and self.stop == self.staging[0][0].shape[0]):
            return list(self.staging)
        return [tuple(t[self.start:self.stop] for t in layer) for layer in self.staging]

    def __repr__(self) -> str:
        return f"LoadedBlocks({len(self)} blocks)"


class StagingBuffers:
    """Host buffers that load stagings are laid over, kept for later loads: a fresh staging of a
    long hit (12 MiB at 2048 tokens of the long-prompt benchmark) is mapped anew by the allocator,
    and its page faults cost more than the copy into it (issue 17 (a): the load's median 8 ms,
    2 ms into mapped pages). A buffer is taken again only once nothing over its last staging is
    alive: every tensor laid over it holds the numpy array through its storage (``from_numpy``), so
    the array's reference count says whether a request, a plan or a graph still reads it. At most
    ``limit_bytes`` are kept; a bigger staging is allocated as before."""

    def __init__(self, limit_bytes: int = 64 << 20):
        self.limit_bytes = limit_bytes
        self._arrays: list = []
        self._lock = threading.Lock()
        self._idle_refs = reference_counts([numpy.empty(1, dtype=numpy.uint8)])[0]  # a buffer nobody else holds

    def take(self, nbytes: int) -> "torch.Tensor | None":
        """A uint8 tensor of at least ``nbytes`` over a buffer nothing reads; None past the limit."""
        if nbytes > self.limit_bytes:
            return None
        with self._lock:
            free = [i for i, n in enumerate(reference_counts(self._arrays)) if n <= self._idle_refs]
            fit = [i for i in free if self._arrays[i].nbytes >= nbytes]
            if fit:
                return torch.from_numpy(self._arrays[fit[0]])
            for i in reversed(free):  # free but too small: make room
                del self._arrays[i]
            if sum(a.nbytes for a in self._arrays) + nbytes > self.limit_bytes:
                return None
            self._arrays.append(numpy.empty(nbytes, dtype=numpy.uint8))
            return torch.from_numpy(self._arrays[-1])


class KVLoader:
    def __init__(self, pool: PoolBackend, cache: PagedKVCache, *, model: str, shard: KVShard = KVShard(),
                 stats: "Counters | None" = None):
        self.pool = pool
        self.cache = cache
        self.buffers = StagingBuffers()  # what load stagings are laid over, reused (no page faults)
        self.model = model
        self.shard = shard  # the part of each layer's KV this cache holds (its keys say it)
        self.counters = stats if stats is not None else Counters()

    @property
    def stats(self) -> dict:
        return self.counters.values

    def _count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    def block_keys(self, prompt: Sequence[int], salt: str = "") -> list[str]:
        """Pool keys of the prompt's full blocks (model and cache layout are part of every key; ``salt``: the
        LoRA adapter's digest the KV is computed under, `graphgen.runtime.pool.keys`)."""
        return block_keys(prompt, self.cache.block_size, model=self.model, layout=self.cache.layout, shard=self.shard,
                          salt=salt)

    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the pool holds; 0 when the pool cannot be asked."""
        try:
            return self.pool.leading_run(list(keys))
        except Exception as e:
            log.warning("pool lookup failed, recomputing: %s", e)
            self._count("pool_errors")
            return 0

    def load(self, keys: Sequence[str]) -> "LoadedBlocks":
        """Fetch ``keys`` in order into one load staging (block i in row i), stopping at the first
        block that is gone (evicted since the lookup), unreadable or foreign. Returns the leading
        blocks loaded; the rest is recomputed. The cache is not touched: the prefill's graph copies
        the staged blocks in (the step plan carries them there). A run the pool lends whole
        (`PoolBackend.lend`: HostPool's arena) is the staging itself, read in place: no copy here."""
        lent = self._lent(keys)
        if lent is not None:
            return lent
        buffer = self.buffers.take(len(keys) * block_nbytes(self.cache)) if keys else None
        staging = self.cache.make_staging(len(keys), zeroed=False, buffer=buffer)  # a row is read only once loaded
        del buffer  # the staging holds it while it lives

        def unpack(i, view):  # straight from the pool's buffer into row i (one copy); a foreign size is a miss
            try:
                unpack_block_into(staging, i, view)
            except Exception as e:
                log.warning("pool block %d unreadable, recomputing from there: %s", i, e)
                self._count("pool_errors")
                raise

        try:  # one batch: a backend with registered memory (Mooncake) reads every block in one call
            # (a partial per block: a 2048-token hit's 127 destinations, no closure built per block)
            ok = self.pool.get_into(list(keys), [functools.partial(unpack, i) for i in range(len(keys))])
        except Exception as e:
            log.warning("pool load failed, recomputing: %s", e)
            self._count("pool_errors")
            ok = []
        n = 0
        for hit in ok[:len(keys)]:
            if not hit:  # gone since the lookup, unreadable or foreign: recompute from here
                break
            n += 1
        self._count("hit_blocks", n)
        self._count("loaded_blocks", n)
        return LoadedBlocks(staging, 0, n)

    def _lent(self, keys: Sequence[str]) -> "LoadedBlocks | None":
        """``keys``' values as a load staging laid over the pool's own memory, when the pool lends
        them all back to back in this cache's layout (a host cache: the graph's kv_load reads the
        staging); else None, and ``load`` copies. The staging's tensors hold the pool's buffer, so
        the pool keeps those values (neither evicted nor overwritten) until the last of them is gone:
        the plan that carries them has run, or the request was preempted or aborted."""
        if not keys or self.cache.layer(0)[0].device.type != "cpu":
            return None
        try:
            got = self.pool.lend(list(keys))
        except Exception as e:
            log.warning("pool lend failed, copying instead: %s", e)
            self._count("pool_errors")
            return None
        if got is None:
            return None
        n, memory = got
        if n != len(keys) or memoryview(memory).nbytes != n * block_nbytes(self.cache):
            return None   # a partial run (the rest elsewhere, or gone) or a foreign size: copy and check
        staging = self.cache.make_staging(n, zeroed=False, buffer=torch.frombuffer(memory, dtype=torch.uint8))
        self._count("hit_blocks", n)
        self._count("loaded_blocks", n)
        return LoadedBlocks(staging, 0, n)
