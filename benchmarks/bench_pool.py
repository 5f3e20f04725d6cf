"""Save / load bandwidth of the KV pool through MooncakePool vs a raw Mooncake loop vs HostPool.

    python benchmarks/bench_pool.py [--sizes 256KiB,2MiB,8MiB] [--total 256MiB] [--reps 5]

Starts its own Mooncake master + segment (``mooncake_server serve``) on loopback inside a private
network namespace (re-executes itself under ``unshare -n``: needs root), in one client process:

* ``pool``: ``MooncakePool.put_many`` / ``get_many`` of N values of one block size (header, CRC-32,
  copy into / out of the registered buffers, zero-copy ``batch_put_from`` / ``batch_get_into``);
* ``raw``: ``batch_put_from`` / ``batch_get_into`` of the same bytes from an already-registered
  buffer: no header, no checksum, no copy — the limit of this path;
* ``host``: ``HostPool.put`` / ``get`` (in-process dict; the embedded pool).

Configurations are interleaved round-robin (order rotated each round), each round on fresh keys;
medians over ``--reps`` rounds; GB/s = payload bytes / seconds (10^9).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from graphgen.runtime.pool import HostPool                                       # noqa: E402
from graphgen.runtime.pool_codec import HEADER, parse_size                       # noqa: E402
from graphgen.runtime.pool_mooncake import MooncakeOptions, MooncakePool         # noqa: E402


def run_pool(pool, keys, values):
    t = time.perf_counter(); ok = pool.put_many(list(zip(keys, values))); ts = time.perf_counter() - t
    assert all(ok), pool.stats()
    t = time.perf_counter(); got = pool.get_many(keys); tl = time.perf_counter() - t
    assert all(g is not None and len(g) == len(v) for g, v in zip(got, values)), pool.stats()
    return ts, tl


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
    server = subprocess.Popen([sys.executable, "-m", "graphgen.runtime.mooncake_server", "serve",
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
        host = HostPool(parse_size(args.total) * (args.reps + 1) * 2)
        total = parse_size(args.total)
        print(f"# {args.reps} rounds, {args.total} per round and config, buffer {args.buffer}; "
              f"GB/s (10^9 B/s) of payload, median [min-max]")
        print("| block size | blocks | config | save GB/s | load GB/s | save vs raw | load vs raw |")
        print("|---|---|---|---|---|---|---|")
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            n = max(1, total // size)
            values = [os.urandom(size) for _ in range(n)]
            res = {c: ([], []) for c in ("raw", "pool", "host")}
            order = list(res)
            for rnd in range(args.reps):
                order = order[1:] + order[:1]
                for c in order:
                    keys = [f"bench@{c}@r{rnd}@s{size}@{i}" for i in range(n)]
                    if c == "raw":
                        ts, tl = raw.run(keys, size + HEADER.size)
                    elif c == "pool":
                        ts, tl = run_pool(pool, keys, values)
                    else:
                        ts, tl = run_host(host, keys, values)
                    res[c][0].append(n * size / ts / 1e9)
                    res[c][1].append(n * size / tl / 1e9)
                    if c == "raw":      # free the segment for the next rounds
                        pool._store.batch_remove(keys, True)
                    elif c == "pool":
                        pool._store.batch_remove(keys, True)
            med = {c: (statistics.median(s), statistics.median(l)) for c, (s, l) in res.items()}
            for c, (s, l) in res.items():
                print(f"| {size >> 10} KiB | {n} | {c} | {med[c][0]:.2f} [{min(s):.2f}-{max(s):.2f}] "
                      f"| {med[c][1]:.2f} [{min(l):.2f}-{max(l):.2f}] "
                      f"| {med[c][0] / med['raw'][0]:.0%} | {med[c][1] / med['raw'][1]:.0%} |",
                      flush=True)
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
    if not args.in_netns:
        if shutil.which("unshare") is None:
            sys.exit("bench_pool.py needs `unshare` (util-linux) and root: Mooncake runs in a "
                     "private network namespace")
        cmd = f"ip link set lo up && exec {sys.executable} {' '.join(map(repr, sys.argv))} --in-netns"
        os.execvp("unshare", ["unshare", "-n", "--", "sh", "-c", cmd])
    bench(args)


if __name__ == "__main__":
    main()
