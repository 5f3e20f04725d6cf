"""The MTP layer as graphs vs transformers 5.24's ``MtpModel`` on the same random weights (atol 1e-4):
the target graphs' last hidden state (what the MTP layer reads), the MTP graph's hidden state and
logits at every position of a prompt shifted by one, run whole and in two pieces (the second piece
attends to the first's MTP KV in the cache, layer num_hidden_layers of the same block table)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import open_engine
from graphgen.runtime.checkpoint.hf import load_hf_weights, write_random_hf_checkpoint
from graphgen.runtime.engine.request import RowPlan
from graphgen.runtime.engine.spec_decode import mtp_variant, run_rows
from support.hf import ATOL, hf_mtp_reference as _reference
from support.paths import TINY_DSV3_MTP

BASE = load_spec(TINY_DSV3_MTP)
CONFIGS = {
    "tiny": {},
    # uncompressed queries, every layer MoE, two shared experts, RoPE on halves, another width
    "q_lora_null": {"q_lora_rank": None, "first_k_dense_replace": 0, "n_shared_experts": 2,
                    "rope_interleave": False, "num_hidden_layers": 2, "hidden_size": 48},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mtp_graph_matches_transformers_mtp_model(name, tmp_path):
    dims = dataclasses.replace(BASE.dims, **CONFIGS[name])
    spec = dataclasses.replace(BASE, dims=dims, pool=dataclasses.replace(BASE.pool, write="off"),
                               features=())
    L = dims.num_hidden_layers
    ckpt = write_random_hf_checkpoint(str(tmp_path / "ckpt"), "deepseek_v3", dataclasses.asdict(dims), seed=7,
                                      tokenizer=False, mtp_layers=1)
    main, mtp = _reference(ckpt, L)
    n = 11
    ids = torch.randint(0, dims.vocab_size, (1, n + 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h_ref = main(input_ids=ids[:, :n], output_hidden_states=True).hidden_states[-1]
        g_ref = mtp.forward_layer(0, h_ref, torch.arange(n)[None], None, input_ids=ids[:, 1:])
        logits_ref = mtp._project_to_logits(g_ref)[0]

    with open_engine(spec, load_hf_weights(ckpt, mtp_layers=1), spec_file="mtp.yaml") as eng:
        table = eng.alloc.alloc(4)
        x = ids[0].tolist()
        prefill, mtp_graph = eng.scheduler.variant_for("prefill", False), mtp_variant(spec)

        def run(variant, tokens, start, logits_positions, prev_hidden=None):  # one row through one graph
            row = RowPlan(None, tuple(tokens), start, tuple(table), logits_positions=tuple(logits_positions))
            return run_rows(eng.runner, variant, [row], prev_hidden=prev_hidden)

        _, h = run(prefill, x[:n], 0, (n - 1,))
        assert (h - h_ref[0]).abs().max().item() <= ATOL, "target hidden state"
        logits, g = run(mtp_graph, x[1:], 0, range(n), prev_hidden=h)
        assert (g - g_ref[0]).abs().max().item() <= ATOL, "MTP hidden state"
        err = (logits - logits_ref).abs().max().item()
        assert err <= ATOL, f"{name}: MTP logits max |diff| {err:.3g}"
        # in two pieces: rows 8.. attend to rows 0..7's MTP KV through the cache
        run(mtp_graph, x[1:9], 0, (7,), prev_hidden=h[:8])
        tail, _ = run(mtp_graph, x[9:], 8, range(n - 8), prev_hidden=h[8:])
        assert (tail - logits_ref[8:]).abs().max().item() <= ATOL
        # negative control: the MTP layer's KV of rows 0..7 zeroed -> the tail's logits differ
        for part in eng.cache[L]:
            part[table[0]].zero_()
        bad, _ = run(mtp_graph, x[9:], 8, range(n - 8), prev_hidden=h[8:])
        assert (bad - logits_ref[8:]).abs().max().item() > 1e-3
