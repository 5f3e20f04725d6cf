"""``graphgen serve`` on two tensor-parallel ranks (``tiny_qwen3_tp2``: the spec's own ``parallel: {tp: 2}``),
driven by the ``openai`` client on 127.0.0.1: greedy completions, sent concurrently (continuous batching
over the ranks), equal what ``graphgen run --tp 2 --json`` prints for the same prompts (whose logits
tests/parallel checks against transformers); a seeded sampled request gives the same tokens twice; an
unseeded one completes (that its ranks drew the same tokens is not visible from outside: only rank 0's
come back) and a greedy request after it, now a pool hit on both ranks, still gives ``run``'s tokens;
SIGTERM exits 0. Every wait is bounded."""
from __future__ import annotations

import concurrent.futures as cf

from serve_util import ROOT, Server
from support.cli import run_tokens

SPEC_TP2 = ROOT / "specs" / "tiny_qwen3_tp2.yaml"
PROMPTS = [[5, 17, 33, 2, 9, 100, 41], list(range(1, 14)), [255, 0, 128]]
N_NEW = 6


def _run_tp2(ckpt) -> list[list[int]]:
    return run_tokens(SPEC_TP2, ckpt, PROMPTS, N_NEW, "--tp", "2", timeout=240)


def test_serve_tp2_greedy_equals_run_tp2_and_seeded_sampling_repeats(ckpt):
    want = _run_tp2(ckpt)
    assert len(want) == len(PROMPTS)
    s = Server(ckpt, "--write", "sync", "--num-blocks", "64", spec=SPEC_TP2)
    try:
        c = s.client()

        def greedy(p):
            r = c.completions.create(model="tiny_qwen3_tp2", prompt=p, max_tokens=N_NEW, temperature=0)
            return list(r.choices[0].model_extra["token_ids"])

        with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
            got = list(ex.map(greedy, PROMPTS, timeout=180))
        assert got == want

        def sampled(**kw):
            r = c.completions.create(model="tiny_qwen3_tp2", prompt=[9, 8, 7], max_tokens=8, temperature=1.0,
                                     **kw)
            return list(r.choices[0].model_extra["token_ids"])

        first, second = sampled(seed=1234), sampled(seed=1234)
        assert first == second and len(first) == 8
        assert len(sampled()) == 8  # no seed: the server chose one for both ranks
        assert greedy(PROMPTS[0]) == want[0]  # the prompt's blocks now come from the pool on both ranks
    finally:
        rc = s.terminate()
    assert rc == 0, s.proc.stderr.read()[-3000:]
