"""W8A8 (dynamic) on the NPU target, on the CPU stand-in (issue 28 item 2) -- a WIRING CHECK, not an NPU result.

A spec's ``quantization: {method: w8a8_dynamic}``: linear weights int8 with one scale per output channel
(quantized at load), activations quantized per token in the graph (``npu_dynamic_quant``), products through
``npu_quant_matmul`` and, for the experts, ``npu_grouped_matmul`` with per-token scales.

* the hardware-shaped tiny Qwen3 and DeepSeek-V3 run through the NPU runner (the stand-in's kernels, written
  from the torch-npu docs, `graphgen.npu.standin.quant`) and through the CPU target (its own int8 emulation,
  `graphgen.runtime.core.quant`) at the NPU's dtype (bfloat16: the same weights quantize to the same int8
  values and bf16 scales on both), with logits within TOL and equal greedy tokens up to a near tie at TOL
  (`support.tokens.assert_agree`: which side of a bf16 tie wins is the CPU's bf16 kernels' choice);
* every graph the runner compiled passes the GE converter check (graphgen/npu/check/geops.py, no allow-list)
  and holds the quantized ops; each call passed the limits rows (the stand-in enforces them: quant.*, gmm.*);
* the kernels' per-call arithmetic equals the CPU emulation (both our reading of the same docs: wiring), and
  a miswired scale shows. The limits rows' own cases (quant.*, gmm.*): tests/npu/test_limits.py.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from graphgen.modelspec import model as m
from graphgen.modelspec.loader import load_spec
from graphgen.npu.check import geops
from graphgen.npu.standin import fakes as standin
from support.tokens import assert_agree

pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
SPECS = {"qwen3": Path(__file__).parent / "data/hw_tiny_qwen3.yaml",
         "deepseek_v3": Path(__file__).parents[2] / "specs/tiny_deepseek_v3_npu.yaml"}
PROMPTS = [list(range(3, 40)), list(range(5, 20)), list(range(40, 61))]
TOL = 0.4  # logits are O(5); bf16 rounds activations differently on the two sides, which moves int8 levels
QUANT_OPS = {"npu.npu_dynamic_quant.default", "npu.npu_quant_matmul.default"}


def _w8a8(path):
    spec = load_spec(path)
    return dataclasses.replace(spec, quantization=m.Quantization(method="w8a8_dynamic"))


@pytest.fixture(scope="module", params=sorted(SPECS))
def runs(request):
    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.engine import npu_engine
    from graphgen.runtime import open_engine

    torch.set_num_threads(1)
    spec = _w8a8(SPECS[request.param])
    W = random_weights(spec, seed=1, scale=0.1)
    with open_engine(spec, dict(W), collect_logits=True, num_blocks=64) as e:  # the CPU target, bf16
        cpu = e.generate(PROMPTS, 4)
    with npu_engine(spec, dict(W), collect_logits=True, num_blocks=64, standin=True) as e:
        npu = e.generate(PROMPTS, 4)
        graphs = [g for b in e.runner.backends.values() for g in b.graphs]
    plain = dataclasses.replace(spec, quantization=m.Quantization())
    with open_engine(plain, dict(W), collect_logits=True, num_blocks=64) as e:
        unquantized = e.generate(PROMPTS, 4)
    return request.param, cpu, npu, graphs, unquantized


@pytest.mark.slow  # W8A8 compiled through the stand-in for both families (`runs`)
def test_w8a8_npu_standin_gives_the_cpu_targets_tokens(runs):
    family, cpu, npu, _, unquantized = runs
    compared = 0
    for i, (c, n, u) in enumerate(zip(cpu, npu, unquantized)):
        # tokens up to a near tie at TOL, logits within TOL (tests/support/tokens.py: random weights tie)
        compared += assert_agree(c.tokens, c.step_logits, n.tokens, n.step_logits, TOL,
                                 where=f"{family} prompt {i}").steps
        # not vacuous: the int8 products move the logits (against the same weights unquantized)
        moved = max((a.float() - b.float()).abs().max().item() for a, b in zip(c.step_logits, u.step_logits))
        assert moved > 0.01, (family, moved)
    assert compared >= len(PROMPTS) + 2, (family, compared)  # most steps compared, not only each first one


@pytest.mark.slow  # the same stand-in compiles (`runs`)
def test_w8a8_graphs_pass_the_ge_converter_check_with_the_quantized_ops(runs):
    family, _, _, graphs, _ = runs
    assert graphs
    seen = set()
    for g in graphs:
        ops, calls = geops.captured_targets(g)
        assert geops.check_targets(ops, calls, where=f"{family} w8a8") == []
        seen |= set(ops)
    assert QUANT_OPS <= seen
    table = geops.load_table()["converters"]
    for op in QUANT_OPS | {"npu.npu_grouped_matmul.default"}:
        assert table[op]["kind"] == "real" and table[op]["sources"][0].startswith("air/_ge_concrete_graph/ge_converter/custom/")
    if family == "deepseek_v3":  # the experts through the grouped matmul's per-token form
        assert "npu.npu_grouped_matmul.default" in seen


@pytest.fixture(scope="module")
def kernels():
    standin.install()
    yield torch.ops.npu


def test_quant_matmul_kernels_equal_the_cpu_emulation_and_a_miswired_scale_shows(kernels):
    from graphgen.runtime.core.quant import quantize_rows, w8a8_matmul, Int8Weight

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g).bfloat16()
    x[3] = 0  # a padding row: zeros, scale 0
    w = torch.randn(48, 64, generator=g)
    q, s = quantize_rows(w, torch.bfloat16)
    xq, xs = kernels.npu_dynamic_quant(x)
    got = kernels.npu_quant_matmul(xq, q.t().contiguous(), s, pertoken_scale=xs, output_dtype=torch.bfloat16)
    want = w8a8_matmul(x, Int8Weight(q.t().contiguous(), s), transposed=True)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(got[3], torch.zeros(48, dtype=torch.bfloat16))
    assert (want.float() - x.float() @ w.t()).abs().max() < 0.05 * (x.float() @ w.t()).abs().max()
    bad = kernels.npu_quant_matmul(xq, q.t().contiguous(), s.flip(0), pertoken_scale=xs, output_dtype=torch.bfloat16)
    assert (bad.float() - want.float()).abs().max() > 0.1


def test_grouped_matmul_per_token_equals_the_cpu_emulation_per_expert(kernels):
    from graphgen.runtime.core.quant import Int8Weight, quantize_rows, w8a8_matmul

    g = torch.Generator().manual_seed(1)
    e, k, n = 3, 32, 16
    rows = torch.randn(7, k, generator=g).bfloat16()
    w = torch.randn(e, n, k, generator=g)  # checkpoint layout [E, out, in]
    q, s = quantize_rows(w, torch.bfloat16)
    ends = torch.tensor([2, 2, 6], dtype=torch.int64)  # expert 1 has no rows; row 6 is past the groups
    xq, xs = kernels.npu_dynamic_quant(rows)
    (got,) = kernels.npu_grouped_matmul([xq], [q.transpose(1, 2).contiguous()], scale=[s], per_token_scale=[xs],
                                        group_list=ends, group_list_type=0, group_type=0, split_item=2,
                                        output_dtype=torch.bfloat16)
    for lo, hi, ex in ((0, 2, 0), (2, 6, 2)):
        want = w8a8_matmul(rows[lo:hi], Int8Weight(q[ex], s[ex]), transposed=False)
        assert torch.equal(got[lo:hi], want), ex
    assert torch.isnan(got[6]).all()  # undefined past the last group
