"""Cost of logprobs / prompt logprobs, and n=4 (one prefill, forked copies) vs four requests, against a live
server (tiny_qwen3).
Usage: PYTHONPATH=. python benchmarks/logprobs_n.py [CKPT_DIR|random] [REPEATS]
(``random``, the default: a random tiny_qwen3 checkpoint, seed 0, written to a temp folder)."""
import concurrent.futures as cf
import dataclasses
import statistics
import sys
import tempfile
import time

sys.path[:0] = ["tests", "tests/serve"]
from serve_util import Server  # noqa: E402

ck = sys.argv[1] if len(sys.argv) > 1 else "random"
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
if ck == "random":
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime import write_random_hf_checkpoint

    spec = load_spec("specs/tiny_qwen3.yaml")
    ck = tempfile.mkdtemp(prefix="bench_logprobs_")
    write_random_hf_checkpoint(ck, spec.family, dataclasses.asdict(spec.dims), seed=0)
prompt = list(range(1, 65))
s = Server(ck, "--write", "off", "--num-blocks", "512")
try:
    c = s.client()

    def t(fn):
        fn()  # warm
        xs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            xs.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(xs), min(xs)

    base = dict(model="tiny_qwen3", prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    rows = [
        ("16 tokens, no logprobs", lambda: c.completions.create(**base)),
        ("16 tokens, logprobs=5", lambda: c.completions.create(logprobs=5, **base)),
        ("16 tokens, logprobs=20", lambda: c.completions.create(logprobs=20, **base)),
        ("echo + logprobs=1, max_tokens=1 (lm-eval loglikelihood)",
         lambda: c.completions.create(model="tiny_qwen3", prompt=prompt, max_tokens=1, logprobs=1, echo=True,
                                      temperature=0)),
        ("max_tokens=1, no logprobs", lambda: c.completions.create(model="tiny_qwen3", prompt=prompt, max_tokens=1,
                                                                  temperature=0)),
        ("n=4, 16 tokens, T=1", lambda: c.completions.create(n=4, **dict(base, temperature=1.0, seed=1))),
    ]

    def four():
        with cf.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda i: c.completions.create(**dict(base, temperature=1.0, seed=i)), range(4)))

    rows.append(("4 concurrent requests, 16 tokens, T=1", four))
    # prefill-bound: a long prompt, one token each (the forks' one prefill shows here)
    long_base = dict(model="tiny_qwen3", prompt=list(range(1, 256)) + list(range(1, 130)), max_tokens=1,
                     temperature=1.0, extra_body={"ignore_eos": True})
    rows.append(("n=4, 384-token prompt, max_tokens=1, T=1",
                 lambda: c.completions.create(n=4, **dict(long_base, seed=1))))

    def four_long():
        with cf.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda i: c.completions.create(**dict(long_base, seed=i)), range(4)))

    rows.append(("4 concurrent requests, 384-token prompt, max_tokens=1, T=1", four_long))
    print(f"| request (64-token prompt) | median ms | min ms |  (repeats={reps})")
    for name, fn in rows:
        med, mn = t(fn)
        print(f"| {name} | {med:.1f} | {mn:.1f} |")
finally:
    s.terminate()
