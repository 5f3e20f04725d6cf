"""Chunked prefill end to end, both families: prompts 4x, 16x and 64x the chunk size (a step budget
of 8 tokens, block size 4: 32, 128 and 512 tokens) give transformers' logits (atol 1e-4, every
generated step) and greedy tokens, chunked and unchunked; the tokens are the same with write
async, sync and off; and what the chunks saved is what a later request loads (a warm rerun hits
every full block but the last token's and gives the same tokens)."""

from __future__ import annotations

import pytest
import torch

import e2e_util as u

from graphgen.runtime import open_engine

BUDGET = 8
N_NEW = 3


def _model(request, family):
    return (u.TINY_QWEN3, request.getfixturevalue("qwen")) if family == "qwen3_dense" else \
        (u.TINY_DSV3, request.getfixturevalue("tiny_dsv3"))


@pytest.mark.parametrize("family", ["qwen3_dense", "deepseek_v3"])
def test_chunked_prefill_matches_hf_and_unchunked_in_every_write_mode(family, request):
    spec, hf = _model(request, family)
    g = torch.Generator().manual_seed(17)
    prompts = [u.rand_prompt(g, k * BUDGET) for k in (4, 16, 64)]
    runs = {}
    for chunked, write in ((True, "async"), (False, "async"), (True, "sync"), (True, "off")):
        with open_engine(spec, hf.dir, write=write, chunked_prefill=chunked, max_num_batched_tokens=BUDGET,
                         collect_logits=True, num_blocks=160) as eng:
            steps = []
            inner = eng.runner.submit
            eng.runner.submit = lambda plan, **kw: (steps.append((plan.phase, plan.num_tokens)), inner(plan, **kw))[1]
            runs[chunked, write] = eng.generate(prompts, N_NEW)
            cold = list(steps)
            if (chunked, write) == (True, "async"):
                eng.drain()                        # every block a chunk completed is committed
                warm = eng.generate(prompts, N_NEW)
                bs = eng.block_size
        prefill = [n for phase, n in cold if phase == "prefill"]
        if chunked:
            assert max(prefill) <= BUDGET and len(prefill) == sum(len(p) for p in prompts) // BUDGET
        else:
            assert prefill == [len(p) for p in prompts]           # each prompt in one oversized step
    for (chunked, write), results in runs.items():
        for p, r in zip(prompts, results):
            what = f"{family} chunked={chunked} write={write} prompt={len(p)}"
            u.assert_greedy_by_hf(hf.model, p, r.tokens, what)
            if write == "async":
                u.assert_steps_match_hf(hf.model, r, what)
    assert [r.hit_tokens for r in warm] == [(len(p) - 1) // bs * bs for p in prompts]
    assert [r.tokens for r in warm] == [r.tokens for r in runs[True, "async"]]
