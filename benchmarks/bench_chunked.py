"""Chunked prefill on the CPU target (issue 17), side by side in one run, medians and ratios.

(a) Decode inter-token latency of a running request while a long prompt arrives: chunked (mixed
    batches: its decode row in every chunk's step) vs unchunked (the long prompt is one oversized step). Reported:
    the running request's median and max gap between tokens.
(b) The engine vs transformers (attn_implementation="sdpa") on the same model and thread count:
    prefill of one prompt (the engine chunked and unchunked), and greedy decode per token.

Model: specs/tiny_qwen3.yaml with random weights (2 layers, hidden 64): per-op overhead dominates,
so these are ratios of this machine's Python + kernel overheads, not of a real model's FLOPs.

    .venv/bin/python benchmarks/bench_chunked.py [--long 2048 --budget 256 --reps 3 --threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "specs" / "tiny_qwen3.yaml"


def itl_run(ckpt, chunked, long_len, budget, n_decode=48):
    from graphgen.runtime import open_engine

    g = torch.Generator().manual_seed(0)
    short = torch.randint(0, 256, (16,), generator=g).tolist()
    long = torch.randint(0, 256, (long_len,), generator=g).tolist()
    with open_engine(SPEC, ckpt, write="async", chunked_prefill=chunked, max_num_batched_tokens=budget,
                     num_blocks=(long_len + 256) // 4 + 64) as eng:
        llm = eng.core
        llm.add_request("run", short, max_tokens=n_decode)
        times, added = [], False
        while llm.has_work():
            outs = llm.step()
            now = time.perf_counter()
            for o in outs:
                if o.req_id == "run":
                    times.append(now)
            if len(times) == 8 and not added:
                llm.add_request("long", long, max_tokens=1)
                added = True
        eng.drain()
    gaps = [(b - a) * 1e3 for a, b in zip(times[8:], times[9:])]   # from the arrival on
    return statistics.median(gaps), max(gaps)


def engine_prefill_decode(ckpt, chunked, prompt, budget, n_new):
    from graphgen.runtime import open_engine

    with open_engine(SPEC, ckpt, write="off", chunked_prefill=chunked, max_num_batched_tokens=budget,
                     num_blocks=len(prompt) // 4 + 64) as eng:
        t = time.perf_counter()
        eng.generate([prompt], 1)
        pre = time.perf_counter() - t
        t = time.perf_counter()
        r = eng.generate([prompt], n_new)[0]
        dec = (time.perf_counter() - t - pre) / (n_new - 1)
    return pre * 1e3, dec * 1e3, r.tokens


@torch.no_grad()
def hf_prefill_decode(model, prompt, n_new):
    ids = torch.tensor([prompt])
    t = time.perf_counter()
    model(input_ids=ids)
    pre = time.perf_counter() - t
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new)
    dec = (time.perf_counter() - t - pre) / (n_new - 1)
    return pre * 1e3, dec * 1e3, out[0, len(prompt):].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint
    from transformers import AutoModelForCausalLM

    spec = load_spec(SPEC)
    ckpt = tempfile.mkdtemp()
    write_random_hf_checkpoint(ckpt, spec.family, dataclasses.asdict(spec.dims), seed=0)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa", torch_dtype=torch.float32).eval()
    prompt = torch.randint(0, 256, (a.long,), generator=torch.Generator().manual_seed(1)).tolist()
    print(f"threads={a.threads} long={a.long} budget={a.budget} reps={a.reps} new={a.new}")

    itl = {True: [], False: []}
    perf = {"engine chunked": [], "engine unchunked": [], "transformers sdpa": []}
    for rep in range(a.reps):
        order = [True, False] if rep % 2 == 0 else [False, True]
        for c in order:
            itl[c].append(itl_run(ckpt, c, a.long, a.budget))
        names = list(perf)[rep % 3:] + list(perf)[:rep % 3]
        for name in names:
            if name == "transformers sdpa":
                perf[name].append(hf_prefill_decode(hf, prompt, a.new))
            else:
                perf[name].append(engine_prefill_decode(ckpt, name == "engine chunked", prompt, a.budget, a.new))
    print("\n(a) running request's inter-token gap after a long prompt arrives (ms): median, max; raw per rep")
    for c in (True, False):
        med = statistics.median(x[0] for x in itl[c])
        mx = statistics.median(x[1] for x in itl[c])
        print(f"  {'chunked  ' if c else 'unchunked'} median {med:8.2f}  max {mx:8.2f}   raw {itl[c]}")
    ratio = statistics.median(x[1] for x in itl[False]) / statistics.median(x[1] for x in itl[True])
    print(f"  max gap unchunked / chunked = {ratio:.2f}")
    print(f"\n(b) prefill of {a.long} tokens (ms) and greedy decode per token (ms); raw per rep")
    toks = {n: v[-1][2] for n, v in perf.items()}
    for name, v in perf.items():
        print(f"  {name:18s} prefill {statistics.median(x[0] for x in v):9.1f}  "
              f"decode {statistics.median(x[1] for x in v):7.2f}   raw {[(round(x[0], 1), round(x[1], 2)) for x in v]}")
    ref = perf["transformers sdpa"]
    for name in ("engine chunked", "engine unchunked"):
        print(f"  {name} / transformers: prefill "
              f"{statistics.median(x[0] for x in perf[name]) / statistics.median(x[0] for x in ref):.2f}x, decode "
              f"{statistics.median(x[1] for x in perf[name]) / statistics.median(x[1] for x in ref):.2f}x")
    print(f"  same greedy tokens as transformers: {toks['engine chunked'] == toks['transformers sdpa']} (chunked), "
          f"{toks['engine unchunked'] == toks['transformers sdpa']} (unchunked)")


if __name__ == "__main__":
    main()
