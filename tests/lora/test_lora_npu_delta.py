"""The NPU form of the LoRA delta (graphgen/lower/npu_helpers.py ``_lora_delta``), on the CPU stand-in.

What a pass proves: the dense-over-slots formulation computes what the CPU target's per-slot delta
(`graphgen.runtime.lora.delta.lora_delta`, itself checked against peft in test_lora_numerics.py) computes,
for a batch mixing base-model tokens, two adapters and a zero-padded rank; and its post-AOT graph (through
the stand-in torchair backend, torchair's decompositions) holds only ops with a real GE converter in the
pinned torch-npu wheel (graphgen/npu/check/ge_converters.json). Not that GE compiles it, nor NPU numerics:
nothing here runs on an NPU, and no generated module calls the helper yet (docs/lora.md, "NPU").
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from graphgen.npu.check import geops
from graphgen.npu.standin import fakes as standin
from graphgen.runtime.lora.delta import lora_delta

pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")

S, R, IN, OUT, T = 5, 8, 24, 40, 7  # slots (0: the base model), rank, projection dims, tokens


@pytest.fixture(scope="module")
def helpers():
    assert standin.install()
    sys.modules.pop("graphgen.lower.npu_helpers", None)  # its torch_npu import must bind the stand-in
    try:
        yield importlib.import_module("graphgen.lower.npu_helpers")
    finally:  # the fake torch_npu/torchair must not leak into other tests (transformers probes find_spec)
        sys.modules.pop("graphgen.lower.npu_helpers", None)
        standin.uninstall()


def _stacks():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(S, R, IN, generator=g), torch.randn(S, OUT, R, generator=g)
    a[0], b[0] = 0, 0  # slot 0 stays zero (graphgen.runtime.lora.slots)
    a[3, 4:], b[3, :, 4:] = 0, 0  # a rank-4 adapter in rank-8 slots: zero-padded
    return torch.randn(T, IN, generator=g), a, b


def _sel(index: torch.Tensor) -> torch.Tensor:
    return (index.unsqueeze(1) == torch.arange(S)).to(torch.float32)


def test_dense_over_slots_equals_the_per_slot_delta(helpers):
    x, a, b = _stacks()
    index = torch.tensor([0, 2, 3, 0, 2, 4, 3])
    got = helpers._lora_delta(x, _sel(index), a, b)
    torch.testing.assert_close(got, lora_delta(x, index, a, b), rtol=1e-5, atol=1e-5)
    assert not got[0].any() and not got[3].any()  # base-model tokens: exact zeros
    # an all-zero selection row (a bucket's padding token) adds nothing either
    assert not helpers._lora_delta(x, torch.zeros(T, S), a, b).any()
    # negative control: another token's slot gives another delta, far outside the tolerance
    wrong = helpers._lora_delta(x, _sel(torch.tensor([0, 4, 3, 0, 2, 4, 3])), a, b)
    assert (wrong[1] - got[1]).abs().max() > 1.0


class _Delta(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, sel, a, b):
        return self.fn(x, sel, a, b)


def test_post_aot_graph_has_only_ops_with_a_real_ge_converter(helpers):
    import torchair

    x, a, b = _stacks()
    torch._dynamo.reset()
    cfg = torchair.CompilerConfig()
    cfg.mode = "max-autotune"
    backend = torchair.get_npu_backend(compiler_config=cfg)
    with torch.no_grad(), standin.enforce_limits(False):
        out = torch.compile(_Delta(helpers._lora_delta), backend=backend, fullgraph=True)(x, _sel(torch.arange(T) % S), a, b)
    torch.testing.assert_close(out, lora_delta(x, torch.arange(T) % S, a, b), rtol=1e-5, atol=1e-5)
    (cg,) = backend.graphs
    ops, calls = geops.captured_targets(cg)
    assert any(op.startswith("aten.mm") for op in ops), ops  # the shrink and expand products were traced
    assert geops.check_targets(ops, calls, where="_lora_delta") == []
    # negative control: the CPU target's sgmv selects each slot's rows with nonzero, whose converter only raises
    assert any("only raises" in p for p in geops.check_targets(["aten.nonzero.default"], [], where="sgmv"))
