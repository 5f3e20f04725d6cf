"""Cost of decode-time saves (pool.save_decode) on decode throughput, and what they buy on turn 2.
Usage: PYTHONPATH=. python benchmarks/save_decode.py [REPEATS]
tiny_qwen3 (random checkpoint, seed 0), write async, 8 requests x 64 new tokens, 1 torch thread;
then a two-turn chat: turn 2 = turn 1 prompt + answer + 8 tokens, its hit tokens and TTFT."""
import dataclasses
import statistics
import sys
import tempfile
import time

import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import open_engine, write_random_hf_checkpoint

reps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
torch.set_num_threads(1)
spec = load_spec("specs/tiny_qwen3.yaml")
ck = tempfile.mkdtemp(prefix="bench_save_decode_")
write_random_hf_checkpoint(ck, spec.family, dataclasses.asdict(spec.dims), seed=0)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 256, (32,), generator=g).tolist() for _ in range(8)]
rows = {}
for save_decode in (False, True):
    s = dataclasses.replace(spec, pool=dataclasses.replace(spec.pool, write="async", save_decode=save_decode))
    with open_engine(s, ck, num_blocks=1024) as e:
        e.generate(prompts, 8, batch=True)  # warm
        xs = []
        for i in range(reps):
            ps = [[(t + i + 1) % 256 for t in p] for p in prompts]  # no pool hits between repeats
            t0 = time.perf_counter()
            e.generate(ps, 64, batch=True)
            xs.append(time.perf_counter() - t0)
        e.drain()
        turn1 = [(t + 99) % 256 for t in prompts[0]]
        ans = e.generate([turn1], 64)[0].tokens
        e.drain()
        r2 = e.generate([turn1 + ans + list(range(8))], 1)[0]
        rows[save_decode] = (statistics.median(xs), min(xs), r2.hit_tokens, r2.ttft_ms, e.stats["puts"])
print(f"| save_decode | 8x64 decode median s | min s | tok/s (median) | turn-2 hit tokens | turn-2 TTFT ms | puts |"
      f"  (repeats={reps})")
for k, (med, mn, hit, ttft, puts) in rows.items():
    print(f"| {k} | {med:.3f} | {mn:.3f} | {8 * 64 / med:.0f} | {hit} | {ttft:.1f} | {puts} |")
print(f"ratio on/off (median): {rows[True][0] / rows[False][0]:.3f}")
