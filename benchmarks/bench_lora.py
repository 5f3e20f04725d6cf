"""Multi-LoRA throughput (issue 40): the same batch of prompts with no adapter, all under 1 adapter, and spread
over 4 adapters in one batch (``max_loras`` 4), side by side in one run; decode tokens/s, medians and ratios.

Model: specs/tiny_qwen3_lora.yaml with random weights (2 layers, hidden 64) and random rank-8 PEFT adapters on
all seven projections (written here in PEFT's format, no peft needed): per-op overhead dominates, so the
ratios are this machine's Python + kernel overheads of the per-token gather and shrink/expand
(graphgen.runtime.lora.delta), not a real model's FLOPs.

    .venv/bin/python benchmarks/bench_lora.py [--prompts 16 --len 32 --new 16 --reps 3 --threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "specs" / "tiny_qwen3_lora.yaml"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, spec, r: int, seed: int) -> None:
    """A random LoRA adapter as PEFT saves one (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    from graphgen.lora import lora_weight_keys

    g = torch.Generator().manual_seed(seed)
    w = {}
    for key, (o, i) in lora_weight_keys(spec).items():
        stem = "base_model.model." + key.removesuffix(".weight")
        w[f"{stem}.lora_A.weight"] = torch.randn(r, i, generator=g) * i ** -0.5
        w[f"{stem}.lora_B.weight"] = torch.randn(o, r, generator=g) * r ** -0.5 * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(w, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                         "target_modules": list(TARGETS), "bias": "none"}))


def run(ckpt, adapters: dict, loras, prompts, new: int) -> float:
    from graphgen.runtime import open_engine

    with open_engine(SPEC, ckpt, write="off", lora_modules=adapters, max_loras=4, num_blocks=2048) as eng:
        eng.generate(prompts[:2], 2, batch=True, lora=loras[:2])  # warm-up
        t = time.perf_counter()
        res = eng.generate(prompts, new, batch=True, lora=loras)
        dt = time.perf_counter() - t
    return sum(len(r.tokens) for r in res) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--len", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(SPEC)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (a.len,), generator=g).tolist() for _ in range(a.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "base"
        write_random_hf_checkpoint(ckpt, spec.family, dataclasses.asdict(spec.dims), seed=0)
        adapters = {}
        for k in range(4):
            write_adapter(Path(tmp) / f"a{k}", spec, 8, seed=k)
            adapters[f"a{k}"] = str(Path(tmp) / f"a{k}")
        cases = {"base (no adapter)": [None] * a.prompts, "1 adapter": ["a0"] * a.prompts,
                 "4 adapters, one batch": [f"a{i % 4}" for i in range(a.prompts)]}
        rates = {name: [] for name in cases}
        names = list(cases)
        for rep in range(a.reps):  # interleaved, the order rotated every round: a slow moment hits every case alike
            for name in names[rep % 3:] + names[:rep % 3]:
                rates[name].append(run(ckpt, adapters, cases[name], prompts, a.new))
    print(f"bench_lora: {a.prompts} prompts x {a.len} tokens, {a.new} new each, batch, write off, "
          f"{a.threads} threads, {a.reps} reps (tokens/s; median, then every rep)")
    base = statistics.median(rates["base (no adapter)"])
    for name, rs in rates.items():
        m = statistics.median(rs)
        print(f"  {name:24s} {m:8.1f} tok/s  x{m / base:5.2f} of base   raw: {', '.join(f'{r:.1f}' for r in rs)}")


if __name__ == "__main__":
    main()
