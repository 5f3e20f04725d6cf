"""P/D benchmark: 2P1D (async and sync save in P) vs one and two ``both`` instances behind the
router, at 32 concurrent streaming clients with long prompts; TTFT and inter-token latency.

Each configuration is one ``scripts/pd_cluster.py`` run (a Mooncake store, the instances, the
router, all in a private network namespace) whose ``--then`` runs this file with ``--load``
inside the namespace: a warm-up, then closed-loop streaming clients (``bench_serve.run_load``:
stdlib HTTP + SSE) against the router. Prompts: cold random ids (no prefix shared between
requests), ``--prompt-len`` tokens, ``--max-tokens`` new, greedy. TTFT is the client's (request
sent -> first SSE token chunk), ITL the gaps between later tokens.

On a 2-core machine the instances share the same cores, so this is a functional comparison and
the async-vs-sync ratio of P's save, not the speed-up that separate hardware gives P and D.

Usage (repo root, as root for ``unshare -n``):
    .venv/bin/python benchmarks/bench_pd.py --weights CKPT [--requests 96] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

CONFIGS = (("2P1D async", ["--prefill", "2", "--decode", "1", "--write", "async"]),
           ("2P1D sync", ["--prefill", "2", "--decode", "1", "--write", "sync"]),
           ("1 both", ["--both", "1", "--write", "async"]),
           ("2 both", ["--both", "2", "--write", "async"]))


def load(args) -> int:
    import random

    from bench_serve import _pct, run_load

    port = urlsplit(os.environ["ROUTER_URL"]).port
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, 150) for _ in range(args.prompt_len)] for _ in range(args.requests + 8)]
    run_load(port, prompts[:8], 4, args.max_tokens, 120)  # warm-up: every instance's first steps
    out = run_load(port, prompts[8:], args.clients, args.max_tokens, args.budget)
    ttft = [r[0] * 1e3 for r in out["results"]]
    itl = [g * 1e3 for r in out["results"] for g in r[1]]
    tokens = sum(r[2] for r in out["results"])
    res = {"requests": len(out["results"]), "errors": len(out["errors"]), "wall_s": out["wall_s"],
           "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "itl_p50": _pct(itl, 50),
           "itl_p99": _pct(itl, 99), "tokens_per_s": tokens / out["wall_s"],
           "ttft_mean": statistics.fmean(ttft) if ttft else float("nan")}
    Path(args.out).write_text(json.dumps(res))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", required=False)
    ap.add_argument("--spec", default=str(ROOT / "specs" / "tiny_qwen3.yaml"))
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--load", action="store_true", help="(internal) the clients, inside the namespace")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.load:
        return load(args)
    if not args.weights:
        ap.error("--weights is required")
    rows = {}
    tmp = tempfile.mkdtemp(prefix="bench_pd.")
    for i, (name, flags) in enumerate(CONFIGS):
        out = os.path.join(tmp, f"{i}.json")
        then = [sys.executable, __file__, "--load", "--out", out, "--requests", str(args.requests),
                "--clients", str(args.clients), "--prompt-len", str(args.prompt_len),
                "--max-tokens", str(args.max_tokens), "--budget", str(args.budget), "--seed", str(args.seed)]
        cmd = [sys.executable, str(ROOT / "scripts" / "pd_cluster.py"), "--spec", args.spec, "--weights",
               args.weights, "--store-port", str(50300 + i), "--router-port", "0", *flags, "--then", *then]
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc != 0:
            print(f"{name}: pd_cluster exited {rc}", file=sys.stderr)
            return 1
        rows[name] = json.loads(Path(out).read_text())
        print(name, rows[name], flush=True)
    print("| config | requests | errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['requests']} | {r['errors']} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | "
              f"{r['itl_p50']:.1f} | {r['itl_p99']:.1f} | {r['tokens_per_s']:.0f} |")
    a, s = rows["2P1D async"], rows["2P1D sync"]
    print(f"2P1D async/sync TTFT p50 {a['ttft_p50'] / s['ttft_p50']:.3f}, p99 {a['ttft_p99'] / s['ttft_p99']:.3f}, "
          f"mean {a['ttft_mean'] / s['ttft_mean']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
