"""TTFT through the engine with Mooncake Store as the pool: prefix hits and async vs sync save.

    python benchmarks/bench_mooncake_ttft.py [--reps 15] [--prompt-len 256] [--layers 6 ...]

Re-executes itself under ``unshare -n`` (root) and starts its own ``mooncake_server serve`` on
loopback in that private network namespace; every engine runs in this process on the generated
CPU graphs of a random Qwen3-style checkpoint (the model knobs are ``bench_ttft.py``'s).

(a) 50% prefix hit: the first half of a fresh prompt is run and drained, then the full prompt is
    measured: half its blocks are loaded from the pool, the rest computed (splitfuse). Configurations:
    ``mooncake`` (write async, pool ``mooncake://``), ``host`` (write async, the embedded pool),
    ``off`` (write off: no prefix cache, the full prompt cold).
(b) cold prompts, Mooncake as the pool: ``sync`` (the commit — pack + put of every block through
    Mooncake, a real transfer — runs before the first token) vs ``async`` (commit on the host
    stream) vs ``off`` (no save). The save's share of the forward is ``(sync - off) / off``.

Each engine keys its blocks under its own model name, so configurations never hit each other's
blocks. Configurations are interleaved (order rotated every round), the same prompt for all in a
round, a fresh prompt every round, every request drained before the next; medians and the median
of per-round ratios ("paired") are printed. The first token must agree across configurations.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

PORT = 50310


def med(xs):
    return statistics.median(xs)


def paired(xs, base):
    return med([a / b for a, b in zip(xs, base)])


def section(engines, reps, prompts, hit: bool):
    from bench_ttft import one, rotated
    names = list(engines)
    ttft = {n: [] for n in names}
    commit = {n: [] for n in names}
    for r in range(reps):
        p = prompts.next()
        half = len(p) // 2
        first = {}
        for n in rotated(names, r):
            e = engines[n]
            if hit and e.write != "off":
                one(e, p[:half])
                e.drain()
            res = one(e, p)
            t = time.perf_counter()
            e.drain()
            commit[n].append((time.perf_counter() - t) * 1e3)
            want = half if hit and e.write != "off" else 0
            assert res.hit_tokens == want, (n, res.hit_tokens, want)
            ttft[n].append(res.ttft_ms)
            first[n] = res.tokens[0]
        assert len(set(first.values())) == 1, f"first token differs: {first}"
    return ttft, commit


def report(title, ttft, base, ratios, commit=None):
    print(f"\n### {title}\n")
    print(f"| configuration | median TTFT ms | min | max | n | / {base} (medians) | / {base} (paired) |")
    print("|---|---|---|---|---|---|---|")
    for n, xs in ttft.items():
        print(f"| {n} | {med(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} | {len(xs)} | "
              f"{med(xs) / med(ttft[base]):.3f} | {paired(xs, ttft[base]):.3f} |")
    for a, b in ratios:
        print(f"\n{a} / {b} = {med(ttft[a]) / med(ttft[b]):.3f} (medians), "
              f"{paired(ttft[a], ttft[b]):.3f} (paired)")
    if commit:
        print("\nmedian drain after the request (ms; the async commit still in flight): "
              + ", ".join(f"{n} {med(v):.2f}" for n, v in commit.items()))
    print("\nraw TTFT ms: " + str({n: [round(x, 2) for x in v] for n, v in ttft.items()}))


def bench(args):
    import torch
    from bench_ttft import Prompts, bench_spec, bench_weights, one
    from graphgen.runtime import open_engine

    torch.set_num_threads(args.threads)
    server = subprocess.Popen([sys.executable, "-m", "graphgen.runtime.pool.mooncake_server", "serve",
                               "--port", str(PORT), "--segment", args.segment],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        line = server.stdout.readline()
        assert line.startswith("ready"), line
        url = f"mooncake://127.0.0.1:{PORT}?buffer={args.buffer}"
        spec = bench_spec(args)
        weights = bench_weights(spec)
        d = spec.dims
        kv_bytes = 2 * d.num_hidden_layers * spec.kv_cache.block_size * d.num_key_value_heads * d.head_dim * 4
        nb = args.prompt_len // spec.kv_cache.block_size
        print(f"# bench_mooncake_ttft — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__} "
              f"({torch.get_num_threads()} intra-op threads), {os.cpu_count()} CPUs")
        argv = [a for a in sys.argv if a != "--in-netns"]
        print(f"command: {' '.join([Path(sys.executable).name, *argv])}")
        print(f"model: qwen3_dense, {d.num_hidden_layers} layers, hidden {d.hidden_size}, kv heads "
              f"{d.num_key_value_heads} x {d.head_dim}, block size {spec.kv_cache.block_size}, float32; "
              f"prompt {args.prompt_len} tokens = {nb} blocks of {kv_bytes / 1024:.0f} KiB "
              f"({nb * kv_bytes / 2**20:.2f} MiB saved per cold request); {args.reps} rounds; pool {url}")

        def engine(name, write, pool):
            s = dataclasses.replace(spec, name=f"mc_{name}").with_overrides(write=write, granularity="forward")
            return open_engine(s, weights, spec_file="benchmarks/bench_mooncake_ttft.py", generated_dir=None,
                               pool=pool, pool_capacity_bytes=1 << 30)

        def warm(engines):
            w = Prompts(424242, args.vocab, args.prompt_len)
            for e in engines.values():
                for _ in range(2):
                    one(e, w.next())
                    e.drain()

        if "a" in args.sections:
            engines = {"mooncake 50% hit": engine("a_mc", "async", url),
                       "host 50% hit": engine("a_host", "async", "host"),
                       "off (no prefix cache)": engine("a_off", "off", "host")}
            warm(engines)
            ttft, _ = section(engines, args.reps, Prompts(1, args.vocab, args.prompt_len), hit=True)
            report("(a) 50% prefix hit: Mooncake vs host pool vs no prefix cache", ttft,
                   "off (no prefix cache)", [("mooncake 50% hit", "host 50% hit")])
            for e in engines.values():
                e.close()
        if "b" in args.sections:
            engines = {"off": engine("b_off", "off", "host"), "sync": engine("b_sync", "sync", url),
                       "async": engine("b_async", "async", url)}
            warm(engines)
            ttft, commit = section(engines, args.reps, Prompts(2, args.vocab, args.prompt_len), hit=False)
            report("(b) cold prompt, Mooncake pool: async vs sync save", ttft, "off",
                   [("async", "sync")], commit)
            share = (med(ttft["sync"]) - med(ttft["off"])) / med(ttft["off"])
            print(f"\nsave share of the forward: (sync - off) / off = {share:.1%} (medians); "
                  f"paired {paired(ttft['sync'], ttft['off']) - 1:.1%}")
            print("pool stats (async engine): " + str({k: v for k, v in engines["async"].connector.pool_stats().items() if v}))
            for e in engines.values():
                e.close()
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    os._exit(0)      # skip Mooncake's client teardown


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    from bench_ttft import add_model_args

    add_model_args(ap)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--sections", default="ab")
    ap.add_argument("--buffer", default="16MiB", help="each registered pool buffer")
    ap.add_argument("--segment", default="1GiB", help="storage held by the server")
    ap.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from graphgen.runtime.pool.mooncake_server import reexec_in_private_netns

    reexec_in_private_netns("bench_mooncake_ttft.py")
    bench(args)


if __name__ == "__main__":
    main()
