"""HostPool (LRU by bytes, contract of PoolBackend) and chained block keys."""
import hashlib
import os
import struct
import subprocess
import sys
import threading

import pytest

from graphgen.runtime.pool import HostPool, KVShard, PoolBackend, block_keys
from support.paths import REPO


# ------------------------------------------------------------------------------------------ pool

def test_put_get_contains_and_byte_accounting():
    p = HostPool(100)
    assert p.get("a") is None and not p.contains("a")
    assert p.put("a", b"x" * 30)
    assert p.put("b", bytearray(b"y" * 20))          # bytes-like accepted, stored as bytes
    assert p.get("a") == b"x" * 30 and p.get("b") == b"y" * 20
    assert isinstance(p.get("b"), bytes)
    assert p.used_bytes == 50 and len(p) == 2
    s = p.stats()
    assert s["used_bytes"] == 50 and s["num_keys"] == 2 and s["capacity_bytes"] == 100


def test_value_is_copied_at_put():
    p = HostPool(10)
    buf = bytearray(b"abc")
    p.put("k", buf)
    buf[0] = ord("z")                                 # caller reuses its buffer
    assert p.get("k") == b"abc"


def test_lru_eviction_order_by_bytes():
    p = HostPool(100)
    for k in "abcd":
        assert p.put(k, bytes(25))                    # exactly full
    assert p.used_bytes == 100 and p.stats()["evictions"] == 0
    p.get("a")                                        # a get refreshes recency
    p.contains("b")                                   # so does a hit
    assert p.keys() == ["c", "d", "a", "b"]
    assert p.put("e", bytes(40))                      # needs 40: evicts c then d (50 bytes freed)
    assert p.keys() == ["a", "b", "e"]
    assert p.used_bytes == 90
    assert p.stats()["evictions"] == 2 and p.stats()["evicted_bytes"] == 50
    assert p.get("c") is None and p.get("d") is None


def test_leading_run_hits_refresh_recency():
    p = HostPool(30)
    for k in "abc":
        p.put(k, bytes(10))
    assert p.leading_run(["a", "b"]) == 2             # a, b now most recent
    p.put("d", bytes(10))                             # evicts c, the least recent
    assert p.keys() == ["a", "b", "d"]


def test_oversize_value_refused_without_evicting():
    p = HostPool(50)
    p.put("a", bytes(30))
    assert p.put("big", bytes(51)) is False
    assert not p.contains("big") and p.get("a") == bytes(30)
    assert p.stats()["put_refused"] == 1 and p.used_bytes == 30
    assert p.put("exact", bytes(50))                  # == capacity fits, evicting a
    assert p.keys() == ["exact"]


def test_duplicate_put_keeps_old_value():
    p = HostPool(100)
    assert p.put("k", b"old")
    assert p.put("k", b"new-and-longer") is True
    assert p.get("k") == b"old"
    assert p.used_bytes == 3 and p.stats()["put_duplicate"] == 1


def test_leading_run_stops_at_first_miss():
    p = HostPool(1000)
    keys = [f"k{i}" for i in range(5)]
    for i in (0, 1, 3):
        p.put(keys[i], b"v")
    assert p.leading_run(keys) == 2
    assert p.leading_run(keys[:2]) == 2
    assert p.leading_run(keys[2:]) == 0
    assert p.leading_run([]) == 0


def test_default_leading_run_of_the_interface():
    # a minimal backend relying on PoolBackend.leading_run (what Mooncake may start from)
    class Dict(PoolBackend):
        def __init__(self):
            self.d = {}

        def put(self, key, value):
            self.d.setdefault(key, bytes(value))
            return True

        def get(self, key):
            return self.d.get(key)

        def contains(self, key):
            return key in self.d

    b = Dict()
    for k in ("a", "b", "d"):
        b.put(k, b"1")
    assert b.leading_run(["a", "b", "c", "d"]) == 2
    assert b.stats() == {}
    with pytest.raises(TypeError):
        PoolBackend()


def test_host_get_into_is_the_contracts_get_into_under_one_lock():
    # HostPool.get_into (one lock for the run) answers as the contract's default (a get per key),
    # and hands the values over after releasing the lock: a destination that puts into the same
    # pool (as a commit thread may, meanwhile) would deadlock on the non-reentrant lock otherwise
    def case(get_into):
        p = HostPool(1 << 20)
        assert p.put("a", b"x" * 16) and p.put("b", b"y" * 8) and p.put("c", b"z" * 4)
        seen, bufs = [], [bytearray(16), bytearray(16)]
        ok = get_into(p, ["a", "b", "gone", "c", "a", "b"],
                      [*bufs, bytearray(4), lambda mv: seen.append(bytes(mv)) or p.put("d", b"w"),
                       lambda mv: False, lambda mv: 1 / 0])
        return ok, [bytes(b) for b in bufs], seen, p.keys(), {k: p.stats()[k] for k in ("gets", "get_hits")}

    ours, default = case(HostPool.get_into), case(PoolBackend.get_into)
    assert ours[:3] + ours[4:] == default[:3] + default[4:]
    assert ours[0] == [True, False, False, True, False, False] and ours[1] == [b"x" * 16, bytes(16)]
    # recency refreshed by the gets in key order, all before the handover (the default interleaves them)
    assert ours[2] == [b"z" * 4] and ours[3] == ["c", "a", "b", "d"] and default[3] == ["c", "d", "a", "b"]
    assert ours[4] == {"gets": 6, "get_hits": 5}
    with pytest.raises(ValueError, match="destinations"):
        HostPool(8).get_into(["a"], [])


def test_bad_keys_and_values():
    p = HostPool(10)
    with pytest.raises(TypeError):
        p.put(b"k", b"v")
    with pytest.raises(TypeError):
        p.put("k", "not bytes")
    with pytest.raises(ValueError):
        HostPool(-1)


def test_thread_safety_smoke():
    # 4 writers + 2 readers hammering a small pool: accounting must stay exact and values intact
    p = HostPool(64 * 10)
    errors = []

    def writer(w):
        for i in range(300):
            k = f"w{w}-{i % 40}"
            v = k.encode().ljust(10, b".")            # value derived from key: checkable by readers
            if not p.put(k, v):
                errors.append(("put failed", k))

    def reader():
        for i in range(600):
            k = f"w{i % 4}-{i % 40}"
            v = p.get(k)
            if v is not None and v != k.encode().ljust(10, b"."):
                errors.append(("corrupt", k, v))
            p.leading_run([k, f"w0-{i % 40}"])

    ts = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    ts += [threading.Thread(target=reader) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert not errors
    assert p.used_bytes == 10 * len(p) <= p.capacity_bytes
    assert p.used_bytes == sum(len(p.get(k)) for k in p.keys())


# ------------------------------------------------------------------------------------------ keys

KW = dict(model="qwen3-tiny", layout="kv1:float32:L2:k=4x2x8:v=4x2x8")


def test_one_key_per_full_block_only():
    assert block_keys(list(range(11)), 4, **KW).__len__() == 2
    assert len(block_keys(list(range(12)), 4, **KW)) == 3
    assert block_keys(list(range(3)), 4, **KW) == []
    # a trailing partial block does not change the keys of the full ones
    assert block_keys(list(range(8)), 4, **KW) == block_keys(list(range(11)), 4, **KW)


def test_chained_hash_matches_spec():
    # recompute the documented scheme independently
    ids = [5, 6, 7, 8, 9, 10]
    keys = block_keys(ids, 3, **KW, shard=KVShard(1, 2))
    parent = hashlib.sha256(b"graphgen.block_keys.v1").digest()
    for b, key in enumerate(keys):
        parent = hashlib.sha256(parent + struct.pack("<3q", *ids[3 * b:3 * b + 3])).digest()
        assert key == f"{KW['model']}@{KW['layout']}@r1of2@{parent.hex()}"


def test_keys_differ_when_any_earlier_block_differs():
    a = list(range(100, 116))
    base = block_keys(a, 4, **KW)
    assert len(set(base)) == 4
    for pos in range(16):
        b = list(a)
        b[pos] += 1
        kb = block_keys(b, 4, **KW)
        blk = pos // 4
        assert kb[:blk] == base[:blk]                 # blocks before the change are shared
        assert all(x != y for x, y in zip(kb[blk:], base[blk:]))  # every later key differs


def test_same_block_content_at_different_positions_differs():
    # the chain makes a key depend on the prefix, not only the block's own tokens
    k = block_keys([1, 2, 1, 2], 2, **KW)
    assert k[0] != k[1]


def test_model_layout_rank_namespaces():
    ids = list(range(8))
    variants = {
        tuple(block_keys(ids, 4, **KW)),
        tuple(block_keys(ids, 4, model="other", layout=KW["layout"])),
        tuple(block_keys(ids, 4, model=KW["model"], layout="kv1:bfloat16:L2:k=4x2x8:v=4x2x8")),
        tuple(block_keys(ids, 4, **KW, shard=KVShard(1, 2))),
        tuple(block_keys(ids, 4, **KW, shard=KVShard(0, 2))),
    }
    assert len(variants) == 5


def test_key_argument_validation():
    with pytest.raises(ValueError, match="model"):
        block_keys([1], 1, model="a@b", layout="l")
    with pytest.raises(ValueError, match="layout"):
        block_keys([1], 1, model="m", layout="")
    with pytest.raises(ValueError, match="rank"):
        block_keys([1], 1, model="m", layout="l", shard=KVShard(2, 2))
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1], 0, model="m", layout="l")


def test_accepts_tensors():
    import torch
    ids = list(range(8))
    assert block_keys(torch.tensor(ids), 4, **KW) == block_keys(ids, 4, **KW)


def test_keys_stable_across_processes_and_hash_seeds():
    code = ("from graphgen.runtime.pool import KVShard, block_keys;"
            "print('\\n'.join(block_keys(list(range(1000, 1040)) + [2**40, -3] * 4, 8,"
            " model='m', layout='l', shard=KVShard(1, 4))))")
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        r = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=30, check=True)
        outs.append(r.stdout.split())
    here = block_keys(list(range(1000, 1040)) + [2**40, -3] * 4, 8, model="m", layout="l",
                      shard=KVShard(1, 4))
    assert outs[0] == outs[1] == here and len(here) == 6


def test_block_key_renders_every_field_in_one_format():
    from graphgen.runtime.pool import BlockKey

    k = BlockKey("m", "l", KVShard(1, 4), "ab")
    assert k.render() == "m@l@r1of4@ab"
    # a lookahead token (e.g. the successor an MTP draft KV depends on) is a field, not a new format
    la = BlockKey("m", "l", KVShard(1, 4), "ab", lookahead=7)
    assert la.render() == "m@l@r1of4@ab@la7" and la.render() != k.render()
    assert block_keys([1, 2], 2, model="m", layout="l", shard=KVShard(1, 4))[0].startswith("m@l@r1of4@")
