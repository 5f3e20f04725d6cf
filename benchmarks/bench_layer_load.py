"""Layer-wise load of a long pool hit vs a whole-prefix load (issue 17 item 6): TTFT side by side.

The bench model of bench_ttft.py (random Qwen3-style weights, 6 layers, hidden 256, block 16,
float32), chunked prefill on (budget ``--budget``), write async. Per round a fresh random prompt:
its first half (or all of it) is put in the pool by an unmeasured run, then the full prompt is
measured, its hit loaded with the first chunk:

    cold             write off, no prefix cache: the whole prompt computed
    hit/forward      the hit loaded as a whole prefix (``granularity: forward``: one load event;
                     the first chunk's attention waits for every layer's load)
    hit/layer        the hit loaded layer by layer (``granularity: layer``: layer i's attention waits
                     for layer i's load only, so the load hides behind the chunk's compute)

each at a 50% and a full hit, with the load as it is here (host pool: a memory copy per layer) and
with a slow transfer (``Faults(load_delay_s=D)``: D slept in every per-layer load op, standing in for
a pool across a network). No device prefix cache exists on this branch, so a pool hit is compared
with the whole-prefix load, not with a device hit. Configurations interleaved round-robin, order
rotated every round; medians and raw numbers printed. The first token is asserted equal across
configurations every round.

    .venv/bin/python benchmarks/bench_layer_load.py [--prompt-len 1024 --budget 256 --reps 7 --load-delay 0.004]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench_ttft import Prompts, add_model_args, bench_spec, bench_weights, rotated  # noqa: E402  (the same bench model)
from graphgen.runtime import open_engine  # noqa: E402
from graphgen.runtime.core.faults import Faults  # noqa: E402


def engines(spec, weights, budget: int, load_delay: float) -> dict:
    f = Faults(load_delay_s=load_delay) if load_delay else None
    mk = lambda write, gran, faults: open_engine(  # noqa: E731
        spec.with_overrides(write=write, granularity=gran), weights, spec_file="benchmarks/bench_layer_load.py",
        generated_dir=None, faults=faults, pool_capacity_bytes=1 << 30, max_num_batched_tokens=budget)
    return {"cold": mk("off", "forward", None), "hit/forward": mk("async", "forward", f),
            "hit/layer": mk("async", "layer", f)}


def section(engs: dict, prompts: Prompts, reps: int, frac: float) -> dict:
    out = {k: [] for k in engs}
    for r in range(reps):
        p = prompts.next()
        first = None
        for name in rotated(list(engs), r):
            eng = engs[name]
            if name != "cold":
                eng.generate([p[:int(len(p) * frac)] if frac < 1 else p], 1)  # the pool holds the prefix
                eng.drain()
            res = eng.generate([p], 1)[0]
            eng.drain()
            assert name == "cold" or res.hit_tokens >= (int(len(p) * frac) - 1) // eng.block_size * eng.block_size, \
                (name, res.hit_tokens)
            first = res.tokens if first is None else first
            assert res.tokens == first, (name, res.tokens, first)
            out[name].append(res.ttft_ms)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--load-delay", type=float, default=0.004, help="seconds slept in each per-layer load op")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = bench_spec(args)
    print(f"# bench_layer_load — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"model: {args.layers} layers, hidden {args.hidden}, block {args.block_size}; prompt {args.prompt_len}, "
          f"budget {args.budget}, reps {args.reps}")
    weights = bench_weights(spec)
    prompts = Prompts(1, args.vocab, args.prompt_len)
    rows = {}
    for delay in (0.0, args.load_delay):
        engs = engines(spec, weights, args.budget, delay)
        try:
            for frac in (0.5, 1.0):
                rows[f"load_delay={delay * 1e3:g}ms hit={int(frac * 100)}%"] = section(engs, prompts, args.reps, frac)
        finally:
            for e in engs.values():
                e.close()
    print("\nTTFT medians (ms); ratio = hit/layer over hit/forward")
    for what, d in rows.items():
        m = {k: statistics.median(v) for k, v in d.items()}
        print(f"  {what:28s} cold {m['cold']:8.1f}  hit/forward {m['hit/forward']:8.1f}  hit/layer "
              f"{m['hit/layer']:8.1f}  layer/forward {m['hit/layer'] / m['hit/forward']:.2f}  "
              f"layer/cold {m['hit/layer'] / m['cold']:.2f}")
    print("\nraw (ms): " + json.dumps({w: {k: [round(x, 1) for x in v] for k, v in d.items()} for w, d in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
