"""The NPU form of the LoRA delta (graphgen/lower/npu_helpers.py ``_linear`` of a LoRA-adapted weight), on the CPU stand-in.

What a pass proves: the dense-over-slots formulation computes what the CPU target's per-slot delta
(`graphgen.runtime.lora.delta.lora_delta`, itself checked against peft in test_lora_numerics.py) computes,
for a batch mixing base-model tokens, two adapters and a zero-padded rank; and its post-AOT graph (through
the stand-in torchair backend, torchair's decompositions) holds only ops with a real GE converter in the
pinned torch-npu wheel (graphgen/npu/check/ge_converters.json); and the NPU runner end to end on the stand-in
(slots, one-hot selections padded to the bucket) gives the CPU engine's logits with adapters batched. Not that
GE compiles it, nor NPU numerics: nothing here runs on an NPU (docs/lora.md, "NPU").
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


def _delta(helpers, x, sel, a, b):
    """The LoRA part of ``_linear`` of an adapted weight (its base product subtracted: a zero base weight)."""
    return helpers._linear(x, {"base": torch.zeros(b.shape[1], x.shape[1]), "sel": sel, "segs": ((0, (a, b)),)})


def test_dense_over_slots_equals_the_per_slot_delta(helpers):
    x, a, b = _stacks()
    index = torch.tensor([0, 2, 3, 0, 2, 4, 3])
    got = _delta(helpers, x, _sel(index), a, b)
    torch.testing.assert_close(got, lora_delta(x, index, a, b), rtol=1e-5, atol=1e-5)
    assert not got[0].any() and not got[3].any()  # base-model tokens: exact zeros
    # an all-zero selection row (a bucket's padding token) adds nothing either
    assert not _delta(helpers, x, torch.zeros(T, S), a, b).any()
    # negative control: another token's slot gives another delta, far outside the tolerance
    wrong = _delta(helpers, x, _sel(torch.tensor([0, 4, 3, 0, 2, 4, 3])), a, b)
    assert (wrong[1] - got[1]).abs().max() > 1.0


class _Delta(torch.nn.Module):
    def __init__(self, helpers):
        super().__init__()
        self.helpers = helpers

    def forward(self, x, w, sel, a, b):  # a merged weight of two projections, the second one adapted
        return self.helpers._linear(x, {"base": w, "sel": sel, "segs": ((OUT, (a, b)),)})


def test_post_aot_graph_has_only_ops_with_a_real_ge_converter(helpers):
    import torchair

    x, a, b = _stacks()
    torch._dynamo.reset()
    cfg = torchair.CompilerConfig()
    cfg.mode = "max-autotune"
    backend = torchair.get_npu_backend(compiler_config=cfg)
    with torch.no_grad(), standin.enforce_limits(False):
        w = torch.randn(2 * OUT, IN)
        out = torch.compile(_Delta(helpers), backend=backend, fullgraph=True)(x, w, _sel(torch.arange(T) % S), a, b)
    want = x @ w.t()
    want[:, OUT:] += lora_delta(x, torch.arange(T) % S, a, b)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    (cg,) = backend.graphs
    ops, calls = geops.captured_targets(cg)
    assert any(op.startswith("aten.mm") for op in ops), ops  # the shrink and expand products were traced
    assert geops.check_targets(ops, calls, where="_linear of a LoRA weight") == []
    # negative control: the CPU target's sgmv selects each slot's rows with nonzero, whose converter only raises
    assert any("only raises" in p for p in geops.check_targets(["aten.nonzero.default"], [], where="sgmv"))


NPU_TOL = 0.25  # tests/npu/test_npu_runner.py's: bf16 on the NPU side, float32 on the CPU side, logits O(4)


def _random_adapter(spec, name: str, r: int, seed: int):
    from graphgen.lora import lora_weight_keys
    from graphgen.runtime.lora import Adapter

    g = torch.Generator().manual_seed(seed)
    w = {k: (torch.randn(r, i, generator=g) * i ** -0.5, torch.randn(o, r, generator=g) * r ** -0.5)
         for k, (o, i) in lora_weight_keys(spec).items()}
    return Adapter(name, name, r, float(r), False, digest=f"{seed:064x}", weights=w)


def test_npu_engine_on_the_standin_matches_the_cpu_engine_with_adapters_batched():
    """The NPU runner end to end on the stand-in (hardware-shaped tiny Qwen3, bf16): two adapters and a base
    request in one batch give the CPU engine's logits (the CPU delta is peft's: test_lora_numerics.py) within
    the NPU runner test's tolerance; the adapters move the logits far beyond it (negative control)."""
    import dataclasses

    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.engine import npu_engine
    from graphgen.runtime import open_engine
    from support.paths import REPO

    spec = load_spec(REPO / "tests/npu/data/hw_tiny_qwen3_lora.yaml")
    W = random_weights(spec, seed=1, scale=0.1)
    a, b = _random_adapter(spec, "a", 4, 1), _random_adapter(spec, "b", 8, 2)
    prompts = [list(range(3, 40)), list(range(5, 30)), list(range(7, 50))]
    loras = [a, None, b]
    cpu_spec = dataclasses.replace(spec, kv_cache=dataclasses.replace(spec.kv_cache, dtype="float32"))
    try:
        with open_engine(cpu_spec, dict(W), collect_logits=True, num_blocks=16) as e:
            cpu = e.generate(prompts, 3, batch=True, lora=loras)
            base = e.generate(prompts[:1], 3)
        with npu_engine(spec, dict(W), collect_logits=True, num_blocks=16, standin=True) as e:
            npu = e.generate(prompts, 3, batch=True, lora=loras)
            assert e.runner.lora_slots.loads == 2  # both adapters went into slots of the NPU runner
            graphs = [(v, cg) for v, be in e.runner.backends.items() for cg in getattr(be, "graphs", ())]
    finally:
        standin.uninstall()
    # every graph the LoRA modules compiled to holds only ops with a real GE converter in the pinned wheel
    assert {v for v, _ in graphs} >= {"mempool_prefill", "decode"}, graphs
    for v, cg in graphs:
        assert geops.check_targets(*geops.captured_targets(cg), where=f"hw_tiny_qwen3_lora {v}") == []
    for c, n, name in zip(cpu, npu, ("a", None, "b")):
        c0, n0 = c.step_logits[0].reshape(-1).float(), n.step_logits[0].reshape(-1).float()
        err = (c0 - n0).abs().max().item()
        assert err <= NPU_TOL, f"adapter {name}: first-token logits differ by {err:.3g} > {NPU_TOL}"
    assert (cpu[0].step_logits[0].reshape(-1) - base[0].step_logits[0].reshape(-1)).abs().max() > 4 * NPU_TOL
