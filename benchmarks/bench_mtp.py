"""Speculative decoding with DeepSeek-V3's MTP layer: acceptance and decode tok/s, with and without
MTP, on a random and on a distilled MTP head, cold and after a full prefix hit from the pool
(issue 18's benchmark; docs/mtp.md).

    python benchmarks/bench_mtp.py [--ckpts DIR] [--reps 5] [--new 48] [--prompt-len 17] [--ks 1,2,3]

``--ckpts DIR``: the output of ``scripts/distill_mtp.py DIR`` (``random/``, ``distilled/``); without
it the benchmark distils first (a few minutes on one core) into a temp folder.

Configurations, one engine each (``specs/tiny_deepseek_v3_mtp.yaml`` as shipped: embedded pool,
``pool.write: async``, prefix cache; so each has its own pool): ``no MTP`` (the target's decode
only), and ``--speculative mtp`` with K = 1, 2, 3 on the random MTP head and on the distilled one.
Every round draws one fresh random prompt and runs it in every configuration (order rotated each
round): **cold** (its first sight), then, after the pool has committed the saves, **warm** (the same
prompt again: a full prefix hit, ``(len - 1) // block_size`` blocks). Decode tok/s =
``(new - 1) / (t(new) - t(1))``, by this process's CPU time (the machine is shared: its wall clock
mostly measures the other jobs; both are printed): ``t(1)`` is the same call with one new token (prefill only; cold:
on another fresh prompt of the same length), so the prefill is not counted. Medians over rounds.

Asserted, every round: every configuration's tokens equal the no-MTP greedy tokens; the warm run
hit the whole prefix; **the warm run's acceptance counters equal the cold run's** (the pool-hit
regression: SGLang #31600 lost acceptance after a hit). At the end, one ``graphgen run
--speculative mtp --json`` process on the distilled checkpoint (the prompt twice: cold, then a pool
hit) must print the same tokens and counters as the Python path.

Speculative decoding runs through the scheduler (verify rows of K+1 tokens) on an engine opened with
``num_speculative_tokens=K``; the counters are on each `RequestResult`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPEC = ROOT / "specs" / "tiny_deepseek_v3_mtp.yaml"


def speculative(engine, prompt, new, k):
    """Greedy speculative generation of one prompt on an engine opened with ``num_speculative_tokens=k``
    (verify rows through the scheduler): (tokens, draft, accepted, accepted per position, hit tokens)."""
    r = engine.generate([prompt], new)[0]
    return r.tokens, r.num_draft_tokens, r.num_accepted_tokens, list(r.accepted_per_pos), r.hit_tokens


def plain(engine, prompt, new):
    r = engine.generate([prompt], new)[0]
    return r.tokens, 0, 0, [], r.hit_tokens


def load_distiller():
    path = ROOT / "scripts" / "distill_mtp.py"
    spec = importlib.util.spec_from_file_location("distill_mtp", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["distill_mtp"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def timed(fn, *a):
    """((wall s, CPU s of this process), fn's result). CPU time is the primary measure: on a machine
    shared with other jobs the wall clock mostly measures their load."""
    t, c = time.perf_counter(), time.process_time()
    out = fn(*a)
    return (time.perf_counter() - t, time.process_time() - c), out


def cli_check(ckpt, prompt, new, k, want_tokens, want_counters):
    """`graphgen run --speculative mtp --json` on the prompt twice (cold, pool hit): same tokens and counters."""
    ids = ",".join(map(str, prompt))
    argv = [sys.executable, "-m", "graphgen", "run", "--spec", str(SPEC), "--weights", str(ckpt),
            "--prompt-ids", ids, "--prompt-ids", ids, "--max-new-tokens", str(new), "--ignore-eos", "--json",
            "--speculative", "mtp", "--num-speculative-tokens", str(k)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(s) for s in res.stdout.splitlines() if s.startswith("{")]
    assert len(rows) == 2, res.stdout
    for row in rows:
        got = (row["spec_decode_num_draft_tokens"], row["spec_decode_num_accepted_tokens"],
               row["spec_decode_num_accepted_tokens_per_pos"])
        assert row["tokens"] == want_tokens and got == want_counters, (row, want_counters)
    return " ".join(argv[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpts", default=None, help="scripts/distill_mtp.py's output folder (default: distil now)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new", type=int, default=48, help="tokens generated per prompt")
    ap.add_argument("--prompt-len", type=int, default=17, help="17: 4 blocks of 4 looked up, all hit when warm")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import torch

    from graphgen.runtime import open_engine

    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.ks.split(",")]
    tmp = None
    if args.ckpts is None:
        tmp = tempfile.TemporaryDirectory()
        r = load_distiller().distill(tmp.name, log=lambda s: print("distill:", s, file=sys.stderr))
        print(f"distilled in {r.seconds:.1f} s: held-out top-1 {r.heldout_top1_before:.3f} -> "
              f"{r.heldout_top1_after:.3f}")
        ckpts = Path(tmp.name)
    else:
        ckpts = Path(args.ckpts)
    configs = {"no MTP": (ckpts / "distilled", None)}
    for head in ("random", "distilled"):
        for k in ks:
            configs[f"{head} K={k}"] = (ckpts / head, k)
    engines = {name: open_engine(SPEC, str(ck), num_speculative_tokens=k or 0) for name, (ck, k) in configs.items()}
    V, block = 256, 4
    gen = torch.Generator().manual_seed(args.seed)
    rows = {name: {"cold": [], "warm": []} for name in configs}  # (t1, tN, counters)
    names = list(configs)
    try:
        for name in names:  # warm-up (first runs of each module), untimed
            k = configs[name][1]
            warmup = torch.randint(0, V, (args.prompt_len,), generator=gen).tolist()
            plain(engines[name], warmup, 4) if k is None else speculative(engines[name], warmup, 4, k)
        for rnd in range(args.reps):
            prompt = torch.randint(0, V, (args.prompt_len,), generator=gen).tolist()
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                eng, k = engines[name], configs[name][1]
                run = (lambda p, n: plain(eng, p, n)) if k is None else (lambda p, n: speculative(eng, p, n, k))
                other = torch.randint(0, V, (args.prompt_len,), generator=gen).tolist()
                t1c, _ = timed(run, other, 1)
                tnc, cold = timed(run, prompt, args.new)
                eng.drain()  # the cold run's saves committed: the warm run hits
                tnw, warm = timed(run, prompt, args.new)
                t1w, _ = timed(run, prompt, 1)
                eng.drain()
                full = (args.prompt_len - 1) // block * block
                assert cold[4] == 0 and warm[4] >= full, (name, cold[4], warm[4])
                assert cold[0] == warm[0] and cold[1:4] == warm[1:4], f"{name}: pool hit changed {cold[1:4]} -> {warm[1:4]}"
                rows[name]["cold"].append((t1c, tnc, cold))
                rows[name]["warm"].append((t1w, tnw, warm))
            ref = rows["no MTP"]["cold"][-1][2][0]
            for name in names:
                assert rows[name]["cold"][-1][2][0] == ref, f"round {rnd}: {name}'s tokens differ from greedy without MTP"
        last = rows["distilled K=2"]["cold"][-1][2] if "distilled K=2" in rows else None
        cli_cmd = cli_check(ckpts / "distilled", prompt, args.new, 2, last[0], tuple(last[1:4])) if last else None
    finally:
        for eng in engines.values():
            eng.close()
        if tmp is not None:
            tmp.cleanup()

    def decode_rate(samples, clock):  # clock 0: wall, 1: CPU
        return statistics.median((args.new - 1) / max(tn[clock] - t1[clock], 1e-9) for t1, tn, _ in samples)

    base = {(w, c): decode_rate(rows["no MTP"][w], c) for w in ("cold", "warm") for c in (0, 1)}
    print(f"\nbench_mtp: {args.reps} rounds, prompt {args.prompt_len} tokens, {args.new} new tokens, "
          f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}")
    print("| configuration | acceptance (accepted/draft) | accepted per position | tokens per verify step | "
          "tokens per graph run | decode tok/s cold, CPU time | vs no MTP | warm (pool hit), CPU time | vs no MTP | "
          "cold, wall | vs no MTP | warm, wall | vs no MTP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        cold = rows[name]["cold"]
        draft = sum(s[2][1] for s in cold)
        acc = sum(s[2][2] for s in cold)
        per = [sum(s[2][3][i] for s in cold) for i in range(len(cold[0][2][3]))]
        k = configs[name][1]
        cycles = draft // k if k else 0
        rate = f"{acc}/{draft} = {acc / draft:.3f}" if draft else "-"
        steps = f"{(acc + cycles) / cycles:.2f}" if cycles else "1.00"
        perpos = " ".join(f"{p / cycles:.2f}" for p in per) if cycles else "-"
        # a cycle is K draft runs of the MTP graph + 1 verify run: if every graph run cost one
        # decode step, the tok/s ratio vs no MTP would be tokens per cycle / (K + 1)
        per_run = (acc + cycles) / (cycles * (k + 1)) if cycles else 1.0
        rates = []
        for c in (1, 0):
            for w in ("cold", "warm"):
                r = decode_rate(rows[name][w], c)
                rates.append(f"{r:.1f} | {r / base[(w, c)]:.2f}x")
        print(f"| {name} | {rate} | {perpos} | {steps} | {per_run:.2f} | " + " | ".join(rates) + " |")
    print("\nasserted every round: tokens equal to greedy without MTP in every configuration; warm runs hit "
          "the whole prefix; warm acceptance counters equal cold")
    if cli_cmd:
        print(f"CLI cross-check (same tokens and counters as the Python path, cold and pool hit): {cli_cmd}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
