"""MLA for every valid head-dim combination (issue 28 item 5): DeepSeek-V3's value head may be narrower
than, as wide as, or wider than the query/key head (``v_head_dim`` vs ``qk_nope_head_dim +
qk_rope_head_dim``), with or without query compression (``q_lora_rank``). transformers runs them all; the
CPU target's MLA (prefill, prefill over history from the pool, decode) must equal it at every step
(float32, atol 1e-4). A value head wider than the query head crashed ``graphgen run`` in ``mla_attention``
before. The NPU lowering's MLA on the same combinations: tests/npu/test_npu_wiring.py."""

from __future__ import annotations

import pytest
import torch

from graphgen.modelspec.import_hf import import_hf
from graphgen.runtime import open_engine

from support.hf import DSV3_DIMS, assert_steps_match_hf, build_hf_model, rand_prompt

QK_NOPE, QK_ROPE = 8, 4  # a query/key head of 12


@pytest.mark.parametrize("v_head_dim,q_lora_rank", [(8, 32), (12, None), (16, 32), (16, None)],
                         ids=["v-below-q", "v-equal-q-no-q-lora", "v-above-q", "v-above-q-no-q-lora"])
def test_mla_matches_transformers_for_value_heads_below_equal_and_above_the_query_head(tmp_path, v_head_dim,
                                                                                      q_lora_rank):
    torch.set_num_threads(1)
    dims = dict(DSV3_DIMS, qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=QK_ROPE, v_head_dim=v_head_dim,
                q_lora_rank=q_lora_rank)
    model, hf_dir = build_hf_model("deepseek_v3", dims, str(tmp_path / "hf"), seed=5)
    spec = tmp_path / "spec.yaml"
    import_hf(hf_dir, spec, "mla_dims", block_size=4)
    g = torch.Generator().manual_seed(3)
    a = rand_prompt(g, 10)
    b = a[:8] + rand_prompt(g, 3)  # its first two blocks come back from the pool: attention over history
    with open_engine(spec, hf_dir, collect_logits=True, num_blocks=32) as eng:
        ra = eng.generate([a], 3)[0]
        eng.drain()
        rb = eng.generate([b], 3)[0]
    assert (ra.variant, rb.variant, rb.hit_tokens) == ("mempool_prefill", "splitfuse", 8)
    assert_steps_match_hf(model, ra, f"v={v_head_dim} prefill + decode")
    assert_steps_match_hf(model, rb, f"v={v_head_dim} splitfuse + decode")
