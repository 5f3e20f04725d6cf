"""Round trips of the shared host pool (the pool process ranks share, `graphgen.runtime.pool.shared`):
per-key ``put``/``get`` (one manager round trip per block, how a commit and a load went before) vs
``put_many`` in batches of the connector's ``COMMIT_BATCH`` and one ``get_many`` per load.

    python benchmarks/bench_shared_pool.py [--blocks 256] [--sizes 2KiB,64KiB] [--reps 5]

One spawned pool process (`serve_pool`, loopback, authkey) and this process as the rank; configurations
interleaved round-robin (order rotated each round), each round on fresh keys; medians over ``--reps``.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from graphgen.runtime.engine.connector import COMMIT_BATCH                       # noqa: E402
from graphgen.runtime.pool.codec import parse_size                              # noqa: E402
from graphgen.runtime.pool.shared import connect_pool, serve_pool               # noqa: E402


def per_key(pool, keys, vals):
    t = time.perf_counter()
    assert all(pool.put(k, v) for k, v in zip(keys, vals))
    ts = time.perf_counter() - t
    t = time.perf_counter()
    assert all(pool.get(k) is not None for k in keys)
    return ts, time.perf_counter() - t


def batched(pool, keys, vals):
    t = time.perf_counter()
    for lo in range(0, len(keys), COMMIT_BATCH):
        assert all(pool.put_many(list(zip(keys[lo:lo + COMMIT_BATCH], vals[lo:lo + COMMIT_BATCH]))))
    ts = time.perf_counter() - t
    t = time.perf_counter()
    assert all(v is not None for v in pool.get_many(keys))
    return ts, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--sizes", default="2KiB,64KiB")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    ctx = mp.get_context("spawn")
    authkey = secrets.token_bytes(16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = s.getsockname()
    ready = ctx.Event()
    cap = 2 * a.reps * 2 * a.blocks * max(sizes) + (1 << 20)
    proc = ctx.Process(target=serve_pool, args=(cap, address, authkey, ready), daemon=True)
    proc.start()
    try:
        assert ready.wait(60)
        pool = connect_pool(address, authkey)
        configs = {"per_key": per_key, "batched": batched}
        print(f"load before: {os.getloadavg()}; {a.blocks} blocks, COMMIT_BATCH {COMMIT_BATCH}, {a.reps} reps")
        print(f"{'size':>8} {'config':>8} {'save ms':>9} {'load ms':>9} {'save x':>7} {'load x':>7}")
        for size in sizes:
            got: dict[str, list] = {c: [] for c in configs}
            for r in range(a.reps):
                order = list(configs)[r % 2:] + list(configs)[:r % 2]
                for c in order:
                    keys = [f"{size}-{c}-{r}-{i}" for i in range(a.blocks)]
                    vals = [os.urandom(size) for _ in keys]
                    got[c].append(configs[c](pool, keys, vals))
            med = {c: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for c, v in got.items()}
            for c, (ts, tl) in med.items():
                print(f"{size:>8} {c:>8} {ts * 1e3:9.1f} {tl * 1e3:9.1f} "
                      f"{med['per_key'][0] / ts:7.1f} {med['per_key'][1] / tl:7.1f}")
        print(f"load after: {os.getloadavg()}")
    finally:
        proc.kill()
        proc.join(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
