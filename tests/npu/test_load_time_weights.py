"""Load-time weight layouts (audit 2 rows 10, 18): what `load_time_weights` builds from a generated
module's ``LOAD_TIME_WEIGHTS`` equals the concatenation / transposition of the checkpoint tensors, the
sources are gone, the float32 router weight and score bias are untouched, and the modules read the
built keys only (their forward runs on the result: tests/npu/test_npu_wiring.py compares it with the
CPU target on unmerged weights)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.npu.standin import fakes as standin

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


def _mod(spec_name: str, variant: str):
    from graphgen.npu.run.compile import load_module

    assert standin.install()
    return load_module(ROOT / "generated" / spec_name / "npu" / "max_autotune" / f"{variant}.py")


def test_qwen3_qkv_and_gate_up_are_merged_once_and_the_sources_dropped():
    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.weights import load_time_weights

    spec = load_spec(ROOT / "specs/tiny_qwen3_npu.yaml")
    mods = [_mod("tiny_qwen3_npu", v) for v in ("decode", "mempool_prefill")]
    W = random_weights(spec)
    out = load_time_weights(W, mods)
    p = "model.layers.1."
    qkv = next(v for k, v in out.items() if k.startswith("graphgen.load:") and f"{p}self_attn.q_proj" in k)
    assert torch.equal(qkv, torch.cat([W[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"]))
    gu = next(v for k, v in out.items() if k.startswith("graphgen.load:") and f"{p}mlp.gate_proj" in k)
    assert torch.equal(gu, torch.cat([W[f"{p}mlp.gate_proj.weight"], W[f"{p}mlp.up_proj.weight"]]))
    gone = {s for m in mods for r in m.LOAD_TIME_WEIGHTS.values() for s in r["cat"]}
    assert gone and not gone & set(out)  # each weight held once
    assert len([k for k in out if k.startswith("graphgen.load:")]) == 2 * spec.dims.num_hidden_layers
    for m in mods:  # no module reads a dropped source
        assert not any(f"W[{s!r}]" in Path(m.__file__).read_text() for s in gone)


def test_deepseek_experts_are_pre_transposed_and_the_router_stays_float32():
    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.weights import load_time_weights

    spec = load_spec(ROOT / "specs/tiny_deepseek_v3_npu.yaml")
    W = random_weights(spec)
    out = load_time_weights(W, [_mod("tiny_deepseek_v3_npu", "decode")])
    p = "model.layers.1.mlp."
    gate_up = out[f"graphgen.load:{p}experts.gate_proj.weight+{p}experts.up_proj.weight:cat1:t12"]
    down = out[f"graphgen.load:{p}experts.down_proj.weight:cat0:t12"]
    assert gate_up.is_contiguous() and down.is_contiguous()
    assert torch.equal(gate_up, torch.cat([W[f"{p}experts.gate_proj.weight"], W[f"{p}experts.up_proj.weight"]],
                                          dim=1).transpose(1, 2))
    assert torch.equal(down, W[f"{p}experts.down_proj.weight"].transpose(1, 2))
    for k in (f"{p}gate.weight", f"{p}gate.e_score_correction_bias"):
        assert out[k] is W[k] and out[k].dtype == torch.float32


def test_a_missing_source_names_the_recipe():
    from graphgen.npu.run.weights import load_time_weights

    with pytest.raises(KeyError, match="which the weights do not have"):
        load_time_weights({}, [_mod("tiny_qwen3_npu", "decode")])
