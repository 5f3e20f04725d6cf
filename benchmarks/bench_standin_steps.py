"""``graphgen compile --target npu --standin --steps N`` as a user runs it, against the same loop computing
values on CPU (what the command did before issue 29): wall and CPU seconds of each, cold subprocesses,
interleaved.

Configurations, each a fresh interpreter (imports included), CPU time from the child's rusage:

* ``cli``: the command as shipped (``run_standin_loop`` on meta tensors: Dynamo + AOT per graph, each step's
  kernel calls checked on shapes and lengths, no values computed);
* ``cpu``: ``run_standin_loop(..., device="cpu")`` with the same spec, variants and steps (every step computed
  by the stand-in's CPU kernels: the padded bf16 buckets of a hardware-shaped spec), then the same checks the
  command runs after the loop are skipped (they take milliseconds).

    .venv/bin/python benchmarks/bench_standin_steps.py [--spec specs/tiny_deepseek_v3_npu.yaml --variant splitfuse
        --steps 2 --reps 1 --configs cli,cpu]

The issue's figure is ``--steps 24`` over every variant (``--variant ''``): ``--configs cli`` for it (the
``cpu`` loop of it takes ~25 minutes of CPU here).
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_LOOP = ("import sys; from graphgen.modelspec.loader import load_spec; "
            "from graphgen.npu.run.bucketing import report, run_standin_loop; "
            "spec = load_spec(sys.argv[1]); variants = [sys.argv[2]] if sys.argv[2] else None; "
            "sys.exit(report(run_standin_loop(spec, variants, steps=int(sys.argv[3]), device='cpu')))")


def _argv(config: str, spec: str, variant: str, steps: int) -> list[str]:
    if config == "cli":
        return [sys.executable, "-m", "graphgen.cli", "compile", "--target", "npu", "--spec", spec, "--standin",
                "--steps", str(steps), *(["--variant", variant] if variant else [])]
    return [sys.executable, "-c", CPU_LOOP, spec, variant, str(steps)]


def _run(argv: list[str]) -> tuple[float, float, int, str]:
    """(wall s, CPU s of the child, exit status, the graph-count lines it printed)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    res = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = [line for line in res.stdout.splitlines() if "graphs compiled=" in line]
    if res.returncode:
        print(res.stdout[-2000:], res.stderr[-3000:], file=sys.stderr)
    return wall, cpu, res.returncode, "; ".join(" ".join(r.split()) for r in rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="specs/tiny_deepseek_v3_npu.yaml")
    ap.add_argument("--variant", default="splitfuse", help="'' for every variant of the spec")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--configs", default="cli,cpu")
    args = ap.parse_args(argv)
    configs = args.configs.split(",")
    print(f"# bench_standin_steps — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {os.cpu_count()} CPUs "
          f"({platform.machine()}), load average {os.getloadavg()[0]:.1f}; spec {args.spec}, variant "
          f"{args.variant or 'all'}, --steps {args.steps}, {args.reps} interleaved round(s)")
    got: dict = {c: [] for c in configs}
    for rnd in range(args.reps):
        for c in configs[rnd % len(configs):] + configs[:rnd % len(configs)]:  # order rotated every round
            got[c].append(_run(_argv(c, args.spec, args.variant, args.steps)))
            wall, cpu, rc, rows = got[c][-1]
            print(f"round {rnd + 1} {c}: wall {wall:.1f} s, CPU {cpu:.1f} s, exit {rc}, load {os.getloadavg()[0]:.1f}"
                  f" | {rows}", flush=True)
    print("| config | median wall s | median CPU s (user+sys) | CPU vs cli |")
    print("|---|---|---|---|")
    base = statistics.median(r[1] for r in got[configs[0]])
    for c in configs:
        w, u = statistics.median(r[0] for r in got[c]), statistics.median(r[1] for r in got[c])
        print(f"| {c} | {w:.1f} | {u:.1f} | {u / base:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
