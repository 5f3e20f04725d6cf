"""tp=1 vs tp=2 on this machine's cores (TTFT, decode tokens/s) and pool bytes per prompt with the
MLA latent saved once (rank 0) vs per rank.

    PYTHONPATH=. python benchmarks/bench_tp.py [--prompt-len 64] [--new 16]

Tiny random models (the shipped tiny specs' dims, float32): the numbers show the overheads of
process ranks and gloo collectives at a size where compute is small, not a speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import tempfile
import time
from pathlib import Path

import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime.engine import Engine

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("hf_models", REPO / "tests" / "runtime" / "hf_models.py")
hfm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hfm)


def run(spec, d, prompt, new, **kw):
    with Engine.from_spec(REPO / spec, d, num_blocks=256, **kw) as eng:
        eng.generate([prompt[:8]], 2)  # warm-up (compile, first collectives)
        eng.drain()
        t = time.perf_counter()
        r = eng.generate([prompt], new)[0]
        total = time.perf_counter() - t
        eng.drain()
        pool = eng.pool_stats() if hasattr(eng, "pool_stats") and callable(eng.pool_stats) else eng.pool.stats()
    decode_s = max(total - r.ttft_ms / 1000, 1e-9)
    return r.ttft_ms, (new - 1) / decode_s, pool["used_bytes"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (a.prompt_len,), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        _, qd = hfm.build_hf_model("qwen3_dense", hfm.QWEN3_DIMS, f"{tmp}/q", seed=0)
        dims = dataclasses.asdict(load_spec(REPO / "specs/tiny_deepseek_v3.yaml").dims)
        _, dd = hfm.build_hf_model("deepseek_v3", dims, f"{tmp}/d", seed=0)
        print("| model | layout | TTFT ms | decode tok/s | pool bytes per prompt |")
        print("|---|---|---|---|---|")
        for name, spec, d, layouts in (("tiny_qwen3", "specs/tiny_qwen3.yaml", qd, ({}, {"tp": 2})),
                                       ("tiny_deepseek_v3", "specs/tiny_deepseek_v3.yaml", dd,
                                        ({}, {"tp": 2, "ep": 2}))):
            for kw in layouts:
                ttft, tps, used = run(spec, d, prompt, a.new, write="sync", **kw)
                label = ", ".join(f"{k}={v}" for k, v in kw.items()) or "tp=1"
                print(f"| {name} | {label} | {ttft:.1f} | {tps:.1f} | {used} |")
        # MLA: per-rank saving (the seed's scheme) would store tp copies of the same latent
        _, _, once = run("specs/tiny_deepseek_v3.yaml", dd, prompt, a.new, write="sync", tp=2, ep=2)
        print(f"\nMLA latent, tp=2: {once} pool bytes saved once (rank 0) vs {2 * once} per rank "
              f"(seed's {{hash}}_{{tp_rank}}_{{tp_size}} keys): {once} bytes ({50:.0f}%) saved per prompt")


if __name__ == "__main__":
    main()
