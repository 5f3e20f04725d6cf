"""Benchmark of the build path: `graphgen generate` as a user runs it, and how the passes scale.

(a) Wall time of `graphgen generate` of every shipped spec (specs/*.yaml, the full-size Qwen3-32B and
    DeepSeek-V3.1 included) into a fresh temp folder, each run a cold subprocess. Three
    configurations are interleaved round-robin and their medians compared:
      - `python -c "import graphgen.cli"`        (interpreter + import floor)
      - generate, specs as shipped               (every target: cpu + npu templates)
      - generate, the same specs, CPU target only (written to a temp folder with the npu target
        removed; shows what the NPU lowering costs)
    The child checks `'torch' not in sys.modules` after `graphgen.cli.main()` (the build path must
    never import torch) and reports it.

(b) Scaling: qwen3_dense and deepseek_v3 specs built in memory from the tiny specs with 16, 64, 256
    and 1024 layers; `run_pipeline` (build + passes, per pass via ``on_pass``) and `verify.check`
    (again, on the finished graph) are timed separately for the async, layer-granularity prefill
    variant (`mempool_prefill_layer`: the most events). Reported: ms per layer, and
    scale = (t_L / t_16) / (L / 16): ~1 is linear, ~L/16 is quadratic.

Usage (from the repo root):
    .venv/bin/python benchmarks/bench_generate.py                 # default, < 60 s on 2 cores
    .venv/bin/python benchmarks/bench_generate.py --runs 15 --reps 5   # longer
    .venv/bin/python benchmarks/bench_generate.py --profile       # + cProfile of the largest build
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MARK = "BENCH_RESULT "

# Runs in a fresh interpreter. argv[1]: JSON list of CLI args (or null: import only).
CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from graphgen.cli import main
args = json.loads(sys.argv[1])
rc, err = 0, ""
if args is not None:
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        rc, err = 99, f"{type(e).__name__}: {e}"
print(%r + json.dumps({"rc": rc, "err": err, "torch_imported": "torch" in sys.modules,
                       "in_process_s": time.perf_counter() - t0}))
""" % MARK


def shipped_specs() -> list[Path]:
    return sorted((REPO / "specs").glob("*.yaml"))


def cpu_only_copies(specs: list[Path], folder: Path) -> list[Path]:
    """The shipped specs with the npu target removed, written as YAML under ``folder``."""
    from graphgen.modelspec.loader import dump_spec_yaml, load_spec
    from graphgen.modelspec.model import CpuTarget, Targets

    out = []
    for p in specs:
        spec = dataclasses.replace(load_spec(p), targets=Targets(cpu=CpuTarget()))
        q = folder / p.name
        q.write_text(dump_spec_yaml(spec), encoding="utf-8")
        out.append(q)
    return out


def run_child(cli_args) -> tuple[float, dict]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cli_args)], cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    if not lines:
        return wall, {"rc": proc.returncode, "err": (proc.stderr.strip().splitlines() or ["?"])[-1],
                      "torch_imported": None}
    info = json.loads(lines[-1][len(MARK):])
    if info["rc"] and not info["err"]:
        info["err"] = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return wall, info


def bench_generate_cli(runs: int) -> None:
    specs = shipped_specs()
    tmp = Path(tempfile.mkdtemp(prefix="bench_generate_"))
    try:
        cpu_specs = cpu_only_copies(specs, tmp)
        configs = {
            "import graphgen.cli only": None,
            "generate, specs as shipped (cpu+npu)": (specs, True),
            "generate, cpu target only": (cpu_specs, False),
        }
        times = {k: [] for k in configs}
        info = {}
        n_files = {}
        names = list(configs)
        for r in range(runs):
            for k in names[r % len(names):] + names[:r % len(names)]:  # rotate the order each round
                cfg = configs[k]
                if cfg is None:
                    wall, inf = run_child(None)
                else:
                    out = tmp / f"out_{r}_{names.index(k)}"
                    args = ["generate", "--out", str(out)]
                    for s in cfg[0]:
                        args += ["--spec", str(s)]
                    wall, inf = run_child(args)
                    n_files[k] = sum(1 for p in out.rglob("*") if p.is_file()) if out.exists() else 0
                    shutil.rmtree(out, ignore_errors=True)
                times[k].append(wall)
                info[k] = inf
        print(f"\n### (a) `graphgen generate` of all shipped specs, cold subprocess "
              f"(median of {runs}, interleaved)\n")
        print(f"specs: {', '.join(p.name for p in specs)}\n")
        base = statistics.median(times[names[0]])
        print("| configuration | median wall s | min s | max s | files written | exit | torch imported | vs import-only |")
        print("|---|---|---|---|---|---|---|---|")
        for k in names:
            t = times[k]
            inf = info[k]
            status = "ok" if inf["rc"] == 0 else f"FAILED rc={inf['rc']}"
            print(f"| {k} | {statistics.median(t):.3f} | {min(t):.3f} | {max(t):.3f} | "
                  f"{n_files.get(k, '-')} | {status} | {inf['torch_imported']} | "
                  f"{statistics.median(t) / base:.2f}x |")
        for k in names:
            if info[k]["rc"]:
                print(f"\n{k}: FAILED: {info[k]['err']}")
        print("\nraw wall seconds: " + json.dumps({k: [round(x, 4) for x in v] for k, v in times.items()}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def scaled_spec(base, layers: int):
    dims = dataclasses.replace(base.dims, num_hidden_layers=layers)
    return dataclasses.replace(base, dims=dims).with_overrides(write="async")


def bench_scaling(reps: int, sizes: list[int], profile: bool, min_s: float = 0.2) -> None:
    from graphgen.passes import verify
    from graphgen.passes.manager import PASS_NAMES, run_pipeline
    from graphgen.modelspec.loader import load_spec

    variant = "mempool_prefill_layer"
    bases = {"qwen3_dense": load_spec(REPO / "specs/tiny_qwen3.yaml"),
             "deepseek_v3": load_spec(REPO / "specs/tiny_deepseek_v3.yaml")}
    # (family, L) -> {"pipeline": [...], "check": [...], pass name: [...]}
    res: dict = {}
    nodes: dict = {}
    inner_counts: dict = {}
    cells = [(f, n) for f in bases for n in sizes]
    for r in range(reps):
        for f, n in cells[r % len(cells):] + cells[:r % len(cells)]:
            spec = scaled_spec(bases[f], n)
            assert spec.variants[variant].granularity == "layer" and spec.pool.write == "async"
            inner: dict = {}
            spent = 0.0
            while True:  # small sizes: repeat within the round until ~min_s is spent (timeit-style)
                stamps = []
                t0 = time.perf_counter()
                g = run_pipeline(spec, variant,
                                 on_pass=lambda name, _g: stamps.append((name, time.perf_counter())))
                t1 = time.perf_counter()
                problems = verify.check(g)
                t2 = time.perf_counter()
                assert not problems, problems[:3]
                gc.disable()  # the same check without the cyclic GC's full-heap passes
                try:
                    t3 = time.perf_counter()
                    verify.check(g)
                    t4 = time.perf_counter()
                finally:
                    gc.enable()
                inner.setdefault("pipeline", []).append(t1 - t0)
                inner.setdefault("check", []).append(t2 - t1)
                inner.setdefault("check_nogc", []).append(t4 - t3)
                prev = t0
                for name, t in stamps:
                    inner.setdefault(name, []).append(t - prev)
                    prev = t
                nodes[(f, n)] = (len(g.nodes), len(g.events))
                del g
                spent += t4 - t0
                if spent >= min_s:
                    break
            d = res.setdefault((f, n), {})
            for m, v in inner.items():  # one sample per round: the median of its inner repeats
                d.setdefault(m, []).append(statistics.median(v))
            inner_counts[(f, n)] = len(inner["pipeline"])
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in res.items()}
    base_n = sizes[0]
    print(f"\n### (b) scaling of build + passes and of verify.check ({variant}, write=async, "
          f"granularity=layer; median over {reps} interleaved rounds, small sizes repeated within a round)\n")
    print("scale = (t_L / t_%d) / (L / %d): 1.0 = linear, %d = quadratic at L=%d. "
          "verify.check is timed twice: as is, and with the cyclic GC disabled.\n"
          % (base_n, base_n, sizes[-1] // base_n, sizes[-1]))
    print("| family | layers | nodes | events | run_pipeline ms | ms/layer | scale | verify.check ms | "
          "ms/layer | scale | check, gc off ms | scale | " + " | ".join(f"{p} ms" for p in PASS_NAMES) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(PASS_NAMES))
    for f in bases:
        b = med[(f, base_n)]
        for n in sizes:
            m = med[(f, n)]
            k = n / base_n
            print(f"| {f} | {n} | {nodes[(f, n)][0]} | {nodes[(f, n)][1]} | {m['pipeline'] * 1e3:.1f} | "
                  f"{m['pipeline'] * 1e3 / n:.3f} | {m['pipeline'] / b['pipeline'] / k:.2f} | "
                  f"{m['check'] * 1e3:.1f} | {m['check'] * 1e3 / n:.3f} | {m['check'] / b['check'] / k:.2f} | "
                  f"{m['check_nogc'] * 1e3:.1f} | {m['check_nogc'] / b['check_nogc'] / k:.2f} | "
                  + " | ".join(f"{m[p] * 1e3:.1f}" for p in PASS_NAMES) + " |")
    print("\nraw seconds, one sample per round (the median of its inner repeats; repeats per round: "
          + ", ".join(f"{f}/{n}: {c}" for (f, n), c in inner_counts.items()) + "):\n"
          + json.dumps({f"{f}/{n}": {m: [round(x, 5) for x in v] for m, v in d.items()}
                        for (f, n), d in res.items()}))
    if profile:
        import cProfile
        import io
        import pstats

        n = sizes[-1]
        spec = scaled_spec(bases["qwen3_dense"], n)
        pr = cProfile.Profile()
        pr.enable()
        run_pipeline(spec, variant)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8)
        print(f"\n### cProfile of run_pipeline, qwen3_dense, {n} layers (top 8 by own time)\n\n```")
        print("\n".join(ln for ln in s.getvalue().splitlines() if ln.strip())[:4000])
        print("```")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="subprocess runs per configuration in (a)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per size in (b)")
    ap.add_argument("--sizes", default="16,64,256,1024", help="layer counts for (b); the first is the base")
    ap.add_argument("--skip-cli", action="store_true", help="skip (a)")
    ap.add_argument("--skip-scaling", action="store_true", help="skip (b)")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest qwen3 build")
    args = ap.parse_args(argv)
    print(f"# bench_generate — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {platform.python_implementation()} "
          f"{platform.python_version()}, {os.cpu_count()} CPUs, {platform.machine()}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    t = time.perf_counter()
    if not args.skip_cli:
        bench_generate_cli(args.runs)
    if not args.skip_scaling:
        bench_scaling(args.reps, [int(x) for x in args.sizes.split(",")], args.profile)
    print(f"\n(total {time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
