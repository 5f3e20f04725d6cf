"""cp=1 vs cp=2 (context parallel, head-tail prefill split over two rank processes) on a long prompt:
TTFT and pool bytes per prompt, for tiny_qwen3 and tiny_deepseek_v3.

    PYTHONPATH=. python benchmarks/bench_cp.py [--reps 5] [--prompt-len 512] [--cores 2]

Per model the cp=1 engine (in this process, ``--cores`` torch threads) and the cp=2 engine (two rank
processes, ``--cores // 2`` threads each) are started once, warmed up, then measured interleaved
(order rotated and reversed each round), each round a fresh prompt (no pool hit), ``write: sync`` so each
prompt's blocks are in the pool when it returns. Pool bytes per prompt: what the pool grew by. At
cp=2 the KV is replicated on both ranks and saved by CP rank 0 only, so it equals cp=1; the line
after the table gives what the other replicated layout (every CP rank saving under its own keys)
would store: cp times as much, counted from rank 1's skipped puts. A control row runs the cp=1 engine
with one thread (on a shared machine a 2-thread forward waits at each intra-op barrier for a
descheduled thread, which single-threaded ranks never do: bench_tp.py found the same). Tiny random float32 models: on
a machine of 2 cores shared with other jobs, 2 rank processes prove correctness, not speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import open_engine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support.hf import QWEN3_DIMS, build_hf_model  # noqa: E402  (the tests' checkpoint writer)


def measure(eng, prompt) -> tuple[float, int]:
    """(TTFT ms, pool bytes this prompt added) for one fresh prompt, its saves settled."""
    before = eng.pool_stats()["used_bytes"]
    r = eng.generate([prompt], 1)[0]
    eng.drain()
    assert r.hit_tokens == 0, "a fresh prompt must not hit the pool"
    return r.ttft_ms, eng.pool_stats()["used_bytes"] - before


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--cores", type=int, default=2, help="torch threads in total for each layout")
    a = ap.parse_args()
    torch.set_num_threads(a.cores)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (a.prompt_len,), generator=g).tolist() for _ in range(3 * a.reps + 1)]
    rows, raw, extra = [], [], []
    blocks = 2 * (a.prompt_len // 4 + 8)
    with tempfile.TemporaryDirectory() as tmp:
        _, qd = build_hf_model("qwen3_dense", QWEN3_DIMS, f"{tmp}/q", seed=0)
        dims = dataclasses.asdict(load_spec(REPO / "specs/tiny_deepseek_v3.yaml").dims)
        _, dd = build_hf_model("deepseek_v3", dims, f"{tmp}/d", seed=0)
        for name, spec, d in (("tiny_qwen3", "specs/tiny_qwen3.yaml", qd),
                              ("tiny_deepseek_v3", "specs/tiny_deepseek_v3.yaml", dd)):
            kw = dict(write="sync", num_blocks=blocks, max_num_batched_tokens=a.prompt_len)
            with open_engine(REPO / spec, d, **kw) as one, \
                    open_engine(REPO / spec, d, cp=2, threads=max(1, a.cores // 2), timeout=300, **kw) as two:
                for eng in (one, two):  # warm-up: first forwards, first collectives
                    eng.generate([prompts[-1][:16]], 1)
                    eng.drain()
                conf = {"cp1": (one, a.cores), "cp1_1t": (one, 1), "cp2": (two, a.cores)}
                res = {k: [] for k in conf}
                for rep in range(a.reps):
                    order = list(conf)[rep % 3:] + list(conf)[:rep % 3]   # rotate: each goes first alike
                    for k in (order if rep % 2 == 0 else order[::-1]):
                        eng, threads = conf[k]
                        torch.set_num_threads(threads)  # this process's (the cp=2 ranks have their own)
                        res[k].append(measure(eng, prompts[3 * rep + list(conf).index(k)]))  # fresh: no hit
                torch.set_num_threads(a.cores)
                stats = two.rank_stats
                puts, skipped = stats[0]["puts"], stats[1]["skipped_puts"]
            med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in res.items()}
            rows.append(f"| {name} | cp=1 | {a.cores} | {med['cp1'][0]:.1f} | {int(med['cp1'][1])} |")
            rows.append(f"| {name} | cp=1 (control) | 1 | {med['cp1_1t'][0]:.1f} | {int(med['cp1_1t'][1])} |")
            rows.append(f"| {name} | cp=2 | {max(1, a.cores // 2)} per rank | {med['cp2'][0]:.1f} | "
                        f"{int(med['cp2'][1])} |")
            rows.append(f"| {name} | **cp2/cp1** | | **{med['cp2'][0] / med['cp1'][0]:.2f}** | "
                        f"{med['cp2'][1] / med['cp1'][1]:.2f} |")
            rows.append(f"| {name} | **cp2/control** | | **{med['cp2'][0] / med['cp1_1t'][0]:.2f}** | "
                        f"{med['cp2'][1] / med['cp1_1t'][1]:.2f} |")
            for k, v in res.items():
                raw.append(f"{name} {k}: TTFT ms {[round(x[0], 1) for x in v]}, pool bytes {[x[1] for x in v]}")
            per_rank = int(med["cp2"][1]) * (puts + skipped) // max(puts, 1)
            extra.append(f"{name} cp=2: {int(med['cp2'][1])} pool bytes per prompt saved once (CP rank 0; rank 1 "
                         f"skipped {skipped} puts of rank 0's {puts}) vs {per_rank} if every CP rank saved its "
                         f"replica under its own keys")
    print(f"reps={a.reps} prompt_len={a.prompt_len} cores={a.cores} (medians; interleaved)\n")
    print("| model | layout | torch threads | TTFT ms | pool bytes per prompt |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nraw:\n" + "\n".join(raw))
    print("\n" + "\n".join(extra))


if __name__ == "__main__":
    main()
