"""tp=1 vs tp=2 on this machine's cores (TTFT, decode tokens/s) and pool bytes per prompt with the
MLA latent saved once (rank 0) vs per rank.

    PYTHONPATH=. python benchmarks/bench_tp.py [--reps 5] [--prompt-len 64] [--new 16] [--cores 2]

Side by side in one run: per model, the tp=1 engine (in this process, ``--cores`` torch threads)
and the tp=2 engine (two rank processes, ``--cores // 2`` torch threads each) are both started
once and warmed up, then measured interleaved over ``--reps`` rounds (the order alternates
rotated and reversed so a drifting machine load hits each alike), each round with a fresh prompt (no
pool hits). Reported: medians, tp2/tp1 ratios, raw numbers. Equal threads in total is the fair
comparison on a machine of ``--cores`` cores: both layouts may use every core. A control row runs
the same tp=1 engine with one thread: on a shared machine a multi-threaded forward waits at every
intra-op barrier for a descheduled thread, which single-threaded ranks never do.

Tiny random models (the shipped tiny specs' dims, float32): the numbers show the overheads of
process ranks and gloo collectives at a size where compute is small, not a speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import open_engine

REPO = Path(__file__).resolve().parents[1]
# the test suite's transformers model builders (tests/support/hf.py; moved there from tests/runtime)
_spec = importlib.util.spec_from_file_location("hf_support", REPO / "tests" / "support" / "hf.py")
hfm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hfm)


def measure(eng, prompt, new):
    """(TTFT ms, decode tokens/s, pool bytes this prompt added) for one prompt, saves settled."""
    stats = eng.pool_stats
    before = stats()["used_bytes"]
    t = time.perf_counter()
    r = eng.generate([prompt], new)[0]
    total = time.perf_counter() - t
    eng.drain()
    assert r.hit_tokens == 0, "a fresh prompt must not hit the pool"
    decode_s = max(total - r.ttft_ms / 1000, 1e-9)
    return r.ttft_ms, (new - 1) / decode_s, stats()["used_bytes"] - before


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--cores", type=int, default=2, help="torch threads in total for each layout")
    a = ap.parse_args()
    torch.set_num_threads(a.cores)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (a.prompt_len,), generator=g).tolist() for _ in range(3 * a.reps + 1)]
    rows, raw, mla = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        _, qd = hfm.build_hf_model("qwen3_dense", hfm.QWEN3_DIMS, f"{tmp}/q", seed=0)
        dims = dataclasses.asdict(load_spec(REPO / "specs/tiny_deepseek_v3.yaml").dims)
        _, dd = hfm.build_hf_model("deepseek_v3", dims, f"{tmp}/d", seed=0)
        for name, spec, d, par in (("tiny_qwen3", "specs/tiny_qwen3.yaml", qd, {"tp": 2}),
                                   ("tiny_deepseek_v3", "specs/tiny_deepseek_v3.yaml", dd, {"tp": 2, "ep": 2})):
            kw = dict(write="sync", num_blocks=256)
            with open_engine(REPO / spec, d, **kw) as one, \
                    open_engine(REPO / spec, d, threads=max(1, a.cores // 2), **par, **kw) as two:
                for eng in (one, two):  # warm-up: first forwards, first collectives
                    eng.generate([prompts[-1][:8]], 2)
                    eng.drain()
                conf = {"tp1": (one, a.cores), "tp1_1t": (one, 1), "tp2": (two, a.cores)}
                res = {k: [] for k in conf}
                for rep in range(a.reps):
                    order = list(conf)[rep % 3:] + list(conf)[:rep % 3]   # rotate: each goes first alike
                    for k in (order if rep % 2 == 0 else order[::-1]):
                        eng, threads = conf[k]
                        torch.set_num_threads(threads)  # this process's threads (the tp=2 ranks have their own)
                        res[k].append(measure(eng, prompts[3 * rep + list(conf).index(k)], a.new))  # fresh: no hit
                torch.set_num_threads(a.cores)
                if "ep" in par:
                    stats = two.rank_stats
                    mla = (res["tp2"][0][2], stats[0]["puts"], stats[1]["skipped_puts"])
            med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in res.items()}
            layout = ", ".join(f"{k}={v}" for k, v in par.items())
            half = max(1, a.cores // 2)
            for k, lab, thr in (("tp1", "tp=1", f"{a.cores}"), ("tp1_1t", "tp=1 (control)", "1"),
                                ("tp2", layout, f"{half} per rank")):
                rows.append(f"| {name} | {lab} | {thr} | {med[k][0]:.1f} | {med[k][1]:.1f} | {int(med[k][2])} |")
            rows.append(f"| {name} | **tp2/tp1** | | **{med['tp2'][0] / med['tp1'][0]:.2f}** | "
                        f"**{med['tp2'][1] / med['tp1'][1]:.2f}** | {med['tp2'][2] / med['tp1'][2]:.2f} |")
            for k in res:
                raw.append(f"{name} {k}: TTFT ms {[round(x[0], 1) for x in res[k]]}, "
                           f"decode tok/s {[round(x[1], 1) for x in res[k]]}, pool bytes {[x[2] for x in res[k]]}")
    print(f"reps={a.reps} prompt_len={a.prompt_len} new={a.new} cores={a.cores} (medians; interleaved)\n")
    print("| model | layout | torch threads | TTFT ms | decode tok/s | pool bytes per prompt |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nraw:\n" + "\n".join(raw))
    once, puts0, skipped1 = mla
    per_rank = once * (puts0 + skipped1) // puts0   # rank 1 would put as many blocks of the same size
    print(f"\nMLA latent, tp=2: {once} pool bytes per prompt saved once (rank 0) vs {per_rank} per rank "
          f"(the seed's {{hash}}_{{tp_rank}}_{{tp_size}} keys): {per_rank - once} bytes "
          f"({100 * (per_rank - once) / per_rank:.0f}%) saved per prompt")


if __name__ == "__main__":
    main()
