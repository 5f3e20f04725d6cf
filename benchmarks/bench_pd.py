"""P/D benchmark: 2P1D (async and sync save in P) vs one and two ``both`` instances behind the
router, at 32 concurrent streaming clients with long prompts; TTFT and inter-token latency.

Each configuration is one ``scripts/pd_cluster.py`` run (a Mooncake store, the instances, the
router, all in a private network namespace) whose ``--then`` runs this file with ``--load``
inside the namespace: a warm-up, then closed-loop streaming clients (``bench_serve.run_load``:
stdlib HTTP + SSE) against the router. Prompts: cold random ids (no prefix shared between
requests), ``--prompt-len`` tokens (default 2048: long prompts, run in chunks of at most
``--max-num-batched-tokens`` per step, chunked prefill being on by default), ``--max-tokens`` new,
greedy. ``--block-size`` (default 16) runs a copy of the spec with that KV block size: P/D moves
one pool value per block, and the tiny spec's block of 4 tokens (2 KiB) makes a 2k-token prompt
511 puts on P and 511 loads on D, which on loopback TCP cost more than the tiny model's prefill.
Every instance gets ``--num-blocks`` device blocks (default: every client's prompt and
tokens at once, so nothing is preempted). TTFT is the client's (request sent -> first SSE token
chunk), ITL the gaps between later tokens.

On a 2-core machine the instances share the same cores, so this is a functional comparison and
the async-vs-sync ratio of P's save, not the speed-up that separate hardware gives P and D.

Usage (repo root, as root for ``unshare -n``):
    .venv/bin/python benchmarks/bench_pd.py --weights CKPT [--requests 32] [--prompt-len 2048] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

# async vs sync is P's save alone: D saves async in both (its own saves are not the comparison)
CONFIGS = (("2P1D async", ["--prefill", "2", "--decode", "1", "--write", "async", "--decode-write", "async"]),
           ("2P1D sync", ["--prefill", "2", "--decode", "1", "--write", "sync", "--decode-write", "async"]),
           ("1 both", ["--both", "1", "--write", "async"]),
           ("2 both", ["--both", "2", "--write", "async"]))


def _with_block_size(spec: str, block_size: int, folder: str) -> str:
    """A copy of the spec file with another KV block size (and name: its pool keys are its own)."""
    import yaml

    doc = yaml.safe_load(Path(spec).read_text())
    doc["kv_cache"]["block_size"] = block_size
    doc["name"] = f"{doc['name']}_b{block_size}"
    out = Path(folder) / f"{doc['name']}.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(out)


def _router_sums(url: str) -> dict:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    want = ("graphgen_route_prefill_seconds_count", "graphgen_route_prefill_seconds_sum")
    out = dict.fromkeys(want, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[name] = float(value)
    return out


def load(args) -> int:
    import random

    from bench_serve import _pct, run_load

    port = urlsplit(os.environ["ROUTER_URL"]).port
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, 150) for _ in range(args.prompt_len)] for _ in range(args.requests + args.warmup)]
    run_load(port, prompts[:args.warmup], 4, args.max_tokens, 300)  # warm-up: every instance's first steps
    before = _router_sums(os.environ["ROUTER_URL"])
    out = run_load(port, prompts[args.warmup:], args.clients, args.max_tokens, args.budget)
    after = _router_sums(os.environ["ROUTER_URL"])
    prefill_n = after["graphgen_route_prefill_seconds_count"] - before["graphgen_route_prefill_seconds_count"]
    prefill_s = after["graphgen_route_prefill_seconds_sum"] - before["graphgen_route_prefill_seconds_sum"]
    ttft = [r[0] * 1e3 for r in out["results"]]
    itl = [g * 1e3 for r in out["results"] for g in r[1]]
    tokens = sum(r[2] for r in out["results"])
    res = {"requests": len(out["results"]), "errors": len(out["errors"]), "wall_s": out["wall_s"],
           "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99), "itl_p50": _pct(itl, 50),
           "itl_p99": _pct(itl, 99), "tokens_per_s": tokens / out["wall_s"],
           "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
           "error_samples": sorted(set(out["errors"]))[:3],
           # the router's P round trip (prefill + waiting for the blocks to be visible), per request
           "prefill_mean_ms": prefill_s / prefill_n * 1e3 if prefill_n else float("nan")}
    Path(args.out).write_text(json.dumps(res))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights", required=False)
    ap.add_argument("--spec", default=str(ROOT / "specs" / "tiny_qwen3.yaml"))
    ap.add_argument("--requests", type=int, default=32, help="measured requests (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests (4 clients), not measured")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="every instance's step budget (a longer prompt runs in chunks)")
    ap.add_argument("--num-blocks", type=int, default=0,
                    help="every instance's device blocks (0: every client's prompt and tokens at once)")
    ap.add_argument("--segment", default="2GiB", help="the Mooncake store's segment")
    ap.add_argument("--block-size", type=int, default=16,
                    help="run a copy of --spec with this KV block size (0: the spec's own); one pool value "
                         "per block, so P's puts and D's loads scale with prompt_len / block size")
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(n for n, _ in CONFIGS),
                    help="which configurations, comma-separated (default: all four)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of the configurations, interleaved (the machine's load drifts between runs)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--load", action="store_true", help="(internal) the clients, inside the namespace")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.load:
        return load(args)
    if not args.weights:
        ap.error("--weights is required")
    from graphgen.modelspec.loader import load_spec

    tmp = tempfile.mkdtemp(prefix="bench_pd.")
    if args.block_size and args.block_size != load_spec(args.spec).kv_cache.block_size:
        args.spec = _with_block_size(args.spec, args.block_size, tmp)
    block = load_spec(args.spec).kv_cache.block_size
    blocks = args.num_blocks or args.clients * (-(-(args.prompt_len + args.max_tokens) // block) + 1) + 64
    serve = [f"--serve-arg=--num-blocks={blocks}",
             f"--serve-arg=--max-num-batched-tokens={args.max_num_batched_tokens}"]
    print(f"bench_pd: {args.prompt_len}-token prompts, {args.requests} requests, {args.clients} clients, "
          f"--num-blocks {blocks} (block {block}), --max-num-batched-tokens {args.max_num_batched_tokens}, "
          f"chunked prefill on", flush=True)
    rows = {}
    chosen = args.configs.split(",")
    unknown = set(chosen) - {n for n, _ in CONFIGS}
    if unknown:
        ap.error(f"--configs: unknown {sorted(unknown)}; expected some of {[n for n, _ in CONFIGS]}")
    runs = [(r, i, name, flags) for r in range(args.repeat) for i, (name, flags) in enumerate(CONFIGS)
            if name in chosen]
    for rnd, i, name, flags in runs:
        if args.repeat > 1:
            name = f"{name} #{rnd + 1}"
        out = os.path.join(tmp, f"{rnd}.{i}.json")
        then = [sys.executable, __file__, "--load", "--out", out, "--requests", str(args.requests),
                "--clients", str(args.clients), "--prompt-len", str(args.prompt_len), "--warmup", str(args.warmup),
                "--max-tokens", str(args.max_tokens), "--budget", str(args.budget), "--seed", str(args.seed)]
        cmd = [sys.executable, str(ROOT / "scripts" / "pd_cluster.py"), "--spec", args.spec, "--weights",
               args.weights, "--store-port", str(50300 + i), "--router-port", "0", "--segment", args.segment,
               *serve, *flags, "--then", *then]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc != 0:
            print(f"{name}: pd_cluster exited {rc}", file=sys.stderr)
            return 1
        rows[name] = dict(json.loads(Path(out).read_text()), run_s=time.perf_counter() - t0)
        print(name, rows[name], flush=True)
    print("| config | requests | errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tokens/s "
          "| P round trip mean ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['requests']} | {r['errors']} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | "
              f"{r['itl_p50']:.1f} | {r['itl_p99']:.1f} | {r['tokens_per_s']:.0f} | {r['prefill_mean_ms']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": {
            "prompt_len": args.prompt_len, "requests": args.requests, "warmup": args.warmup, "clients": args.clients,
            "max_tokens": args.max_tokens, "num_blocks": blocks, "block_size": block,
            "max_num_batched_tokens": args.max_num_batched_tokens, "spec": args.spec}, "rows": rows}, indent=1))
    for rnd in range(args.repeat):
        tag = f" #{rnd + 1}" if args.repeat > 1 else ""
        a, s = rows.get("2P1D async" + tag), rows.get("2P1D sync" + tag)
        if a and s:
            print(f"2P1D async/sync{tag} TTFT p50 {a['ttft_p50'] / s['ttft_p50']:.3f}, "
                  f"p99 {a['ttft_p99'] / s['ttft_p99']:.3f}, mean {a['ttft_mean'] / s['ttft_mean']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
