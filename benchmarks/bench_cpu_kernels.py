"""CPU kernels vs transformers (sdpa), side by side in one run (issue 17, acceptance (d)).

One random Qwen3-style checkpoint (default: 8 layers, hidden 512, intermediate 1536, 8/2 heads x 64,
vocab 1024, float32) is loaded by graphgen's CPU engine and by transformers
(``attn_implementation="sdpa"``), on the same torch thread count (default 1). For every prompt length:

  prefill   one prompt as one step (chunking off), wall ms of that step; transformers: one forward
            with ``use_cache=True`` (its KV cache is built, as the engine's is);
  decode    greedy decode steps after that prompt, median wall ms per step (tok/s = 1000 / ms);
            transformers: one forward per token with ``past_key_values``, argmax on the host;
  floor     the matmuls alone (every projection of every layer and the lm_head row(s), F.linear on
            the same weights, the same token count): transformers' matmuls, nothing else;
  floor-t   the same matmuls in graphgen's CPU layout (q/k/v and gate/up merged, weights stored
            [in, out], ``x @ W^T``: the generated modules' load-time weights) through the runtime's own
            ``matmul_t`` (MKL's GEMV for one row; several rows of a big weight on oneDNN where it is
            chosen — AVX-512 CPUs by default, ``GRAPHGEN_CPU_MATMUL`` — else MKL):
            graphgen's matmuls alone.

Rounds interleave graphgen / transformers / floor / floor-t, order rotated each round; medians reported, raw
per-round numbers printed. Greedy tokens of both are compared (must be equal).

    .venv/bin/python benchmarks/bench_cpu_kernels.py [--lens 512,2048 --decode 16 --reps 5 --threads 1]
    .venv/bin/python benchmarks/bench_cpu_kernels.py --profile 2048   # torch profiler tables, no timing
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
import torch.nn.functional as F  # noqa: E402

from bench_ttft import bench_spec  # noqa: E402  (one home for the benchmark model)
from graphgen.runtime.core import matmul, ops  # noqa: E402
from graphgen.runtime.core.weights import build_load_time_weight  # noqa: E402

Tensor = torch.Tensor


class Clock:
    """Wall and this thread's CPU ms since construction. On a machine shared with other work the
    wall time also counts the time the scheduler gave the core to someone else; the thread's CPU
    time does not (both run torch on the caller's thread: one intra-op thread, no async engine)."""

    def __init__(self):
        self.w, self.c = time.perf_counter(), time.thread_time()

    def ms(self) -> tuple[float, float]:
        return (time.perf_counter() - self.w) * 1e3, (time.thread_time() - self.c) * 1e3


def engine_run(eng, prompt, n_decode, after_prefill=None):
    """(prefill (wall, cpu) ms, [decode (wall, cpu) ms per step], tokens): one request driven step by step;
    ``after_prefill()`` is called once the prefill step is done (the profiler starts there)."""
    llm = eng.core
    llm.add_request("r", prompt, max_tokens=n_decode + 1)
    times, toks = [], []
    while llm.has_work():
        if len(times) == 1 and after_prefill is not None:
            after_prefill()
        t = Clock()
        outs = llm.step()
        times.append(t.ms())
        for o in outs:
            toks.extend(o.new_token_ids)
    eng.drain()
    return times[0], times[1:], toks


@torch.no_grad()
def hf_run(model, prompt, n_decode, after_prefill=None):
    ids = torch.tensor([prompt])
    t = Clock()
    out = model(input_ids=ids, use_cache=True)
    tok = int(out.logits[0, -1].argmax())
    pre = t.ms()
    if after_prefill is not None:
        after_prefill()
    past, toks, dec = out.past_key_values, [tok], []
    for _ in range(n_decode):
        t = Clock()
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        tok = int(out.logits[0, -1].argmax())
        past = out.past_key_values
        dec.append(t.ms())
        toks.append(tok)
    return pre, dec, toks


def linear_weights(weights: dict, layers: int) -> list:
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    return [[weights[f"model.layers.{i}.{n}.weight"] for n in names] for i in range(layers)]


def layout_t(lw: list) -> list:
    """graphgen's CPU layout of the same weights, built by the runtime's own recipe
    (`build_load_time_weight`, as the generated modules declare it): [q; k; v] and [gate; up] merged,
    every one [in, out]."""
    t = lambda *ws: build_load_time_weight(list(ws), dim=0, transpose12=False, transpose01=True)  # noqa: E731
    return [[t(q, k, v), t(o), t(g, u), t(d)] for q, k, v, o, g, u, d in lw]


@torch.no_grad()
def floor_ms(layers: list, lm_head: Tensor, T: int, *, in_out: bool) -> tuple[float, float]:
    """(wall, cpu) ms of the model's matmuls alone for T tokens (the lm_head on the last row only):
    ``F.linear`` on checkpoint-layout weights (``linear_weights``), or with ``in_out`` ``x @ W^T`` on
    graphgen's layout (``layout_t``) through ``matmul.matmul_t``, as the generated modules call it. Inputs are made before the clock starts."""
    mats = [w for layer in layers for w in layer]
    xs = {}
    inputs = [xs.setdefault(w.shape[0 if in_out else 1], torch.randn(T, w.shape[0 if in_out else 1])) for w in mats]
    mm = matmul.matmul_t if in_out else F.linear
    last = torch.randn(1, lm_head.shape[1])
    t = Clock()
    for x, w in zip(inputs, mats):
        mm(x, w)
    F.linear(last, lm_head)
    return t.ms()


def profile(eng, hf, prompt, n_decode):
    from torch.profiler import profile as tprofile, ProfilerActivity

    for name, fn in (("graphgen", engine_run), ("transformers", hf_run)):
        fn(eng if name == "graphgen" else hf, prompt, 2)
        with tprofile(activities=[ProfilerActivity.CPU]) as p:  # the prefill step alone
            fn(eng if name == "graphgen" else hf, prompt, 0)
        print(f"\n## profile: {name}, prefill of {len(prompt)} tokens")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        p = tprofile(activities=[ProfilerActivity.CPU])
        fn(eng if name == "graphgen" else hf, prompt, n_decode, after_prefill=p.start)
        p.stop()
        print(f"\n## profile: {name}, {n_decode} decode steps after {len(prompt)} tokens")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--lens", default="512,2048")
    ap.add_argument("--decode", type=int, default=16, help="decode steps per round")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", type=int, default=0, help="profile this prompt length instead of timing")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lens = [int(x) for x in args.lens.split(",")]

    from graphgen.runtime import open_engine
    from graphgen.runtime.checkpoint.hf import load_hf_weights, write_random_hf_checkpoint
    from transformers import AutoModelForCausalLM
    import transformers

    spec = bench_spec(args)
    d = spec.dims
    print(f"# bench_cpu_kernels — {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} CPUs "
          f"({platform.machine()}), load average {os.getloadavg()[0]:.1f}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"CPU matmuls: torch kernels {torch.backends.cpu.get_cpu_capability()}, several rows on "
          f"{'oneDNN' if matmul._ONEDNN_LINEAR is not None else 'MKL'} "
          f"(GRAPHGEN_CPU_MATMUL={os.environ.get('GRAPHGEN_CPU_MATMUL', 'auto')})")
    print(f"model: qwen3_dense, {d.num_hidden_layers} layers, hidden {d.hidden_size}, intermediate "
          f"{d.intermediate_size}, heads {d.num_attention_heads}/{d.num_key_value_heads} x {d.head_dim}, vocab "
          f"{d.vocab_size}, block size {spec.kv_cache.block_size}, float32; prompts {lens}, {args.decode} decode "
          f"steps, {args.reps} rounds")
    tmp = Path(tempfile.mkdtemp(prefix="bench_cpu_kernels_"))
    try:
        write_random_hf_checkpoint(tmp, spec.family, dataclasses.asdict(d), seed=args.seed)
        weights = load_hf_weights(str(tmp))
        hf = AutoModelForCausalLM.from_pretrained(str(tmp), attn_implementation="sdpa",
                                                  dtype=torch.float32).eval()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    longest = max(lens) + args.decode + 1
    eng = open_engine(spec, weights, write="off", spec_file="benchmarks/bench_cpu_kernels.py", generated_dir=None,
                      chunked_prefill=False, max_num_batched_tokens=longest,
                      num_blocks=longest // spec.kv_cache.block_size + 4)
    lw = linear_weights(weights, d.num_hidden_layers)
    lt = layout_t(lw)
    lm_w = weights["lm_head.weight"]
    g = torch.Generator().manual_seed(args.seed + 1)
    try:
        if args.profile:
            p = torch.randint(0, d.vocab_size, (args.profile,), generator=g).tolist()
            profile(eng, hf, p, args.decode)
            return 0
        rows = {}
        for n in lens:
            raw = {"graphgen": [], "transformers": [], "floor": [], "floor-t": []}
            same = True
            warm = torch.randint(0, d.vocab_size, (n,), generator=g).tolist()
            engine_run(eng, warm, 2), hf_run(hf, warm, 2)
            for r in range(args.reps):
                p = torch.randint(0, d.vocab_size, (n,), generator=g).tolist()
                order = ["graphgen", "transformers", "floor", "floor-t"]
                order = order[r % 4:] + order[:r % 4]
                toks = {}
                for who in order:
                    if who == "graphgen":
                        pre, dec, toks[who] = engine_run(eng, p, args.decode)
                    elif who == "transformers":
                        pre, dec, toks[who] = hf_run(hf, p, args.decode)
                    else:
                        ws, in_out = (lw, False) if who == "floor" else (lt, True)
                        pre = floor_ms(ws, lm_w, n, in_out=in_out)
                        dec = [floor_ms(ws, lm_w, 1, in_out=in_out) for _ in range(args.decode)]
                    raw[who].append([round(x, 3) for x in (*pre, statistics.median(s[0] for s in dec),
                                                            statistics.median(s[1] for s in dec))])
                if toks["graphgen"] != toks["transformers"]:
                    same = False
            rows[n] = (raw, same)
        print("\nmedians over rounds (per round: the prefill step, and the median decode step)\n")
        print("| prompt | who | prefill wall ms | prefill cpu ms | decode wall ms/token | decode cpu ms/token "
              "| decode tok/s (wall) |\n|---|---|---|---|---|---|---|")
        summary = []
        for n, (raw, same) in rows.items():
            med = {w: [statistics.median(x[i] for x in v) for i in range(4)] for w, v in raw.items()}
            for w, m in med.items():
                print(f"| {n} | {w} | {m[0]:.1f} | {m[1]:.1f} | {m[2]:.2f} | {m[3]:.2f} | {1e3 / m[2]:.1f} |")
            gg, hfm, fl, ft = med["graphgen"], med["transformers"], med["floor"], med["floor-t"]
            for clock, i in (("wall", 0), ("cpu", 1)):
                summary.append(
                    f"prompt {n} ({clock}): prefill graphgen/transformers {gg[i] / hfm[i]:.2f}x (floor/transformers "
                    f"{fl[i] / hfm[i]:.2f}x, floor-t {ft[i] / hfm[i]:.2f}x); decode tok/s graphgen/transformers "
                    f"{hfm[i + 2] / gg[i + 2]:.2f}x (floor {hfm[i + 2] / fl[i + 2]:.2f}x, floor-t {hfm[i + 2] / ft[i + 2]:.2f}x)")
            summary.append(f"prompt {n}: same greedy tokens as transformers in every round: {same}")
        print()
        print("\n".join(summary))
        print("\nraw per round [prefill wall, prefill cpu, median decode wall, median decode cpu] ms: "
              + json.dumps({n: raw for n, (raw, _) in rows.items()}))
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
