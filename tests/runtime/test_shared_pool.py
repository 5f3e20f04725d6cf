"""The shared host pool (`graphgen.runtime.pool.shared`): a rank process's `RemotePool` is a manager proxy,
every call a round trip, so a commit's blocks go in one ``put_many`` per `COMMIT_BATCH` and a load's values in
one ``get_many``. The real pool process is started once (spawned, loopback, authkey); the round trips are
counted on a proxy stand-in (named as such: it forwards to a real HostPool and counts the calls)."""
from __future__ import annotations

import multiprocessing as mp
import secrets
import socket
import threading

import pytest
import torch

from graphgen.runtime.engine import connector as connector_mod
from graphgen.runtime.engine.connector import COMMIT_BATCH, KVConnector
from graphgen.runtime.engine.kv_load import Counters, KVLoader
from graphgen.runtime.core.kvcache import BlockAllocator, PagedKVCache, pack_block
from graphgen.runtime.pool import HostPool
from graphgen.runtime.pool.shared import RemotePool, connect_pool, serve_pool

SHAPES = {"k": (4, 2, 3), "v": (4, 2, 3)}


class CountingProxy:
    """Stand-in for the manager proxy: forwards to a real HostPool in this process, counting each call."""

    def __init__(self):
        self.pool = HostPool(1 << 22)
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        method = getattr(self.pool, name)

        def call(*a):
            self.calls[name] = self.calls.get(name, 0) + 1
            return method(*a)
        return call


def test_a_commit_is_one_put_many_per_batch_and_a_load_one_get_many():
    n = COMMIT_BATCH + 5                       # two batches
    cache = PagedKVCache(1, SHAPES, n + 2, torch.float32)
    for t in cache.layer(0):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(0)))
    alloc = BlockAllocator(n + 2)
    proxy = CountingProxy()
    pool = RemotePool(proxy)
    conn = KVConnector(pool, cache, alloc, write="sync", stats=Counters())
    loader = KVLoader(pool, cache, model="m", stats=Counters())
    ids = alloc.alloc(n)
    keys = loader.block_keys(list(range(n * cache.block_size)))[:n]
    conn.save_filled(ids, keys)
    assert proxy.calls.get("put", 0) == 0 and proxy.calls["put_many"] == 2
    assert all(proxy.pool.get(k) == pack_block(cache, b) for k, b in zip(keys, ids))
    got: list = [None] * n
    ok = pool.get_into(keys, [lambda v, i=i: got.__setitem__(i, bytes(v)) for i in range(n)])
    assert all(ok) and proxy.calls["get_many"] == 2 and proxy.calls.get("get", 0) == 0
    assert got == [proxy.pool.get(k) for k in keys]
    # negative control: with one block per batch the same commit is one round trip per block
    proxy.calls.clear()
    connector_mod.COMMIT_BATCH, saved = 1, connector_mod.COMMIT_BATCH
    try:
        conn.save_filled(ids[:3], [k + "x" for k in keys[:3]])
    finally:
        connector_mod.COMMIT_BATCH = saved
    assert proxy.calls["put_many"] == 3


def test_the_real_pool_process_answers_put_many_get_many_and_get_into():
    ctx = mp.get_context("spawn")
    authkey = secrets.token_bytes(16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = s.getsockname()
    ready = ctx.Event()
    proc = ctx.Process(target=serve_pool, args=(1 << 20, address, authkey, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(60), "the pool process did not start"
        pool = connect_pool(address, authkey)
        vals = [bytes([i]) * 64 for i in range(5)]
        assert pool.put_many([(f"k{i}", v) for i, v in enumerate(vals)]) == [True] * 5
        assert pool.put_many([("big", b"x" * (2 << 20))]) == [False]      # larger than the pool: refused
        assert pool.get_many(["k0", "nope", "k4"]) == [vals[0], None, vals[4]]
        bufs = [bytearray(64), bytearray(64), bytearray(3)]
        assert pool.get_into(["k1", "nope", "k2"], bufs) == [True, False, False]   # a miss, a wrong size
        assert bytes(bufs[0]) == vals[1]
        with pytest.raises(ValueError):
            pool.get_into(["k1"], [])
    finally:
        proc.kill()
        proc.join(10)


def _nodelay(conn) -> int:
    s = socket.socket(fileno=conn.fileno())
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        s.detach()


def test_both_ends_of_a_pool_connection_send_without_nagle():
    """multiprocessing sends a message over 16 KiB as header then body; with Nagle on, the body's tail waits for
    the peer's delayed ACK (the stalls of 40 ms seen on 64 KiB block puts)."""
    from multiprocessing import connection

    from graphgen.runtime.pool.shared import _NoDelayListener, _no_delay_client

    key = secrets.token_bytes(16)
    with _NoDelayListener(("127.0.0.1", 0), authkey=key) as listener:
        accepted: list = []
        t = threading.Thread(target=lambda: accepted.append(listener.accept()))
        t.start()
        client = _no_delay_client(listener.address, authkey=key)
        t.join(10)
        plain_listener = connection.Listener(("127.0.0.1", 0), authkey=key)
        t2 = threading.Thread(target=plain_listener.accept)
        t2.start()
        plain = connection.Client(plain_listener.address, authkey=key)   # negative control: the default
        t2.join(10)
        try:
            assert _nodelay(client) and _nodelay(accepted[0])
            assert not _nodelay(plain)
        finally:
            client.close(); accepted[0].close(); plain.close(); plain_listener.close()
