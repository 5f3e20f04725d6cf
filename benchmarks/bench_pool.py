"""Save / load bandwidth of the KV pool through MooncakePool vs a raw Mooncake loop vs HostPool.

    python benchmarks/bench_pool.py [--sizes 256KiB,2MiB,8MiB] [--total 128MiB] [--reps 5]

Starts its own Mooncake master + segment (``mooncake_server serve``) on loopback inside a private
network namespace (re-executes itself under ``unshare -n``: needs root), in one client process:

* ``raw``: ``batch_put_from`` / ``batch_get_into`` of the same bytes from an already-registered
  buffer: no header, no checksum, no copy — the limit of this path;
* ``before``: the previous data path, kept here to measure against in the same run: CRC-32 of the
  payload, header built as ``bytes``, header + payload copied into the registered buffer; on load
  CRC-32 of the header and payload, then the payload copied out into fresh ``bytes``;
* ``pool``: ``MooncakePool.put_many`` / ``get_many`` (payload copied once into the registered
  buffer, 64-bit checksum over it there, header packed in place; load validated in place, then
  copied out into fresh ``bytes``, as the ``get`` contract returns);
* ``into``: save as ``pool``; load with ``MooncakePool.get_into`` into caller-owned buffers (as an
  engine's KV cache is: allocated once, reused), no ``bytes`` at all;
* ``host``: ``HostPool.put`` / ``get`` (in-process dict of references, no copy: not a bandwidth).

Configurations are interleaved round-robin (order rotated each round), each round on fresh keys;
medians over ``--reps`` rounds; GB/s = payload bytes / seconds (10^9).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import statistics
import struct
import subprocess
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from graphgen.runtime.pool import HostPool                                       # noqa: E402
from graphgen.runtime.pool.codec import HEADER, fingerprint_of, parse_size       # noqa: E402
from graphgen.runtime.pool.mooncake_server import reexec_in_private_netns             # noqa: E402
from graphgen.runtime.pool.mooncake import MooncakeOptions, MooncakePool         # noqa: E402


def run_pool(pool, keys, values):
    t = time.perf_counter(); ok = pool.put_many(list(zip(keys, values))); ts = time.perf_counter() - t
    assert all(ok), pool.stats()
    t = time.perf_counter(); got = pool.get_many(keys); tl = time.perf_counter() - t
    assert all(g is not None and len(g) == len(v) for g, v in zip(got, values)), pool.stats()
    return ts, tl


def run_into(pool, keys, values, dests):
    t = time.perf_counter(); ok = pool.put_many(list(zip(keys, values))); ts = time.perf_counter() - t
    assert all(ok), pool.stats()
    t = time.perf_counter(); ok = pool.get_into(keys, dests); tl = time.perf_counter() - t
    assert all(ok), pool.stats()
    return ts, tl


class Before:
    """The previous MooncakePool data path (format 1), same client, its own registered buffers."""

    V1 = struct.Struct("<4sHHQ16s8sII")

    def __init__(self, store, nbytes):
        self.store = store
        self.bufs = [(ctypes.c_char * nbytes)() for _ in range(2)]
        self.views = [memoryview(b).cast("B") for b in self.bufs]
        self.ptrs = [ctypes.addressof(b) for b in self.bufs]
        self.size = nbytes
        for p in self.ptrs:
            assert store.register_buffer(p, nbytes) == 0

    def header(self, key, payload):
        kd = hashlib.sha256(key.encode()).digest()[:8]
        head = self.V1.pack(b"GGKV", 1, 48, len(payload), fingerprint_of(key), kd,
                            zlib.crc32(payload), 0)
        return head[:-4] + struct.pack("<I", zlib.crc32(head[:-4]))

    def run(self, keys, values):
        size = len(values[0]) + 48
        per = max(1, self.size // size)
        view, ptr = self.views[0], self.ptrs[0]
        t = time.perf_counter()
        for i in range(0, len(keys), per):
            ks = keys[i:i + per]
            for j, k in enumerate(ks):
                v = values[i + j]
                view[j * size:j * size + 48] = self.header(k, v)
                view[j * size + 48:(j + 1) * size] = v
            rcs = self.store.batch_put_from(ks, [ptr + j * size for j in range(len(ks))],
                                            [size] * len(ks))
            assert all(rc == 0 for rc in rcs), rcs
        ts = time.perf_counter() - t
        view, ptr = self.views[1], self.ptrs[1]
        out = []
        t = time.perf_counter()
        for i in range(0, len(keys), per):
            ks = keys[i:i + per]
            rcs = self.store.batch_get_into(ks, [ptr + j * size for j in range(len(ks))],
                                            [size] * len(ks))
            for j, rc in enumerate(rcs):
                value = view[j * size:j * size + rc]
                hcrc, = struct.unpack_from("<I", value, 44)
                assert zlib.crc32(bytes(value[:44])) == hcrc
                assert zlib.crc32(value[48:]) == self.V1.unpack_from(value)[6]
                out.append(bytes(value[48:]))
        return ts, time.perf_counter() - t


def run_host(pool, keys, values):
    t = time.perf_counter()
    for k, v in zip(keys, values):
        assert pool.put(k, v)
    ts = time.perf_counter() - t
    t = time.perf_counter()
    for k in keys:
        assert pool.get(k) is not None
    return ts, time.perf_counter() - t


class Raw:
    """The same batch calls on already-registered memory: the transfer alone."""

    def __init__(self, store, nbytes):
        self.store = store
        self.buf = (ctypes.c_char * nbytes)()
        self.ptr = ctypes.addressof(self.buf)
        self.size = nbytes
        assert store.register_buffer(self.ptr, nbytes) == 0

    def run(self, keys, size):
        per = max(1, self.size // size)
        t = time.perf_counter()
        for i in range(0, len(keys), per):
            ks = keys[i:i + per]
            rcs = self.store.batch_put_from(ks, [self.ptr + j * size for j in range(len(ks))],
                                            [size] * len(ks))
            assert all(rc == 0 for rc in rcs), rcs
        ts = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(0, len(keys), per):
            ks = keys[i:i + per]
            rcs = self.store.batch_get_into(ks, [self.ptr + j * size for j in range(len(ks))],
                                            [size] * len(ks))
            assert all(rc == size for rc in rcs), rcs
        return ts, time.perf_counter() - t


def bench(args):
    port = 50300
    server = subprocess.Popen([sys.executable, "-m", "graphgen.runtime.pool.mooncake_server", "serve",
                               "--port", str(port), "--segment", args.segment],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        line = server.stdout.readline()
        assert line.startswith("ready"), line
        master = f"127.0.0.1:{port}"
        buf = parse_size(args.buffer)
        pool = MooncakePool(master, MooncakeOptions(buffer_bytes=buf))
        raw = Raw(pool._store, buf)          # same client, its own registered buffer
        before = Before(pool._store, buf)
        host = HostPool(parse_size(args.total) * (args.reps + 1) * 2)
        total = parse_size(args.total)
        print(f"# {args.reps} rounds, {args.total} per round and config, buffer {args.buffer}; "
              f"GB/s (10^9 B/s) of payload, median [min-max]")
        print("| block size | blocks | config | save GB/s | load GB/s | save vs raw | load vs raw |")
        print("|---|---|---|---|---|---|---|")
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            n = max(1, total // size)
            values = [os.urandom(size) for _ in range(n)]
            dests = [bytearray(size) for _ in range(n)]      # the caller's memory, reused
            configs = ("raw", "before", "pool", "into", "host")
            res = {c: ([], []) for c in configs}
            order = list(configs)
            for rnd in range(args.reps):
                order = order[1:] + order[:1]
                for c in order:
                    keys = [f"bench@{c}@r{rnd}@s{size}@{i}" for i in range(n)]
                    if c == "raw":
                        ts, tl = raw.run(keys, size + HEADER.size)
                    elif c == "before":
                        ts, tl = before.run(keys, values)
                    elif c == "pool":
                        ts, tl = run_pool(pool, keys, values)
                    elif c == "into":
                        ts, tl = run_into(pool, keys, values, dests)
                    else:
                        ts, tl = run_host(host, keys, values)
                    res[c][0].append(n * size / ts / 1e9)
                    res[c][1].append(n * size / tl / 1e9)
                    if c != "host":      # free the segment for the next rounds
                        pool._store.batch_remove(keys, True)
                assert all(bytes(d) == v for d, v in zip(dests, values))
            med = {c: (statistics.median(s), statistics.median(l)) for c, (s, l) in res.items()}
            for c, (s, l) in res.items():
                vs = ("— | —" if c == "host" else
                      f"{med[c][0] / med['raw'][0]:.0%} | {med[c][1] / med['raw'][1]:.0%}")
                print(f"| {size >> 10} KiB | {n} | {c} | {med[c][0]:.2f} [{min(s):.2f}-{max(s):.2f}] "
                      f"| {med[c][1]:.2f} [{min(l):.2f}-{max(l):.2f}] | {vs} |", flush=True)
        print("# pool stats:", {k: v for k, v in pool.stats().items() if v})
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    os._exit(0)      # skip Mooncake's client teardown


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="256KiB,2MiB,8MiB", help="KV block sizes (values)")
    ap.add_argument("--total", default="128MiB", help="bytes per round and configuration")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--buffer", default="64MiB", help="registered buffer per direction")
    ap.add_argument("--segment", default="1GiB", help="storage held by the server")
    ap.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    reexec_in_private_netns("bench_pool.py")
    bench(args)


if __name__ == "__main__":
    main()
