"""The NPU graphs' activations in the per-rank figure (issue 36 item 3, audit 4 M5): modelled from the shapes a
bucket fixes (graphgen.passes.activations), counted by validate, held by the dry run."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from graphgen.modelspec.loader import load_spec
from graphgen.passes.activations import gather_rows, graph_activations, peak_activation

SPECS = Path(__file__).resolve().parents[2] / "specs"


def test_the_2node_deepseek_peak_is_its_prefill_moe_over_65536_routed_rows_and_dp_warms_no_cell():
    spec = load_spec(SPECS / "deepseek_v3_1_2node.yaml")
    acts = graph_activations(spec)
    peak = peak_activation(spec)
    assert peak.graph == "mempool_prefill tokens=1024" and peak.largest == "MoE over 65536 routed rows"  # 8 x 1024 x 8
    # by liveness: GMM2's output, finalize's zeros_like and the where, 3 x [R, H] bf16, outgrow every other step
    # (expanded_x + its int8 copy 3 bytes per element of [R, H]; GMM1's [R, 2 I] with the activation [R, I] ...)
    R, H, I = 65536, 7168, 2048
    assert peak.bytes - 3 * 1024 * H * 2 == R * 3 * H * 2 > R * (2 * I * 2 + I * 3)
    assert not any("mixed" in a.graph for a in acts)  # DP runs no mixed cell (warmup.runs_mixed_cells)
    single = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, dp=1, ep=2))
    cells = [a for a in graph_activations(single) if "mixed" in a.graph]
    assert cells and len(graph_activations(single)) == len(acts) + len(cells)  # the control: cells counted
    # without DP the MoE routes one group's rows: a mixed cell's history up-projection can then be the peak
    assert max(a.bytes for a in cells) > max(a.bytes for a in graph_activations(single) if "mixed" not in a.graph
                                             and a.graph.startswith("splitfuse")) > 0


def test_the_gather_rows_restated_torch_free_equal_the_runners():
    from graphgen.npu.run.bucketing import Buckets

    spec = load_spec(SPECS / "qwen3_32b.yaml")
    b = Buckets.from_spec(spec)
    for t in b.prefill_tokens:
        pad = b.padding("prefill", b.prefill_seqs, t // 2)
        assert pad.gather_rows(spec.kv_cache.block_size) == gather_rows(pad.batch, pad.tokens, pad.max_blocks,
                                                                       spec.kv_cache.block_size)

