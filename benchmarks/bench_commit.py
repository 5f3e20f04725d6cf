"""The host commit of a save, sync vs async, with the packings of before and after issue 17 (item 2, acceptance (b)).

The real `KVConnector` commits one 2k-token prompt's save (128 blocks of the 6-layer bench model's
layout: 6 layers x (k, v) x [16, 2, 64] float32 = 96 KiB a block) into the embedded `HostPool`:

  sync    the commit runs inline on the main thread, nothing else running;
  async   the commit runs on the connector's host thread while the main thread runs a forward-like
          loop (torch matmuls of the 6-layer bench model's decode shapes, plus Python between them).

Packing: ``per-component`` is the old `pack_block` (one torch copy per layer and component per
block: 12 torch calls a block, each a GIL release and re-acquire) — forced by handing the connector
a plain-list staging; ``packed/numpy`` is a `PackedStaging` in torch memory (a block's value is one
row of one buffer: one numpy memcpy, GIL held; the connector's staging for ``write: sync``);
``packed/memfd`` is the same rows over a memfd mapping, read with ``os.pread`` (the copy runs with
the GIL released; the connector's staging for ``write: async``).
Reported: commit wall ms (observer span: the puts, after the save event), and the forward loop's
ms per step while a commit runs vs alone.

    .venv/bin/python benchmarks/bench_commit.py [--blocks 128 --reps 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from graphgen.runtime.core import ops  # noqa: E402
from graphgen.runtime.core.kvcache import BlockAllocator, PagedKVCache  # noqa: E402
from graphgen.runtime.engine.connector import KVConnector  # noqa: E402
from graphgen.runtime.pool.host import HostPool  # noqa: E402


PACKINGS = ("per-component", "packed/numpy", "packed/memfd")


class Done:
    """A save event already recorded (the save copies ran before the commit starts)."""

    def wait(self, timeout=None):
        return None

    def exception(self, timeout=None):
        return None


class Spans:
    def __init__(self):
        self.commits = []

    def commit(self, t0, t1, **_):
        self.commits.append((t1 - t0) * 1e3)


class StagingAs:
    """The cache, but its save staging is made as ``packing`` says (whatever the connector asks): a
    plain list (the connector then packs per component, the old path), a torch-memory
    `PackedStaging` (numpy row copies) or a memfd one (os.pread)."""

    def __init__(self, cache, packing: str):
        self._c, self.packing = cache, packing

    def make_staging(self, n, **_):
        staging = self._c.make_staging(n, shared_memory=self.packing == "packed/memfd")
        return list(staging) if self.packing == "per-component" else staging

    def __getattr__(self, name):
        return getattr(self._c, name)


def forward_loop(stop: threading.Event, steps: list, weights):
    x = torch.randn(1, 256)
    while not stop.is_set():
        t = time.perf_counter()
        for w in weights:
            y = F.linear(x, w)
            y = y[:, :256] * 1.0
        steps.append((time.perf_counter() - t) * 1e3)


def run(packing: str, mode: str, args, counter):
    cache = PagedKVCache(6, {"k": (16, 2, 64), "v": (16, 2, 64)}, args.blocks + 8)
    for layer in cache:
        for t in layer:
            t.normal_()
    conn_cache = StagingAs(cache, packing)
    alloc = BlockAllocator(cache.num_blocks)
    block_ids = alloc.alloc(args.blocks)  # held for the whole run: each save pins and unpins them
    conn = KVConnector(HostPool(1 << 34), conn_cache, alloc, write=mode)
    spans = Spans()
    conn.observer = spans
    weights = [torch.randn(768, 256) for _ in range(6 * 7)]
    ids = torch.tensor(block_ids)
    alone, during = [], []
    for _ in range(args.reps):
        save = conn.prepare_save(block_ids, [f"k{next(counter)}" for _ in range(args.blocks)])
        for i in range(cache.num_layers):
            ops.kv_save(cache[i], ids, save.staging[i])
        if mode == "sync":
            conn.handoff(save, None, Done())
            continue
        stop, steps = threading.Event(), []
        th = threading.Thread(target=forward_loop, args=(stop, steps, weights))
        th.start()
        time.sleep(0.02)  # the forward loop is running
        n0 = len(steps)
        conn.handoff(save, None, Done())
        conn.drain()
        n1 = len(steps)
        time.sleep(0.02)
        stop.set()
        th.join()
        during.extend(steps[n0:n1 + 1])
        alone.extend(steps[1:n0] + steps[n1 + 1:])
    conn.close()
    return spans.commits, alone, during


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# bench_commit — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.blocks} blocks of 96 KiB per "
          f"commit, {args.reps} commits per row")
    counter = iter(range(1 << 62))
    res = {}
    for rep in range(2):  # two passes, order reversed in the second: drift shows as a difference
        combos = [(p, m) for p in PACKINGS for m in ("sync", "async")]
        for p, m in (combos if rep == 0 else combos[::-1]):
            c, a, d = run(p, m, args, counter)
            r = res.setdefault((p, m), ([], [], []))
            r[0].extend(c), r[1].extend(a), r[2].extend(d)
    med = statistics.median
    print("\n| packing | mode | commit ms p50 | p90 | forward step ms alone (p50) | during a commit (p50) |"
          "\n|---|---|---|---|---|---|")
    for (p, m), (c, a, d) in res.items():
        q = statistics.quantiles(c, n=10)[-1] if len(c) > 1 else c[0]
        print(f"| {p} | {m} | {med(c):.2f} | {q:.2f} | {med(a):.3f} | " + (f"{med(d):.3f} |" if d else "– |")
              if a else f"| {p} | {m} | {med(c):.2f} | {q:.2f} | – | – |")
    for p in PACKINGS:
        print(f"{p}: async/sync commit p50 {med(res[(p, 'async')][0]) / med(res[(p, 'sync')][0]):.2f}")
    for p in PACKINGS[1:]:
        print(f"{p}/per-component commit p50: sync {med(res[(p, 'sync')][0]) / med(res[('per-component', 'sync')][0]):.2f}, "
              f"async {med(res[(p, 'async')][0]) / med(res[('per-component', 'async')][0]):.2f}")
    print("forward step during an async commit / alone (p50): " + ", ".join(
        f"{p} {med(res[(p, 'async')][2]) / med(res[(p, 'async')][1]):.2f}" for p in PACKINGS))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
