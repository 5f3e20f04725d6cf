"""The KV connector on its own: load from the pool, the save handoff and its ordering, pins, and a
pool that is down. The 'save program' here is a job on a real save stream that fills the staging
and records the save's event, as a generated module's does; what is pooled is compared to
``pack_block`` of that staging (the format's own definition, tested in test_kvcache.py)."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from graphgen.runtime.core import ops
from graphgen.runtime.engine.connector import KVConnector
from graphgen.runtime.engine.kv_load import Counters, KVLoader
from graphgen.runtime.core.kvcache import BlockAllocator, PagedKVCache, pack_block
from graphgen.runtime.pool import HostPool, PoolBackend
from graphgen.runtime.core.streams import EventSet, Stream

SHAPES = {"k": (4, 2, 3), "v": (4, 2, 3)}


class TimedPool(HostPool):
    def __init__(self):
        super().__init__(1 << 20)
        self.put_at: list[float] = []

    def put(self, key, value):
        self.put_at.append(time.perf_counter())
        return super().put(key, value)


class CopyingPool(HostPool):
    """A host pool that lends nothing: loads copy into a staging (the path of every other backend)."""

    lend = PoolBackend.lend


class DownPool(PoolBackend):
    """A pool whose every call raises (a remote store that went away)."""

    def put(self, key, value):
        raise ConnectionError("pool down")

    def get(self, key):
        raise ConnectionError("pool down")

    def contains(self, key):
        raise ConnectionError("pool down")

    def stats(self):
        raise ConnectionError("pool down")


@pytest.fixture
def parts():
    cache = PagedKVCache(2, SHAPES, 8, torch.float32)
    alloc = BlockAllocator(8)
    save_stream = Stream("kv_save")
    yield cache, alloc, save_stream
    save_stream.close(timeout=2)


class Conn(KVConnector):
    """Both sides of the connector over one pool and one set of counters, as an engine wires them."""

    def __init__(self, pool, cache, alloc, write):
        counters = Counters()
        super().__init__(pool, cache, alloc, write=write, stats=counters)
        self.loader = KVLoader(pool, cache, model="m", stats=counters)
        self.block_keys, self.lookup, self.load = self.loader.block_keys, self.loader.lookup, self.loader.load


def make(pool, cache, alloc, write="async"):
    return Conn(pool, cache, alloc, write)


def fill(staging, seed):
    for layer in staging:
        for t in layer:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))


def launch_save(stream, staging, ev, gate=None, record=True):
    """A save program: wait for the gate (a slow save), fill staging, record the save's event."""
    def program():
        if gate is not None:
            assert gate.wait(5)
        fill(staging, 3)
        if record:
            ev.record()
    return stream.launch(program)


def test_put_only_after_the_save_event_and_pins_held_until_the_commit(parts):
    cache, alloc, save_stream = parts
    pool = TimedPool()
    conn = make(pool, cache, alloc)
    ids = alloc.alloc(2)
    keys = conn.block_keys(list(range(9)))[:2]
    save = conn.prepare_save(ids, keys)
    assert all(alloc.is_pinned(i) for i in ids)
    # async: the staging is a memfd mapping (the commit reads it with the GIL released), so what is
    # pooled below went through os.pread of the rows the save program wrote through the views
    assert (save.staging.fd is not None) == hasattr(os, "memfd_create")
    ev = EventSet(["ev.save"], default_timeout=5).bind(1)["ev.save"]
    gate = threading.Event()
    job = launch_save(save_stream, save.staging, ev, gate, record=False)
    conn.handoff(save, job, ev)             # async: returns at once
    alloc.free(ids)                         # the request finished: the blocks must stay out of reuse
    gate.set()
    job.wait(5)
    time.sleep(0.05)                        # the save job is done, but its event is not recorded yet
    assert len(pool) == 0 and all(alloc.is_pinned(i) for i in ids) and alloc.num_free == 6
    recorded_at = time.perf_counter()
    ev.record()
    conn.drain(5)
    assert min(pool.put_at) >= recorded_at  # the event, not the job's end, opens the commit
    assert [pool.get(k) for k in keys] == [pack_block(save.staging, 0), pack_block(save.staging, 1)]
    assert not any(alloc.is_pinned(i) for i in ids) and alloc.num_free == 8
    assert conn.stats["puts"] == 2 and conn.pending == 0
    conn.close()


def test_sync_commits_before_handoff_returns(parts):
    cache, alloc, save_stream = parts
    pool = HostPool(1 << 20)
    conn = make(pool, cache, alloc, write="sync")
    ids = alloc.alloc(1)
    save = conn.prepare_save(ids, conn.block_keys(range(4)))
    assert save.staging.fd is None  # sync: torch memory, the cheaper numpy row copy
    ev = EventSet(["ev.save"], default_timeout=5).bind(1)["ev.save"]
    conn.handoff(save, launch_save(save_stream, save.staging, ev), ev)
    assert len(pool) == 1 and not alloc.is_pinned(ids[0]) and conn.pending == 0
    conn.close()


def test_failed_save_commits_nothing_and_releases_pins(parts):
    cache, alloc, save_stream = parts
    pool = HostPool(1 << 20)
    conn = make(pool, cache, alloc)
    ids = alloc.alloc(1)
    save = conn.prepare_save(ids, conn.block_keys(range(4)))
    ev = EventSet(["ev.save"], default_timeout=5).bind(1)["ev.save"]
    job = save_stream.launch(lambda: 1 / 0)          # never records the event
    conn.handoff(save, job, ev)
    conn.drain(5)                                    # does not hang on the unrecorded event
    assert len(pool) == 0 and conn.stats["save_failures"] == 1 and not alloc.is_pinned(ids[0])
    conn.close()


def test_cancel_releases_pins(parts):
    cache, alloc, _ = parts
    conn = make(HostPool(1 << 20), cache, alloc)
    ids = alloc.alloc(2)
    conn.cancel(conn.prepare_save(ids, ["a", "b"]))
    alloc.free(ids)
    assert alloc.num_free == 8
    with pytest.raises(ValueError, match="2 save blocks but 1 keys"):
        conn.prepare_save(ids[:2], ["a"])
    conn.close()


def pool_and_source(parts, pool_type=HostPool):
    """An empty host pool, a loader over the fixture's cache, a source cache of 3 filled blocks, a prompt's keys."""
    cache, alloc, _ = parts
    pool = pool_type(1 << 20)
    src = PagedKVCache(2, SHAPES, 3, torch.float32)
    fill(src, 5)
    conn = make(pool, cache, alloc)
    return cache, pool, conn, src, conn.block_keys(range(12))


def test_lookup_and_load_the_leading_run(parts):
    cache, pool, conn, src, keys = pool_and_source(parts)
    pool.put(keys[0], pack_block(src, 0))
    pool.put(keys[2], pack_block(src, 2))            # a gap at block 1
    assert conn.lookup(keys) == 1
    before = pack_block(cache, 6)
    staged = conn.load(keys[:1])
    assert len(staged) == 1
    assert pack_block(cache, 6) == before            # the cache is the graph's to write (kv_load)
    assert pack_block(staged[0], 0) == pack_block(src, 0)   # one staging block: per layer, per component
    for layer, blk in zip(cache, staged[0]):         # what the step's kv_load does with it
        ops.kv_load(layer, blk, torch.tensor([6]))
    assert pack_block(cache, 6) == pack_block(src, 0)
    pool.put(keys[1], b"short")                      # a foreign/truncated value: recomputed
    assert len(conn.load(keys)) == 1 and conn.stats["pool_errors"] == 1
    assert len(conn.load(["absent", keys[0]])) == 0  # evicted since the lookup: stops there
    assert conn.stats["hit_blocks"] == 2
    conn.close()
    whole = HostPool(1 << 20)                        # a run of 3: one staging, block j in row j
    for j in range(3):
        whole.put(keys[j], pack_block(src, j))
    run = make(whole, cache, parts[1]).load(keys[:3])
    assert [pack_block(run[j], 0) for j in range(3)] == [pack_block(src, j) for j in range(3)]
    layers = run.layers()                            # what the graph's kv_load reads: views, no copy
    assert layers[1][0].shape[0] == 3 and layers[1][0].data_ptr() == run.staging[1][0].data_ptr()
    cut = run[1:]                                    # a run cut short (the ranks' agreed length)
    assert len(cut) == 2 and pack_block(cut[0], 0) == pack_block(src, 1)
    assert torch.equal(cut.layers()[0][1], run.layers()[0][1][1:])
    for part, ids in ((run, [7, 2, 5]), (cut, [4, 1])):  # the strided run, as the graph copies it, into scattered blocks
        for layer, loads in zip(cache, part.layers()):
            ops.kv_load(layer, loads, torch.tensor(ids))
        assert [pack_block(cache, b) for b in ids] == [pack_block(src, j) for j in range(3 - len(ids), 3)]


def test_a_load_staging_is_reused_only_once_nothing_reads_it(parts):
    cache, pool, conn, src, keys = pool_and_source(parts, CopyingPool)
    for j in range(2):
        pool.put(keys[j], pack_block(src, j))
    first = conn.load(keys[:2])
    view = first.layers()[1][0]                      # what the graph's kv_load reads (a view)
    held, ptr = view.clone(), first.staging.packed.data_ptr()
    del first                                        # the request let go; the view still reads it
    second = conn.load(keys[1:2])                    # block 1 would land in row 0 of a reused buffer
    assert second.staging.packed.data_ptr() != ptr and torch.equal(view, held)
    del view, second
    third = conn.load(keys[:2])                      # nothing reads it now: the same mapped pages
    assert third.staging.packed.data_ptr() == ptr
    assert [pack_block(third[j], 0) for j in range(2)] == [pack_block(src, j) for j in range(2)]
    conn.close()


@pytest.mark.parametrize("pool_type", [HostPool, CopyingPool])
def test_a_run_the_pool_lends_is_the_staging_itself_and_stays_in_the_pool_while_read(parts, pool_type):
    # HostPool lends a run put in order: the staging is laid over the pool's own memory (no copy);
    # a pool that lends nothing gets the same blocks copied. Either way the graph's kv_load puts
    # each source block into its cache block
    cache, _, _ = parts
    pool = pool_type(3 * cache.block_bytes())            # room for exactly the 3 blocks
    src = PagedKVCache(2, SHAPES, 3, torch.float32)
    fill(src, 5)
    conn = make(pool, cache, parts[1])
    keys = conn.block_keys(range(12))
    for j in range(3):
        assert pool.put(keys[j], pack_block(src, j))
    run = conn.load(keys)
    lent = pool.stats().get("lends", 0) == 1
    assert lent == (pool_type is HostPool) and len(run) == 3 and conn.stats["loaded_blocks"] == 3
    assert [pack_block(run[j], 0) for j in range(3)] == [pack_block(src, j) for j in range(3)]
    for layer, loads in zip(cache, run.layers()):
        ops.kv_load(layer, loads, torch.tensor([6, 1, 4]))
    assert [pack_block(cache, b) for b in (6, 1, 4)] == [pack_block(src, j) for j in range(3)]
    other = PagedKVCache(2, SHAPES, 1, torch.float32)
    fill(other, 9)
    view = run.layers()[1][1]                            # what a graph still reading the run holds
    del run, layer, loads
    # while it reads the pool's memory, the pool keeps those values: a put finds no room
    assert pool.put("new", pack_block(other, 0)) is (not lent)
    if lent:
        assert torch.equal(view[2], src[1][1][2])
        del view
        assert pool.put("new", pack_block(other, 0))     # nothing reads them now: the oldest goes
    conn.close()


def test_a_run_the_pool_holds_in_pieces_is_copied(parts):
    cache, pool, conn, src, keys = pool_and_source(parts)
    pool.put(keys[0], pack_block(src, 0))
    pool.put("between", pack_block(src, 2))              # keys[1] lands after it, not after keys[0]
    pool.put(keys[1], pack_block(src, 1))
    run = conn.load(keys[:2])
    assert len(run) == 2 and pool.stats()["lends"] == 1  # the lend covered keys[0] only: copied instead
    assert [pack_block(run[j], 0) for j in range(2)] == [pack_block(src, j) for j in range(2)]
    assert pool.stats()["live_lends"] == 0
    conn.close()


def test_a_pool_that_is_down_costs_a_recompute_never_a_request(parts):
    cache, alloc, save_stream = parts
    conn = make(DownPool(), cache, alloc)
    keys = conn.block_keys(range(8))
    assert conn.lookup(keys) == 0 and len(conn.load(keys)) == 0
    ids = alloc.alloc(2)
    save = conn.prepare_save(ids, keys)
    ev = EventSet(["ev.save"], default_timeout=5).bind(1)["ev.save"]
    conn.handoff(save, launch_save(save_stream, save.staging, ev), ev)
    conn.drain(5)
    assert conn.stats["pool_errors"] == 2 and conn.stats["put_failures"] == 2 and conn.stats["puts"] == 0
    assert not any(alloc.is_pinned(i) for i in ids)
    assert conn.pool_stats() == {"error": "pool down"}    # stats for logs never raise either
    conn.close()


def test_wait_oldest_releases_the_oldest_commit(parts):
    cache, alloc, save_stream = parts
    conn = make(HostPool(1 << 20), cache, alloc)
    assert conn.wait_oldest() is False               # nothing in flight: nothing to wait for
    ids = alloc.alloc(1)
    save = conn.prepare_save(ids, conn.block_keys(range(4)))
    ev = EventSet(["ev.save"], default_timeout=5).bind(1)["ev.save"]
    gate = threading.Event()
    conn.handoff(save, launch_save(save_stream, save.staging, ev, gate), ev)
    alloc.free(ids)
    assert alloc.num_free == 7
    threading.Timer(0.05, gate.set).start()
    assert conn.wait_oldest() is True and alloc.num_free == 8 and conn.pending == 0
    conn.close()


def test_write_mode_is_checked(parts):
    cache, alloc, _ = parts
    with pytest.raises(ValueError, match="write must be one of"):
        make(HostPool(1), cache, alloc, write="later")
