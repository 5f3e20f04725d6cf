"""MooncakePool against real `mooncake_master` processes, clients in separate processes, all in a
private network namespace (see tests/support/netns.py). Each test starts its own master on a free port."""
from __future__ import annotations

import base64
import os
import signal
import time

from graphgen.runtime.pool import block_keys
from graphgen.runtime.pool.codec import HEADER, encode_value

PORT = 50100          # the namespace is fresh per test: nothing else listens in it
MASTER = f"127.0.0.1:{PORT}"


def keys(n, tag="p"):
    return block_keys(list(range(7, 7 + 16 * n)), 16, model=f"m{tag}", layout="kv1:test")


def test_round_trip_of_kv_blocks_between_processes(ns):
    ns.serve(PORT)
    ks = keys(4)
    writer = ns.worker(MASTER, name="writer")
    put = writer.call(op="put_kv", keys=ks, seed=3)
    assert put["ok"] == [True] * 4
    writer.kill()                           # the blocks live in the server's segment, not the writer's
    reader = ns.worker(MASTER, name="reader")
    assert reader.call(op="leading_run", keys=ks)["n"] == 4
    got = reader.call(op="get_kv", keys=ks)
    assert got["sha"] == put["sha"]         # unpacked into another cache and packed again: same bytes
    assert len(set(put["sha"])) == 4
    # get_into: unpacked straight from the registered buffer by a callable, no bytes in between
    assert reader.call(op="get_kv", keys=ks, into=True)["sha"] == put["sha"]
    s = reader.call(op="stats")["stats"]
    assert s["get_hits"] == 8 and s["rejected"] == 0 and s["errors"] == 0


def test_leading_run_stops_at_the_first_missing_key(ns):
    ns.serve(PORT)
    ks = keys(5)
    w = ns.worker(MASTER)
    assert w.call(op="put", keys=[ks[0], ks[1], ks[3]], seed=1, size=1000)["ok"] == [True] * 3
    r = ns.worker(MASTER, name="reader")
    assert r.call(op="leading_run", keys=ks)["n"] == 2
    assert r.call(op="leading_run", keys=ks[3:])["n"] == 1
    assert r.call(op="leading_run", keys=ks[2:])["n"] == 0
    assert r.call(op="get", keys=[ks[2]])["sha"] == [None]       # absent: a miss, not an error
    s = r.call(op="stats")["stats"]
    assert s["get_misses"] == 1 and s["errors"] == 0
    # a duplicate put is harmless and keeps the first value
    assert w.call(op="put", keys=[ks[0]], seed=99, size=1000)["ok"] == [True]
    first = w.call(op="put", keys=[ks[0]], seed=1, size=1000)["sha"]
    assert r.call(op="get", keys=[ks[0]])["sha"] == first


def test_foreign_truncated_and_corrupt_values_are_rejected(ns):
    ns.serve(PORT)
    w = ns.worker(MASTER)
    ks = keys(7)
    payload = os.urandom(4096)
    good = encode_value(ks[0], payload)
    corrupt = bytearray(encode_value(ks[3], payload)); corrupt[HEADER.size + 100] ^= 1
    bad_header = bytearray(encode_value(ks[5], payload)); bad_header[8] ^= 1   # payload length
    values = {
        ks[0]: good,
        ks[1]: encode_value(ks[1], payload, layout="another model"),  # foreign layout
        ks[2]: good[:-10],                                            # truncated
        ks[3]: bytes(corrupt),                                        # payload bit flip
        ks[4]: payload,                                               # no header at all
        ks[5]: bytes(bad_header),
        ks[6]: good,                                                  # another key's value
    }
    for k, v in values.items():
        assert w.call(op="raw_put", key=k, b64=base64.b64encode(v).decode())["rc"] == 0
    r = ns.worker(MASTER, name="reader")
    got = r.call(op="get", keys=ks)["sha"]
    import hashlib
    assert got[0] == hashlib.sha256(payload).hexdigest()
    assert got[1:] == [None] * 6
    s = r.call(op="stats")["stats"]
    assert s["rejected"] == 6
    assert s["reject_reasons"] == {"fingerprint": 1, "truncated": 1, "checksum": 2, "magic": 1,
                                   "key": 1}
    # the zero-copy read path applies the same checks; a destination of another size is a miss
    into = r.call(op="get_into", keys=ks, size=len(payload))
    assert into["ok"] == [True] + [False] * 6 and into["sha"][0] == got[0]
    assert r.call(op="get_into", keys=ks[:1], size=len(payload) - 8)["ok"] == [False]
    s = r.call(op="stats")["stats"]
    assert s["rejected"] == 13 and s["reject_reasons"]["size"] == 1 and s["get_hits"] == 2
    # present for the existence check (the engine then finds the value unusable and recomputes)
    assert r.call(op="leading_run", keys=ks)["n"] == 7


def test_master_killed_then_restarted_empty(ns):
    master, line = ns.server("master", "--port", str(PORT), name="master1")
    master_pid = int(dict(f.split("=", 1) for f in line.split()[1:])["pid"])
    ns.server("segment", "--master", MASTER, "--segment", "64MiB", name="segment")
    w = ns.worker(MASTER, max_backoff_s=1.0)
    ks = keys(4)
    assert w.call(op="put", keys=ks[:2], seed=1, size=10000)["ok"] == [True, True]

    os.kill(master_pid, signal.SIGKILL)
    master.kill()
    t = time.monotonic()
    assert w.call(op="leading_run", keys=ks)["n"] == 0
    assert w.call(op="put", keys=ks[2:], seed=1, size=10000)["ok"] == [False, False]
    assert w.call(op="get", keys=ks[:2])["sha"] == [None, None]
    assert time.monotonic() - t < 15                # bounded: one RPC timeout, then fail-fast
    s = w.call(op="stats")["stats"]
    assert s["down"] and s["down_events"] == 1 and s["errors"] >= 1
    assert s["put_failures"] == 2 and s["get_failures"] == 2 and s["lookup_failures"] == 1
    assert s["skipped_down"] >= 1

    ns.server("master", "--port", str(PORT), name="master2")
    deadline = time.monotonic() + 20
    while True:                                      # reconnect after the backoff
        ok = w.call(op="put", keys=[ks[3]], seed=1, size=10000)["ok"]
        if ok == [True] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert ok == [True]
    s = w.call(op="stats")["stats"]
    assert not s["down"] and s["reconnects"] == 1
    r = ns.worker(MASTER, name="reader")
    # the new master is empty: what was put before is a miss, never stale bytes
    assert r.call(op="leading_run", keys=ks)["n"] == 0
    sha = r.call(op="get", keys=ks)["sha"]
    assert sha[:3] == [None, None, None] and sha[3] is not None


def test_full_segment_fails_puts_and_counts_them(ns):
    ns.serve(PORT, "16MiB")
    w = ns.worker(MASTER)
    ks = keys(24)
    ok = w.call(op="put", keys=ks, seed=1, size=1 << 20)["ok"]
    # 24 MiB into 16 MiB: some puts must fail (the master's eviction runs in the background, so
    # which ones depends on its timing)
    assert ok[0] and ok.count(False) >= 1
    s = w.call(op="stats")["stats"]
    assert s["segment_full"] == ok.count(False) == s["put_failures"] > 0
    assert not s["down"]                             # a full segment is not an outage
    stored = [k for k, o in zip(ks, ok) if o]
    got = w.call(op="get", keys=stored, many=True)["sha"]
    # the master evicts the oldest values to make room: a miss, never an error or a wrong value
    s = w.call(op="stats")["stats"]
    assert s["get_hits"] + s["get_misses"] == len(stored) and s["errors"] == 0
    assert s["rejected"] == 0 and s["get_hits"] >= 1
    assert [g is not None for g in got].count(True) == s["get_hits"]


def test_same_key_put_concurrently_by_two_processes(ns):
    ns.serve(PORT, "256MiB")
    a, b = ns.worker(MASTER, name="a"), ns.worker(MASTER, name="b")
    ks = keys(40)
    a.send(op="put", keys=ks, seed=5, size=256 << 10, many=True)
    b.send(op="put", keys=ks, seed=5, size=256 << 10)
    ra, rb = a.result(), b.result()
    assert ra["sha"] == rb["sha"]
    r = ns.worker(MASTER, name="reader")
    got = r.call(op="get", keys=ks, many=True)["sha"]
    assert got == ra["sha"]                          # every key readable, intact
    assert r.call(op="stats")["stats"]["rejected"] == 0


def test_writer_killed_mid_put_leaves_nothing_a_reader_accepts(ns):
    ns.serve(PORT, "512MiB")
    w = ns.worker(MASTER, name="writer", buffer_bytes=16 << 20)
    ks = keys(60)
    w.send(op="put", keys=ks, seed=9, size=8 << 20, progress=True)
    w.wait_line("@@{\"progress\": 3", 30)
    w.kill(signal.SIGKILL)
    r = ns.worker(MASTER, name="reader", buffer_bytes=16 << 20)
    got = r.call(op="get", keys=ks, timeout=60)["sha"]
    from worker import value_of                      # tests/mooncake/worker.py (this folder)
    import hashlib
    present = [i for i, g in enumerate(got) if g is not None]
    assert len(present) >= 3 and len(present) < len(ks)
    for i in present:                                # only complete, exact values are accepted
        assert got[i] == hashlib.sha256(value_of(9, ks[i], 8 << 20)).hexdigest()
