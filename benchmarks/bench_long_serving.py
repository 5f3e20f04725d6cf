"""Issue 17's serving acceptance rows (b) and (c) in one run, in process, on the engine's step API.

The 6-layer bench model of ``bench_ttft.py`` (hidden 256, 4/2 heads x 64, vocab 1024, block size
16, random weights, float32). ``--clients`` requests of ``--prompt-len`` tokens (default 2048)
arrive at once (one closed-loop wave: every client's first request) and decode ``--new`` tokens;
each configuration gets its own engine with ``--num-blocks`` cache blocks (default: enough for
every request's prompt and tokens at once, so nothing is preempted) and the same prompts.

  (b) TTFT p50 / p90, write ``async`` vs ``sync``, with a save slowed to ``--save-delay`` s per
      layer save (``Faults(save_delay_s=...)``, as bench_ttft/bench_serve do; the run prints the
      save's share of the mean step); chunked prefill (step budget ``--budget`` tokens) on.
      Decode inter-token latency p99 (gaps between a request's tokens after its first) with
      chunking on vs off (off: a prompt runs as one oversized step), both ``async``. ``--rounds R``
      runs the async/sync pair R times back to back (alternating which goes first) and prints each
      round's ratios and their medians: on a shared machine the load drifts between waves.
  (c) TTFT p50 / p90 at a 50 % prefix hit (each prompt's first half was run and saved first) with
      ``async`` vs the same prompts with no prefix cache (``write: off``), no fault injection.
  (a) TTFT of one ``--long-len``-token prompt: cold / 50 % pool hit / full pool hit, and with
      ``--device-cache`` (the device prefix cache, ``pool.device_cache``; refused, exit 2, on a
      branch whose spec has no such field) a full device hit, and pool-hit / device-hit.

    .venv/bin/python benchmarks/bench_long_serving.py [--clients 32,64 --prompt-len 2048 --new 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from bench_ttft import Prompts, add_model_args, bench_spec  # noqa: E402  (one home for the benchmark model)
from graphgen.runtime import open_engine  # noqa: E402
from graphgen.runtime.checkpoint.hf import load_hf_weights, write_random_hf_checkpoint  # noqa: E402
from graphgen.runtime.core.faults import Faults  # noqa: E402


def pct(xs, p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def wave(spec, weights, prompts, args, *, write, chunked, faults=None, warm_halves=False) -> dict:
    """One wave of len(prompts) requests added at once; TTFT and inter-token gaps per request."""
    need = len(prompts) * ((args.prompt_len + args.new) // spec.kv_cache.block_size + 2)
    eng = open_engine(spec.with_overrides(write=write), weights, spec_file="benchmarks/bench_long_serving.py",
                      generated_dir=None, faults=faults, pool_capacity_bytes=8 << 30,
                      num_blocks=args.num_blocks or need, max_num_batched_tokens=args.budget,
                      chunked_prefill=chunked, max_num_seqs=max(256, len(prompts)))
    eng.connector.shared_staging = write == "async" and args.async_staging == "memfd"  # the A/B of (b)
    try:
        if warm_halves:  # the pool holds each prompt's first half (saved, committed)
            eng.generate([p[:len(p) // 2] for p in prompts], 1, batch=True)
            eng.drain()
        llm = eng.core
        t_add = {}
        for i, p in enumerate(prompts):
            llm.add_request(i, p, max_tokens=args.new)
            t_add[i] = time.perf_counter()
        seen: dict[int, list[float]] = {i: [] for i in range(len(prompts))}
        steps, hits = [], {}
        while llm.has_work():
            t = time.perf_counter()
            outs = llm.step()
            now = time.perf_counter()
            steps.append((now - t) * 1e3)
            for o in outs:
                seen[o.req_id].extend([now] * len(o.new_token_ids))
                hits[o.req_id] = o.num_cached_tokens
        eng.drain()
    finally:
        eng.close()
    ttft = [(seen[i][0] - t_add[i]) * 1e3 for i in seen]
    gaps = [(b - a) * 1e3 for ts in seen.values() for a, b in zip(ts, ts[1:])]
    return {"ttft": ttft, "itl": gaps, "step_ms": steps, "hit_tokens": sum(hits.values())}


def long_ttft(spec, weights, args, device_spec) -> None:
    """(a) TTFT of one ``--long-len``-token prompt: cold, 50 % pool hit, full pool hit (device cache
    off) and full device hit (``device_spec``: the spec with ``pool.device_cache`` on; None when the
    branch has no device cache). Medians over ``--long-reps`` fresh prompts, write ``async``, the
    pool load at ``--granularity``."""
    n, gen = args.long_len, Prompts(args.seed * 1000 + 7, args.vocab, args.long_len)
    opts = dict(spec_file="benchmarks/bench_long_serving.py", generated_dir=None, pool_capacity_bytes=8 << 30,
                num_blocks=4 * (n // spec.kv_cache.block_size + 4), max_num_batched_tokens=args.budget)
    rows = {"cold": [], "50% pool hit": [], "full pool hit": [], "full device hit": []}
    hits = {k: [] for k in rows}
    over = dict(write="async", granularity=args.granularity)
    engines = {"pool": open_engine(spec.with_overrides(**over), weights, **opts)}
    # the pool hit's first extra: KVLoader.load (pool -> load staging, on the scheduler thread),
    # wall and thread CPU time; the rest of the pool/device gap is the graph's kv_load, where the
    # forward waits for it (granularity forward: all of it; layer: what compute does not hide)
    loads, loader = [], engines["pool"].loader
    fetch = loader.load

    def timed_load(keys):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fetch(keys)
        finally:
            loads.append(((time.perf_counter() - t) * 1e3, (time.thread_time() - c) * 1e3))
    loader.load = timed_load
    if device_spec is not None:
        engines["device"] = open_engine(device_spec.with_overrides(**over), weights, **opts)
    full_loads = []
    try:
        def ttft(eng, p, name):
            r = eng.generate([p], 1)[0]
            eng.drain()
            rows[name].append(r.ttft_ms)
            hits[name].append(r.hit_tokens)

        for _ in range(args.long_reps):
            p, q = gen.next(), gen.next()
            pool = engines["pool"]
            ttft(pool, p, "cold")
            pool.generate([q[:n // 2]], 1)
            pool.drain()
            ttft(pool, q, "50% pool hit")
            del loads[:]
            ttft(pool, q, "full pool hit")
            full_loads.extend(loads)
            if "device" in engines:
                dev = engines["device"]
                dev.generate([q], 1)
                dev.drain()
                before = dev.core.stats()["device_hit_blocks"]
                ttft(dev, q, "full device hit")
                hits["full device hit"][-1] = (dev.core.stats()["device_hit_blocks"] - before) * spec.kv_cache.block_size
    finally:
        for e in engines.values():
            e.close()
    print(f"\n## (a) TTFT of one {n}-token prompt, write async, granularity {args.granularity}, "
          f"medians of {args.long_reps}\n")
    print("| case | TTFT ms | raw | hit tokens (pool; device row: device blocks x block size) |\n|---|---|---|---|")
    for k, v in rows.items():
        if v:
            print(f"| {k} | {statistics.median(v):.1f} | {[round(x, 1) for x in v]} | {hits[k]} |")
        else:
            print(f"| {k} | – | not run: this branch's spec has no pool.device_cache | – |")
    if rows["full device hit"]:
        pool, dev = rows["full pool hit"], rows["full device hit"]
        # each rep's pool hit and device hit run back to back: their ratio, rep by rep, and the
        # quietest of each (min) are less at the mercy of a shared machine than the medians' ratio
        paired = statistics.median(p / d for p, d in zip(pool, dev))
        print(f"pool-hit / device-hit TTFT {statistics.median(pool) / statistics.median(dev):.2f} "
              f"(goal <= 1.15); per-rep ratio median {paired:.2f}; min/min {min(pool) / min(dev):.2f}")
        gap = statistics.median(p - d for p, d in zip(pool, dev))
        print(f"full pool hit - full device hit, per rep: median {gap:.2f} ms; of it KVLoader.load "
              f"(pool -> staging) median {statistics.median(w for w, _ in full_loads):.2f} ms wall "
              f"(min {min(w for w, _ in full_loads):.2f}), {statistics.median(c for _, c in full_loads):.2f} ms "
              f"thread CPU; loads per rep {[round(w, 2) for w, _ in full_loads]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)  # the bench model's dimensions, as bench_ttft defines them
    ap.add_argument("--clients", default="32,64")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (the chunk budget)")
    ap.add_argument("--num-blocks", type=int, default=0, help="0: prompts + tokens of every client at once")
    ap.add_argument("--save-delay", type=float, default=0.002, help="seconds slept per layer save in (b)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="(b): run the async and sync chunked waves this many times each, back to back, "
                         "alternating which goes first; prints each round's ratios and their medians")
    ap.add_argument("--async-staging", choices=("memfd", "numpy"), default="memfd",
                    help="(b): the async save staging: memfd (the engine's, GIL-free commit reads) or numpy "
                         "(torch memory, the copy before; the A/B of BENCHMARKS.md's (b) rows)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device-cache", action="store_true",
                    help="(a) also measures a full device hit: needs pool.device_cache in the spec")
    ap.add_argument("--sections", default="a,b", help="a: long-prompt TTFT rows; b: the (b)/(c) waves")
    ap.add_argument("--long-len", type=int, default=2048, help="(a): the long prompt's tokens")
    ap.add_argument("--long-reps", type=int, default=3)
    ap.add_argument("--granularity", choices=("forward", "layer"), default="forward",
                    help="(a): the pool load's granularity (layer: each layer's kv_load behind the previous layer)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = bench_spec(args)
    device_spec = None
    if args.device_cache:
        if not any(f.name == "device_cache" for f in dataclasses.fields(spec.pool)):
            print("--device-cache: this branch's spec has no pool.device_cache (the device prefix cache of "
                  "issue 17 item 5); run without it for the pool rows", file=sys.stderr)
            return 2
        device_spec = dataclasses.replace(spec, pool=dataclasses.replace(spec.pool, device_cache=True))
    sections = set(args.sections.split(","))
    d = spec.dims
    print(f"# bench_long_serving — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__} "
          f"({torch.get_num_threads()} thread), {os.cpu_count()} CPUs ({platform.machine()}), load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"model: {d.num_hidden_layers} layers, hidden {d.hidden_size}, heads {d.num_attention_heads}/"
          f"{d.num_key_value_heads} x {d.head_dim}, block size {spec.kv_cache.block_size}; prompts "
          f"{args.prompt_len} tokens, {args.new} new; budget {args.budget}; save delay {args.save_delay * 1e3:g} ms "
          f"x {d.num_hidden_layers} layers per saving step")
    tmp = Path(tempfile.mkdtemp(prefix="bench_long_serving_"))
    try:
        write_random_hf_checkpoint(tmp, spec.family, dataclasses.asdict(d), seed=args.seed)
        weights = load_hf_weights(str(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    slow = Faults(save_delay_s=args.save_delay)
    t_all = time.perf_counter()
    if "a" in sections:
        long_ttft(spec, weights, args, device_spec)
    out, raw = [], {}
    for n in ([int(x) for x in args.clients.split(",")] if "b" in sections else []):
        gen = Prompts(args.seed * 1000 + n, args.vocab, args.prompt_len)
        prompts = [gen.next() for _ in range(n)]
        nb = args.num_blocks or n * ((args.prompt_len + args.new) // spec.kv_cache.block_size + 2)
        # (b)'s pair, --rounds times, alternating which goes first: on a shared machine the load drifts
        # between waves by more than the save costs, so each round's ratio is taken from back-to-back waves
        rounds = []
        for r in range(args.rounds):
            order = ("async", "sync") if r % 2 == 0 else ("sync", "async")
            rounds.append({w: wave(spec, weights, prompts, args, write=w, chunked=True, faults=slow) for w in order})
        runs = {
            "async chunked": rounds[0]["async"],
            "sync chunked": rounds[0]["sync"],
            "async unchunked": wave(spec, weights, prompts, args, write="async", chunked=False, faults=slow),
            "async 50% hit": wave(spec, weights, prompts, args, write="async", chunked=True, warm_halves=True),
            "off (no prefix cache)": wave(spec, weights, prompts, args, write="off", chunked=True),
        }
        raw[n] = {k: {m: [round(x, 2) for x in v[m]] for m in ("ttft",)} for k, v in runs.items()}
        for r, got in enumerate(rounds[1:], 2):
            raw[n].update({f"{w} chunked, round {r}": {"ttft": [round(x, 2) for x in got[w]["ttft"]]} for w in got})
        print(f"\n## {n} clients ({n} requests at once, --num-blocks {nb})\n")
        print("| run | TTFT p50 ms | p90 | ITL p50 ms | p99 | mean step ms | prefix-hit tokens |\n|---|---|---|---|---|---|---|")
        for k, v in [*runs.items(), *((f"{w} chunked, round {r}", got[w]) for r, got in enumerate(rounds[1:], 2)
                                        for w in ("async", "sync"))]:
            print(f"| {k} | {pct(v['ttft'], 50):.0f} | {pct(v['ttft'], 90):.0f} | {pct(v['itl'], 50):.1f} | "
                  f"{pct(v['itl'], 99):.1f} | {statistics.mean(v['step_ms']):.1f} | {v['hit_tokens']} |")
        a, s, u = runs["async chunked"], runs["sync chunked"], runs["async unchunked"]
        h, o = runs["async 50% hit"], runs["off (no prefix cache)"]
        save_share = args.save_delay * d.num_hidden_layers * 1e3 / statistics.mean(o["step_ms"])
        if len(rounds) > 1:
            per = [(pct(g["async"]["ttft"], 50) / pct(g["sync"]["ttft"], 50),
                    pct(g["async"]["ttft"], 90) / pct(g["sync"]["ttft"], 90)) for g in rounds]
            out.append(f"{n} clients: (b) async/sync TTFT per round (p50, p90): "
                       f"{[(round(a, 2), round(b, 2)) for a, b in per]}; medians over {len(rounds)} rounds: p50 "
                       f"{statistics.median(a for a, _ in per):.2f} (goal <= 0.85), p90 "
                       f"{statistics.median(b for _, b in per):.2f} (goal <= 1.0)")
        out.append(f"{n} clients{', round 1' if len(rounds) > 1 else ''}: (b) async/sync TTFT p50 {pct(a['ttft'], 50) / pct(s['ttft'], 50):.2f} "
                   f"(goal <= 0.85), p90 {pct(a['ttft'], 90) / pct(s['ttft'], 90):.2f} (goal <= 1.0); "
                   f"decode ITL p99 chunked/unchunked {pct(a['itl'], 99) / pct(u['itl'], 99):.2f} (goal <= 0.5); "
                   f"(c) 50% hit async / no prefix cache TTFT p50 {pct(h['ttft'], 50) / pct(o['ttft'], 50):.2f}, "
                   f"p90 {pct(h['ttft'], 90) / pct(o['ttft'], 90):.2f}; save = {save_share:.0%} of the mean "
                   f"write-off step")
    if out:
        print("\n" + "\n".join(out))
        print(f"\nraw TTFT ms: {json.dumps(raw)}")
    print(f"wall {time.perf_counter() - t_all:.0f} s; load average after {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
