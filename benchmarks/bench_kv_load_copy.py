"""The two copies a full pool hit pays over a device hit (issue 17 (a)), micro-timed in process.

A 2048-token hit on the bench model of ``bench_ttft.py`` (6 layers, k/v ``[16, 2, 64]`` float32 per
block: 96 KiB a block, 127 blocks = 12 MiB) is (1) fetched by ``KVLoader.load`` from the host pool
into one load staging (one copy per block) — or, where the pool lends the run (``HostPool``'s arena:
its values were put in order), laid over the pool's own memory with no copy — and (2) copied into
the cache by the graph's ``kv_load`` (per layer and component). Each variant below is timed interleaved with the others,
``--reps`` times, wall and thread CPU time, medians and minimums; ``cold``: a 40 MiB buffer is
touched before each rep (what a forward does to the caches between two loads), ``warm``: not.

  kv_load rows     ``index_copy_`` of ``[n, block elements]`` rows (the body before: every id scattered)
  kv_load runs     ``ops.kv_load`` (a run of consecutive ids: one slice copy; the FIFO allocator's
                   fresh blocks ``--first-block`` .. +127 are one run)
  copy floor       one ``copy_`` of the same 12 MiB, contiguous to contiguous (no strides, one call)
  kv_load lent     ``ops.kv_load`` from a lent staging (the pool's arena: what the graph reads on a lend)
  load lend        ``KVLoader.load`` of 127 keys from a ``HostPool`` (the run lent: no copy)
  load copy        the same from a host pool that lends nothing (the copy path: every other backend,
                   or a run the pool holds in pieces)
  load floor       the same values copied row by row into a kept staging (numpy, no pool, no checks)

    .venv/bin/python benchmarks/bench_kv_load_copy.py [--reps 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy  # noqa: E402
import torch  # noqa: E402

from graphgen.runtime.core import ops  # noqa: E402
from graphgen.runtime.core.kvcache import PagedKVCache  # noqa: E402
from graphgen.runtime.engine.kv_load import KVLoader  # noqa: E402
from graphgen.runtime.pool.base import PoolBackend  # noqa: E402
from graphgen.runtime.pool.host import HostPool  # noqa: E402


class CopyingPool(HostPool):
    """The host pool with nothing lent: loads take the copy path."""

    lend = PoolBackend.lend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=127, help="loaded blocks (127: a 2048-token prompt's hit)")
    ap.add_argument("--num-blocks", type=int, default=528, help="cache blocks (bench_long_serving's (a) engine)")
    ap.add_argument("--first-block", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    n, layers = args.blocks, 6
    cache = PagedKVCache(layers, {"k": (16, 2, 64), "v": (16, 2, 64)}, args.num_blocks)
    pool, copying = HostPool(8 << 30), CopyingPool(8 << 30)
    keys = [f"block{i}" for i in range(n)]
    for k in keys:
        v = os.urandom(cache.block_bytes())
        pool.put(k, v)
        copying.put(k, v)
    loader, copier = KVLoader(pool, cache, model="bench"), KVLoader(copying, cache, model="bench")
    lent = loader.load(keys)
    assert len(lent) == n and pool.stats()["lends"] == 1, "the host pool did not lend the run"
    staging = cache.make_staging(n)  # what kv_load copies from (not a load's: that one's buffer is reused)
    staging.packed.copy_(torch.from_numpy(numpy.frombuffer(bytearray(b"".join(pool.get(k) for k in keys)), dtype=numpy.uint8)
                                          ).view(n, -1))
    ids = torch.arange(args.first_block, args.first_block + n, dtype=torch.long)
    src, dst = torch.empty(n * cache.block_bytes(), dtype=torch.uint8), torch.empty(n * cache.block_bytes(), dtype=torch.uint8)
    values = [pool.get(k) for k in keys]
    rows = numpy.empty((n, cache.block_bytes()), dtype=numpy.uint8)

    def rows_copy():
        for layer, loads in zip(cache, staging):
            for c, s in zip(layer, loads):
                c.view(c.shape[0], -1).index_copy_(0, ids, s.reshape(n, -1))

    def runs_copy():
        for layer, loads in zip(cache, staging):
            ops.kv_load(layer, loads, ids)

    def lent_copy():
        for layer, loads in zip(cache, lent.layers()):
            ops.kv_load(layer, loads, ids)

    def load_floor():
        for r, v in zip(rows, values):
            r[:] = numpy.frombuffer(v, dtype=numpy.uint8)

    variants = {"kv_load rows": rows_copy, "kv_load runs": runs_copy, "kv_load lent": lent_copy,
                "copy floor": lambda: dst.copy_(src), "load lend": lambda: loader.load(keys),
                "load copy": lambda: copier.load(keys), "load floor": load_floor}
    junk = numpy.ones(40 << 20, dtype=numpy.uint8)
    print(f"# bench_kv_load_copy — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__} (1 thread), "
          f"load average {os.getloadavg()[0]:.2f}; {n} blocks x {cache.block_bytes() >> 10} KiB = "
          f"{n * cache.block_bytes() / 2**20:.1f} MiB, reps {args.reps}")
    for cold in (False, True):
        wall = {k: [] for k in variants}
        cpu = {k: [] for k in variants}
        for rep in range(args.reps + 3):
            for name, fn in variants.items():
                if cold:
                    junk += 1
                t, c = time.perf_counter(), time.thread_time()
                fn()
                if rep >= 3:  # the first reps map pages and warm the allocator
                    wall[name].append((time.perf_counter() - t) * 1e3)
                    cpu[name].append((time.thread_time() - c) * 1e3)
        print(f"\n{'cold' if cold else 'warm'} (ms)        wall median   min   cpu median   min")
        for name in variants:
            print(f"  {name:14s} {statistics.median(wall[name]):10.2f} {min(wall[name]):6.2f} "
                  f"{statistics.median(cpu[name]):10.2f} {min(cpu[name]):6.2f}")
    print(f"\nload average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
