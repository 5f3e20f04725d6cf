"""Acceptance 1: the generated graphs, run by the engine on a spec made by `graphgen import-hf` and
the checkpoint folder saved by transformers, reproduce transformers' float32 logits (atol 1e-4) at
the first position and at every decode step, for prefill without history (mempool_prefill), prefill
with history loaded from the pool (splitfuse) and decode, one request at a time and batched (the
batch's second prompt joins the first one's decode in a mixed batch: one splitfuse forward)."""

from __future__ import annotations

import pytest
import torch

import e2e_util as u

from graphgen.runtime import open_engine
from graphgen.modelspec.loader import load_spec

N_NEW = 4


@pytest.mark.parametrize("family", ["qwen3_dense", "deepseek_v3"])
def test_engine_logits_match_hf_every_step(family, imported):
    case = imported[family]
    bs = load_spec(case.spec).kv_cache.block_size  # what import-hf chose (128): prompts span it
    g = torch.Generator().manual_seed(11)
    a = u.rand_prompt(g, bs + 5)                      # one full block + a partial one
    b = a[:bs] + u.rand_prompt(g, 9)                  # shares exactly the first full block with a
    c = u.rand_prompt(g, bs - 2)                      # decode crosses into the second block
    # The imported spec writes asynchronously; the checkpoint is passed as the folder, so the
    # engine's own loader (and its config check) is exercised.
    with open_engine(case.spec, case.hf.dir, collect_logits=True, num_blocks=16) as eng:
        assert eng.write == "async"
        ra = eng.generate([a], N_NEW)[0]
        eng.drain()                                   # a's block is committed: b must find it
        rb = eng.generate([b], N_NEW)[0]
        eng.drain()
        batched = eng.generate([a, c], N_NEW, batch=True)  # one with history, one without
    assert (ra.variant, ra.hit_tokens) == ("mempool_prefill", 0)
    assert (rb.variant, rb.hit_tokens) == ("splitfuse", bs)
    # a (history) and c (none) are two variants: a's prefill goes first, then c's whole prompt and
    # a's first decode row share one forward of the history variant (a mixed batch)
    assert [(r.variant, r.hit_tokens) for r in batched] == [("splitfuse", bs), ("splitfuse", 0)]
    for what, r in (("prefill", ra), ("splitfuse", rb), ("batched splitfuse", batched[0]),
                    ("batched mixed prefill", batched[1])):
        u.assert_steps_match_hf(case.hf.model, r, f"{family} {what}")
    # a rerun from the pool must give exactly the tokens of the first computation
    assert batched[0].tokens == ra.tokens
