"""Benchmark of the seed's claim at this machine's scale: TTFT with the KV save off / sync / async.

A random Qwen3-style checkpoint (default: 6 layers, hidden 256, vocab 1024, block size 16, float32)
is written to a temp folder with ``write_random_hf_checkpoint`` and loaded once; one `Engine` per
configuration runs the generated CPU graphs with the embedded host pool. Configurations:

    off            no pool writes (granularity irrelevant)
    sync/forward   one bulk save after the last layer, on the forward stream, + pool commit inline
    sync/layer     one save per layer on the forward stream, + pool commit inline
    async/forward  the bulk save on the save stream (worker thread), commit on the host thread
    async/layer    one save per layer on the save stream, commit on the host thread

Sections (each: configurations interleaved round-robin, order rotated every round, the same prompt
for every configuration in a round, a fresh random prompt every round; medians reported):

  1. cold prompts, no fault injection: the real cost of our save on this CPU;
  2. cold prompts, slow save: ``Faults(save_delay_s=D)`` sleeps D in every per-layer save op
     (both granularities: the bulk save sleeps once per layer too);
  3. cold prompts, slow pool: ``Faults(put_delay_s=P)`` sleeps P in every block put;
  4. prefix cache at 50% hit: run the first half of the prompt, drain, then the full prompt (half of
     it is loaded from the pool, the other half computed by the splitfuse graph) vs the full prompt
     cold with write off (no prefix cache); no faults;
  5. back-to-back, no faults: B requests in a row with no drain in between: do the pending saves
     and commits of earlier requests leak into the next request's TTFT (they share the CPU)?
  6. back-to-back, slow save (as in 2).

Every measured request is followed by ``engine.drain()`` (pending saves committed) before the next
one, except inside a section-5/6 burst (drained after the burst; the drain time is reported). The first generated token must be identical across
configurations (asserted every round), and a startup check compares 8 generated tokens across all
configurations, cold and with a 50% prefix hit, so every configuration does equal work.

Usage (from the repo root):
    .venv/bin/python benchmarks/bench_ttft.py              # default: < 60 s on 2 cores
    .venv/bin/python benchmarks/bench_ttft.py --reps 31    # longer, tighter medians
    .venv/bin/python benchmarks/bench_ttft.py --layers 8 --hidden 512 --prompt-len 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from graphgen.runtime import Engine, open_engine  # noqa: E402
from graphgen.runtime.core.faults import Faults  # noqa: E402
from graphgen.runtime.checkpoint.hf import load_hf_weights, write_random_hf_checkpoint  # noqa: E402
from graphgen.modelspec.loader import load_spec  # noqa: E402
from graphgen.modelspec.model import KVCacheLayout  # noqa: E402

CONFIGS = [("off", "forward"), ("sync", "forward"), ("sync", "layer"), ("async", "forward"), ("async", "layer")]


def label(c) -> str:
    return "off" if c[0] == "off" else f"{c[0]}/{c[1]}"


def add_model_args(ap) -> None:
    """The bench model's dimensions (what `bench_spec` reads)."""
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)


def bench_spec(args):
    base = load_spec(REPO / "specs/tiny_qwen3.yaml")  # variants incl. *_layer, prefix_cache feature
    dims = dataclasses.replace(
        base.dims, num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
        vocab_size=args.vocab, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim)
    return dataclasses.replace(base, name="bench_qwen3", dims=dims,
                               kv_cache=KVCacheLayout(block_size=args.block_size, dtype="float32"),
                               description="benchmark model (random weights)")


def bench_weights(spec, seed: int = 0) -> dict:
    """Random weights for ``spec``, written as a Hugging Face checkpoint and loaded back (the engine's loader)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        write_random_hf_checkpoint(tmp, spec.family, dataclasses.asdict(spec.dims), seed=seed)
        return load_hf_weights(str(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_engines(spec, weights, faults=None, configs=CONFIGS) -> dict:
    return {label(c): open_engine(spec.with_overrides(write=c[0], granularity=c[1]), weights,
                                  spec_file="benchmarks/bench_ttft.py", generated_dir=None,
                                  faults=faults, pool_capacity_bytes=1 << 30)
            for c in configs}


def close_all(engines: dict) -> None:
    for e in engines.values():
        e.close()


def one(eng: Engine, prompt, max_new_tokens=1):
    r = eng.generate([prompt], max_new_tokens=max_new_tokens)[0]
    return r


def rotated(names: list, r: int) -> list:
    k = r % len(names)
    return names[k:] + names[:k]


def med(xs) -> float:
    return statistics.median(xs)


class Prompts:
    def __init__(self, seed: int, vocab: int, n: int):
        self.rng, self.vocab, self.n = random.Random(seed), vocab, n

    def next(self) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(self.n)]


def cold_section(engines: dict, reps: int, prompts: Prompts, tag: str) -> dict:
    names = list(engines)
    ttft = {n: [] for n in names}
    for r in range(reps):
        p = prompts.next()
        tok = {}
        for n in rotated(names, r):
            e = engines[n]
            res = one(e, p)
            e.drain()
            assert res.hit_tokens == 0, (tag, n, res.hit_tokens)
            ttft[n].append(res.ttft_ms)
            tok[n] = res.tokens
        assert len({str(t) for t in tok.values()}) == 1, f"{tag}: tokens differ across configurations: {tok}"
    return ttft


def prefix_section(engines: dict, reps: int, prompts: Prompts) -> dict:
    """engines: "off" (cold, write off) and the saving configurations (50% hit)."""
    names = list(engines)
    ttft = {n: [] for n in names}
    for r in range(reps):
        p = prompts.next()
        half = len(p) // 2
        tok = {}
        for n in rotated(names, r):
            e = engines[n]
            if n != "off":
                one(e, p[:half])
                e.drain()
            res = one(e, p)
            e.drain()
            want_hit = 0 if n == "off" else half
            assert res.hit_tokens == want_hit, (n, res.hit_tokens, want_hit)
            ttft[n].append(res.ttft_ms)
            tok[n] = res.tokens
        assert len({str(t) for t in tok.values()}) == 1, f"prefix: tokens differ across configurations: {tok}"
    return ttft


def burst_section(engines: dict, reps: int, burst: int, prompts: Prompts) -> dict:
    names = list(engines)
    ttft = {n: [] for n in names}
    last = {n: [] for n in names}
    drain = {n: [] for n in names}
    for r in range(reps):
        ps = [prompts.next() for _ in range(burst)]
        for n in rotated(names, r):
            e = engines[n]
            got = [one(e, p).ttft_ms for p in ps]  # no drain in between: back to back
            t = time.perf_counter()
            e.drain()
            drain[n].append((time.perf_counter() - t) * 1e3)
            ttft[n].extend(got)
            last[n].append(got[-1])
    return {"ttft": ttft, "last": last, "drain": drain}


def burst_report(engines: dict, args, seed: int, title: str) -> None:
    be = {k: engines[k] for k in ("off", "sync/layer", "async/forward", "async/layer")}
    res = burst_section(be, args.burst_reps, args.burst, Prompts(seed, args.vocab, args.prompt_len))
    table(f"{title}: bursts of {args.burst} requests with no drain in between; all requests of "
          f"{args.burst_reps} bursts", res["ttft"], "off",
          [("async/layer", "sync/layer"), ("async/forward", "sync/layer")], paired_ok=False)
    print("\n| configuration | median TTFT of the last request of a burst ms | median drain after the "
          "burst ms |\n|---|---|---|")
    for n in be:
        print(f"| {n} | {med(res['last'][n]):.2f} | {med(res['drain'][n]):.2f} |")
    raw(f"{title.split('.')[0]} ttft", res["ttft"])
    raw(f"{title.split('.')[0]} drain", res["drain"])


def correctness_check(spec, weights, prompt_len: int, vocab: int) -> None:
    """8 generated tokens: every configuration cold, the saving ones again with a full-prefix hit, and
    at an exact 50% hit vs off cold: identical token lists (equal work, and the loaded KV is right)."""
    engines = make_engines(spec, weights)
    try:
        p = Prompts(12345, vocab, prompt_len).next()
        got = {}
        for n, e in engines.items():  # cold: the saving configurations put p's full blocks in the pool
            got[f"{n} cold"] = one(e, p, 8).tokens
            e.drain()
        for n, e in engines.items():  # p again: every full block but the last token's is a hit
            if n != "off":
                r = one(e, p, 8)
                e.drain()
                assert r.hit_tokens > 0, (n, r.hit_tokens)
                got[f"{n} hit {r.hit_tokens}"] = r.tokens
        # and an exact 50% hit on a fresh prompt
        fresh = Prompts(999, vocab, prompt_len).next()
        ref = one(engines["off"], fresh, 8).tokens
        for n, e in engines.items():
            if n == "off":
                continue
            one(e, fresh[:len(fresh) // 2], 1)
            e.drain()
            r = one(e, fresh, 8)
            e.drain()
            assert r.hit_tokens == len(fresh) // 2, (n, r.hit_tokens)
            assert r.tokens == ref, f"{n} at 50% hit: {r.tokens} != off cold {ref}"
        assert len({str(t) for t in got.values()}) == 1, f"tokens differ: {got}"
        puts = {n: e.stats["puts"] for n, e in engines.items()}
        assert puts["off"] == 0 and all(v > 0 for k, v in puts.items() if k != "off"), puts
        print(f"correctness: 8 generated tokens identical across {len(got)} runs (cold, full-prefix hit) "
              f"and at 50% hit == off cold")
    finally:
        close_all(engines)


def paired(xs, base) -> float:
    """Median over rounds of the per-round ratio (same prompt, adjacent in time: drift cancels)."""
    return med([a / b for a, b in zip(xs, base)])


def table(title: str, ttft: dict, base: str, extra_ratios=(), note: str = "", paired_ok: bool = True) -> None:
    print(f"\n### {title}\n")
    if note:
        print(note + "\n")
    b = med(ttft[base])
    cols = f"| configuration | median TTFT ms | min | max | n | median / median {base} |"
    print(cols + (f" paired: median of per-round / {base} |" if paired_ok else ""))
    print("|---|---|---|---|---|---|" + ("---|" if paired_ok else ""))
    for n, xs in ttft.items():
        row = f"| {n} | {med(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} | {len(xs)} | {med(xs) / b:.3f} |"
        print(row + (f" {paired(xs, ttft[base]):.3f} |" if paired_ok else ""))
    lines = []
    for a, c in extra_ratios:
        if a in ttft and c in ttft:
            line = f"{a} / {c} = {med(ttft[a]) / med(ttft[c]):.3f} (medians)"
            if paired_ok:
                line += f", {paired(ttft[a], ttft[c]):.3f} (paired)"
            lines.append(line)
    if lines:
        print("\n" + "  \n".join(lines))


def raw(name: str, d: dict) -> None:
    print(f"\nraw {name} (ms): " + json.dumps({k: [round(x, 2) for x in v] for k, v in d.items()}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15, help="rounds per section")
    ap.add_argument("--save-delay", type=float, default=0.005, help="seconds slept in each per-layer save (2, 5)")
    ap.add_argument("--put-delay", type=float, default=0.001, help="seconds slept in each pool block put (3)")
    ap.add_argument("--burst", type=int, default=6, help="requests per back-to-back burst (5, 6)")
    ap.add_argument("--burst-reps", type=int, default=4)
    ap.add_argument("--sections", default="1,2,3,4,5,6")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on 2 shared cores, 2 OpenMP threads plus the "
                         "save/host threads oversubscribe and give 10x outliers; 0 = torch's default)")
    args = ap.parse_args(argv)
    sections = {int(s) for s in args.sections.split(",") if s}

    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(f"# bench_ttft — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__} "
          f"({torch.get_num_threads()} intra-op threads), {os.cpu_count()} CPUs, {platform.machine()}, "
          f"Python {platform.python_version()}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    spec = bench_spec(args)
    d = spec.dims
    print(f"model: qwen3_dense, {d.num_hidden_layers} layers, hidden {d.hidden_size}, intermediate "
          f"{d.intermediate_size}, heads {d.num_attention_heads}/{d.num_key_value_heads} x {d.head_dim}, vocab "
          f"{d.vocab_size}, block size {spec.kv_cache.block_size}, float32; prompt {args.prompt_len} tokens "
          f"({args.prompt_len // spec.kv_cache.block_size} full blocks); {args.reps} rounds per section")

    weights = bench_weights(spec, args.seed)

    correctness_check(spec, weights, args.prompt_len, args.vocab)
    seed = args.seed * 1000

    def warm(engines):
        w = Prompts(seed + 999_999, args.vocab, args.prompt_len)
        for e in engines.values():
            for _ in range(2):
                one(e, w.next())
                e.drain()

    summary = {}
    if sections & {1, 4, 5}:
        engines = make_engines(spec, weights)
        warm(engines)
        try:
            if 1 in sections:
                t = cold_section(engines, args.reps, Prompts(seed + 1, args.vocab, args.prompt_len), "cold")
                table("1. cold prompt, no fault injection (the real cost of our save)", t, "off",
                      [("async/forward", "sync/forward"), ("async/layer", "sync/layer"),
                       ("async/layer", "sync/forward")])
                raw("section 1", t)
                summary["1"] = t
            if 4 in sections:
                pe = {"off": engines["off"], **{k: v for k, v in engines.items() if k != "off"}}
                t = prefix_section(pe, args.reps, Prompts(seed + 4, args.vocab, args.prompt_len))
                t = {("off (cold, no prefix cache)" if k == "off" else f"{k} (50% hit)"): v for k, v in t.items()}
                table("4. prefix cache at 50% hit vs no prefix cache (cold, write off); no faults", t,
                      "off (cold, no prefix cache)",
                      note=f"hit configurations: the first {args.prompt_len // 2} tokens were run and drained "
                           f"first; the measured request loads them from the pool and computes the rest "
                           f"(splitfuse graph), saving its new blocks.")
                raw("section 4", t)
                summary["4"] = t
            if 5 in sections:
                burst_report(engines, args, seed + 5, "5. back-to-back, no fault injection")
        finally:
            close_all(engines)
    if sections & {2, 6}:
        f = Faults(save_delay_s=args.save_delay)
        engines = make_engines(spec, weights, faults=f)
        warm(engines)
        try:
            if 2 in sections:
                t = cold_section(engines, args.reps, Prompts(seed + 2, args.vocab, args.prompt_len), "slow save")
                table(f"2. cold prompt, slow save: save_delay {args.save_delay * 1e3:g} ms per layer save "
                      f"(x{args.layers} layers = {args.save_delay * args.layers * 1e3:g} ms per request)", t, "off",
                      [("async/forward", "sync/forward"), ("async/layer", "sync/layer")])
                raw("section 2", t)
                summary["2"] = t
            if 6 in sections:
                burst_report(engines, args, seed + 6, f"6. back-to-back, slow save ({args.save_delay * 1e3:g} ms "
                                                      f"per layer save)")
        finally:
            close_all(engines)
    if 3 in sections:
        f = Faults(put_delay_s=args.put_delay)
        engines = make_engines(spec, weights, faults=f)
        warm(engines)
        try:
            t = cold_section(engines, args.reps, Prompts(seed + 3, args.vocab, args.prompt_len), "slow put")
            nb = args.prompt_len // args.block_size
            table(f"3. cold prompt, slow pool: put_delay {args.put_delay * 1e3:g} ms per block put "
                  f"(x{nb} blocks = {args.put_delay * nb * 1e3:g} ms per request)", t, "off",
                  [("async/forward", "sync/forward"), ("async/layer", "sync/layer")])
            raw("section 3", t)
            summary["3"] = t
        finally:
            close_all(engines)

    print("\n### summary of ratios (median of TTFT medians; paired per-round median in brackets)\n")
    print("| section | async/off (fwd, layer) | sync/off (fwd, layer) | async/sync (fwd, layer) |")
    print("|---|---|---|---|")
    names = {"1": "1. no faults", "2": "2. slow save", "3": "3. slow put"}
    for s in ("1", "2", "3"):
        if s not in summary:
            continue
        t = summary[s]
        m = {k: med(v) for k, v in t.items()}
        fr = lambda a, b: f"{m[a] / m[b]:.3f} [{paired(t[a], t[b]):.3f}]"  # noqa: E731
        print(f"| {names[s]} | {fr('async/forward', 'off')}, {fr('async/layer', 'off')} | "
              f"{fr('sync/forward', 'off')}, {fr('sync/layer', 'off')} | "
              f"{fr('async/forward', 'sync/forward')}, {fr('async/layer', 'sync/layer')} |")
    if "4" in summary:
        t = summary["4"]
        bk = "off (cold, no prefix cache)"
        b = med(t[bk])
        print("\n50% prefix hit / no prefix cache: " + ", ".join(
            f"{k.split(' ')[0]} {med(v) / b:.3f} [{paired(v, t[bk]):.3f}]" for k, v in t.items() if k != bk))
    print(f"\n(total {time.perf_counter() - t_start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
