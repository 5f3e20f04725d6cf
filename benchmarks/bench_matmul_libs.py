"""MKL vs oneDNN for the CPU target's matmul shapes, one thread: the measurement behind
`graphgen/runtime/core/matmul.py`'s choice (which library multiplies several rows).

For each weight shape of the bench model (``bench_cpu_kernels.py``'s defaults: hidden 512, merged
q/k/v 768, merged gate/up 3072, down 1536 -> 512) and each row count, the median of ``--reps`` timed
calls of ``torch.mm(x, w_t)`` (MKL, the ``[in, out]`` load-time layout) and of oneDNN's
``torch.ops.mkldnn._linear_pointwise(x, w_t.t())`` (the same memory viewed ``[out, in]``), interleaved.
The ratio oneDNN / MKL < 1 means oneDNN is faster.

    .venv/bin/python benchmarks/bench_matmul_libs.py [--rows 1,4,16,512,2048 --reps 15]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch


def _median_ms(fns, reps: int) -> list[float]:
    times = [[] for _ in fns]
    for f in fns:   # warm-up (oneDNN builds its primitive on first use)
        f()
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            f()
            times[i].append((time.perf_counter() - t) * 1e3)
    return [statistics.median(t) for t in times]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,512,2048")
    ap.add_argument("--shapes", default="512x768,512x3072,1536x512", help="IN x OUT of each weight")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    onednn = torch.ops.mkldnn._linear_pointwise
    print(f"# bench_matmul_libs — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__}, "
          f"kernels {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), {os.cpu_count()} CPUs "
          f"({platform.machine()}), load average {os.getloadavg()[0]:.1f}; medians of {args.reps}")
    print("| rows | weight in x out | MKL mm ms | oneDNN ms | oneDNN / MKL |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        for shape in args.shapes.split(","):
            n_in, n_out = (int(v) for v in shape.split("x"))
            x, w_t = torch.randn(rows, n_in, generator=g), torch.randn(n_in, n_out, generator=g)
            w = w_t.t()
            mkl, dnn = _median_ms([lambda: torch.mm(x, w_t), lambda: onednn(x, w, None, "none", [], "")], args.reps)
            print(f"| {rows} | {n_in}x{n_out} | {mkl:.3f} | {dnn:.3f} | {dnn / mkl:.2f} |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
