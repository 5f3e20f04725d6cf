"""How long a multi-rank engine takes to start, spawned vs forked from the launcher's forkserver
(`graphgen/runtime/parallel/launcher.py`, issue 29): wall from ``DistributedEngine(...)`` to ready,
and the CPU seconds of each child process (ranks and pool) up to ready, from ``/proc/PID/stat``.

``spawn`` starts a fresh interpreter per rank and for the pool (each rank imports torch);
``forkserver`` forks them from a server that imported torch and the rank modules once per parent
process: its own start (one torch import) is paid by the first forkserver launch and reported apart.
The two are interleaved round-robin (order rotated per round), medians reported.

    .venv/bin/python benchmarks/bench_rank_start.py [--rounds 5 --spec specs/tiny_qwen3_tp2.yaml]
"""
from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """user + system CPU seconds of process ``pid`` so far (``/proc/PID/stat`` fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _launch(method: str, spec, weights) -> dict:
    import graphgen.runtime.parallel.launcher as launcher

    real = launcher._process_context
    if method == "spawn":
        launcher._process_context = lambda: mp.get_context("spawn")
    try:
        t = time.perf_counter()
        eng = launcher.DistributedEngine(spec, weights, spec_file=str(REPO / "specs/tiny_qwen3_tp2.yaml"))
        wall = time.perf_counter() - t
        ranks = [_cpu_s(p.pid) for p in eng._procs]
        pool = _cpu_s(eng._pool_proc.pid)
        eng.close()
    finally:
        launcher._process_context = real
    return {"wall": wall, "rank_cpu": statistics.mean(ranks), "pool_cpu": pool, "cpu": sum(ranks) + pool}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--spec", default="specs/tiny_qwen3_tp2.yaml")
    a = ap.parse_args(argv)

    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(REPO / a.spec)
    out = {"spawn": [], "forkserver": []}
    with tempfile.TemporaryDirectory() as d:
        write_random_hf_checkpoint(d, spec.family, dataclasses.asdict(spec.dims), seed=0)
        first = _launch("forkserver", spec, d)   # starts the forkserver (one torch import)
        from multiprocessing import forkserver

        server_cpu = _cpu_s(forkserver._forkserver._forkserver_pid)  # type: ignore[attr-defined]
        for r in range(a.rounds):
            order = ["spawn", "forkserver"] if r % 2 == 0 else ["forkserver", "spawn"]
            for m in order:
                out[m].append(_launch(m, spec, d))
    print(f"spec {a.spec}: world {spec.parallel.world}; load {os.getloadavg()[0]:.1f}; {a.rounds} rounds; "
          f"medians (s)")
    print("| start | wall to ready | CPU per rank | CPU pool | CPU all children |")
    print("|---|---|---|---|---|")
    for m, rows in out.items():
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        print(f"| {m} | {med['wall']:.2f} | {med['rank_cpu']:.2f} | {med['pool_cpu']:.2f} | {med['cpu']:.2f} |")
    print(f"| forkserver, first launch (starts the server) | {first['wall']:.2f} | {first['rank_cpu']:.2f} | "
          f"{first['pool_cpu']:.2f} | {first['cpu']:.2f} + server {server_cpu:.2f} |")


if __name__ == "__main__":
    main()
