"""W8A8 (dynamic) against bfloat16 (issue 28 item 2): how far the int8 linear layers move a model's logits.

    python benchmarks/bench_w8a8.py [--prompts 16] [--new 32] [--seed 0] [--models tiny_qwen3,tiny_deepseek_v3]

For each model (a shipped CPU spec, its KV/compute dtype set to bfloat16) one random checkpoint
(graphgen's writer, bfloat16, a fixed seed) runs through the CPU target twice: as is (``quantization:
none``: every weight bf16) and as ``quantization: {method: w8a8_dynamic}`` (the linear layers int8 with one
scale per output channel, activations quantized per token; embedding, norms, router, lm_head, kv_b_proj in
bf16) -- the arithmetic the NPU lowering asks of ``npu_quant_matmul`` / ``npu_grouped_matmul``, emulated
exactly (graphgen/runtime/core/quant.py). A fixed prompt set (``--prompts`` random prompts of 8-40 tokens,
``--seed``) is decoded greedily by the bf16 model for ``--new`` tokens; then both models score the same
sequences (prompt + the bf16 continuation, one prefill, logits at every continuation position: teacher
forcing, so every position compares the two on identical inputs). Reported per model:

* **logits cosine** per token (float32 cosine of the two logit vectors): mean, 5th percentile, min;
* **greedy agreement**: the share of positions where the W8A8 argmax equals the bf16 argmax (= the bf16
  greedy token), and the share of prompts whose whole W8A8 greedy continuation (free-running, its own
  tokens fed back) equals bf16's;
* the same figures for the unquantized model computed in float32 against bf16: how far bf16 rounding
  alone moves these logits (the scale to read W8A8's against; random MoE routing flips on near-ties).

Random weights: the figures describe quantization noise on this kind of model, not a trained model's
accuracy. A figure, not a pass/fail: nothing here is asserted but that the two runs differ at all.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphgen.modelspec import model as m  # noqa: E402
from graphgen.modelspec.loader import load_spec  # noqa: E402
from graphgen.runtime import open_engine  # noqa: E402
from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint  # noqa: E402
from graphgen.runtime.engine.request import RowPlan, StepPlan  # noqa: E402
from graphgen.runtime.engine.runner import build_inputs  # noqa: E402


def teacher_forced(eng, seq: list[int], first: int) -> torch.Tensor:
    """Logits [len(seq) - first, V] of one no-history prefill of ``seq`` at positions first-1 .. len-2
    (each predicts the next token of ``seq``)."""
    bs = eng.runner.block_size
    table = eng.alloc.alloc(-(-len(seq) // bs))
    try:
        row = RowPlan(None, tuple(seq), 0, tuple(table), logits_positions=tuple(range(first - 1, len(seq) - 1)))
        variant = eng.scheduler.variant_for("prefill", False)
        inputs = build_inputs(StepPlan(variant, "prefill", (row,), False), bs)
        staging = eng.runner.cache.make_staging(0) if eng.runner.saves(variant) else None
        return eng.runner.execute(variant, inputs, staging, ()).logits.float()
    finally:
        eng.alloc.free(table)


def measure(name: str, prompts, new: int, tmp: Path, fp8_block=None) -> dict:
    base = load_spec(ROOT / "specs" / f"{name}.yaml")
    spec = dataclasses.replace(base, kv_cache=dataclasses.replace(base.kv_cache, dtype="bfloat16"),
                               pool=dataclasses.replace(base.pool, write="off"), features=())
    ckpt = write_random_hf_checkpoint(str(tmp / name), spec.family, dataclasses.asdict(spec.dims), seed=0,
                                      dtype=torch.bfloat16, tokenizer=False)
    if fp8_block is not None:  # issue 36 item 4: the published FP8 layout, re-quantized to W8A8 without calibration
        sys.path.insert(0, str(ROOT / "tests"))
        from support.fp8 import to_fp8_checkpoint  # the tests' writer of DeepSeek-V3's published FP8 layout

        ckpt = str(to_fp8_checkpoint(ckpt, tmp / f"{name}_fp8", fp8_block))
        # the reference: the FP8 weights dequantized (value = fp8 x scale) and run in bf16
        spec = dataclasses.replace(spec, quantization=m.Quantization(
            checkpoint=m.Fp8Checkpoint(weight_block_size=tuple(fp8_block))))
    w8 = dataclasses.replace(spec, quantization=dataclasses.replace(spec.quantization, method="w8a8_dynamic"))
    out: dict = {"model": name}
    with open_engine(spec, ckpt, num_blocks=256) as eng:
        t0 = time.process_time()
        bf16 = [r.tokens for r in eng.generate(prompts, new)]
        ref = [teacher_forced(eng, p + t, len(p)) for p, t in zip(prompts, bf16)]
        out["cpu_s_bf16"] = time.process_time() - t0
    with open_engine(w8, ckpt, num_blocks=256) as eng:
        t0 = time.process_time()
        free = [r.tokens for r in eng.generate(prompts, new)]
        got = [teacher_forced(eng, p + t, len(p)) for p, t in zip(prompts, bf16)]
        out["cpu_s_w8a8"] = time.process_time() - t0
    # the scale to read the figures against: the same bf16 weights computed in float32, unquantized
    fp32 = dataclasses.replace(spec, kv_cache=dataclasses.replace(spec.kv_cache, dtype="float32"))
    with open_engine(fp32, ckpt, num_blocks=256) as eng:
        exact = [teacher_forced(eng, p + t, len(p)) for p, t in zip(prompts, bf16)]
    positions = sum(a.shape[0] for a in ref)
    for tag, other in (("", got), ("fp32_", exact)):
        cos = sorted(torch.cat([torch.nn.functional.cosine_similarity(a, b, dim=-1) for a, b in zip(ref, other)])
                     .tolist())
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(ref, other))
        out.update({f"{tag}cos_mean": statistics.fmean(cos), f"{tag}cos_p5": cos[len(cos) // 20],
                    f"{tag}cos_min": cos[0], f"{tag}argmax_agree": agree / positions})
    out.update(positions=positions, greedy_identical=sum(a == b for a, b in zip(bf16, free)) / len(prompts))
    assert out["cos_min"] < 1.0, "W8A8 and bf16 gave identical logits: nothing was quantized"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", default="tiny_qwen3,tiny_deepseek_v3")
    p.add_argument("--from-fp8", type=int, nargs=2, metavar=("B0", "B1"), default=None,
                   help="store the checkpoint in DeepSeek-V3's published FP8 layout with BxB blocks first: the reference "
                        "is its dequantized bf16, W8A8 re-quantizes the dequantized weights per channel (no calibration)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(8, 41, (args.prompts,), generator=g).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name in args.models.split(","):
            vocab = load_spec(ROOT / "specs" / f"{name}.yaml").dims.vocab_size
            prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(args.seed * 1000 + i))
                       .tolist() for i, n in enumerate(lens)]
            rows.append(measure(name, prompts, args.new, Path(tmp), args.from_fp8))
    ref = f"the FP8 ({args.from_fp8[0]}x{args.from_fp8[1]} blocks) checkpoint dequantized to bf16" if args.from_fp8 else "bf16"
    print(f"W8A8 vs {ref}, {args.prompts} prompts x {args.new} greedy tokens (seed {args.seed}), CPU target, "
          f"torch {torch.__version__}")
    print("| model | compared with bf16 | positions | logits cosine mean | p5 | min | argmax agreement | "
          "whole continuation identical | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | **W8A8** (bf16 activations) | {r['positions']} | {r['cos_mean']:.5f} | {r['cos_p5']:.5f} | "
              f"{r['cos_min']:.5f} | {r['argmax_agree']:.1%} | {r['greedy_identical']:.0%} | "
              f"{r['cpu_s_bf16']:.1f} bf16, {r['cpu_s_w8a8']:.1f} W8A8 |")
        print(f"| {r['model']} | float32, unquantized (the scale) | {r['positions']} | {r['fp32_cos_mean']:.5f} | "
              f"{r['fp32_cos_p5']:.5f} | {r['fp32_cos_min']:.5f} | {r['fp32_argmax_agree']:.1%} | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
