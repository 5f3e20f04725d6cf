"""Bad adapters each get one clear sentence naming the module and the fix (issue 40): a rank over max_lora_rank,
a target module the model lacks, one the spec's lora.targets leave out, a shape mismatch, a missing file, and
peft's LoRA on MoE experts' parameters."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from graphgen.modelspec.loader import load_spec
from graphgen.modelspec.model import Lora
from graphgen.runtime.lora import AdapterError, read_adapter
from support.hf import build_hf_model
from support.lora import SPECS, hf_dims, write_adapter



@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    spec = load_spec(SPECS["qwen3_dense"])
    tmp = tmp_path_factory.mktemp("bad_lora")
    base, _ = build_hf_model("qwen3_dense", hf_dims(spec), str(tmp / "base"), seed=0)
    write_adapter(base, tmp / "good", ["q_proj", "v_proj"], 4, 8, False, seed=0)
    write_adapter(base, tmp / "r16", ["q_proj"], 16, 16, False, seed=0)
    return spec, base, tmp


def _copy(tmp: Path, name: str) -> Path:
    out = tmp / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tmp / "good", out)
    return out


def _refusal(path, spec) -> str:
    with pytest.raises(AdapterError) as info:
        read_adapter(path, spec)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"LoRA adapter {path}: "), msg
    return msg


def test_a_good_adapter_reads(qwen):
    spec, _, tmp = qwen
    a = read_adapter(tmp / "good", spec)
    assert a.rank == 4 and a.scaling == 2.0 and len(a.weights) == 2 * 2 and len(a.digest) == 64
    # the identity is the weights, not the name or the folder: a renamed copy has the same digest
    assert read_adapter(_copy(tmp, "renamed"), spec, name="other").digest == a.digest


def test_rank_over_max_lora_rank(qwen):
    spec, _, tmp = qwen
    msg = _refusal(tmp / "r16", spec)
    assert "rank r=16 exceeds lora.max_lora_rank 8" in msg and "--max-lora-rank" in msg


def test_target_module_the_model_lacks(qwen):
    spec, _, tmp = qwen
    path = _copy(tmp, "foo")
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "foo_proj"]
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    assert "target module 'foo_proj' is not a module of tiny_qwen3_lora" in _refusal(path, spec)


def test_target_the_spec_leaves_out(qwen):
    spec, _, tmp = qwen
    only_q = dataclasses.replace(spec, lora=Lora(max_loras=2, max_lora_rank=8, targets=("q_proj",)))
    msg = _refusal(tmp / "good", only_q)
    assert "targets model.layers.0.self_attn.v_proj, which the spec's lora.targets leave out" in msg


def test_shape_mismatch(qwen):
    spec, _, tmp = qwen
    path = _copy(tmp, "shape")
    w = load_file(str(path / "adapter_model.safetensors"))
    k = next(k for k in w if "layers.1.self_attn.v_proj.lora_B" in k)
    w[k] = w[k][:-2].contiguous()  # 30 output rows for a 32-row v_proj
    save_file(w, str(path / "adapter_model.safetensors"))
    msg = _refusal(path, spec)
    assert "module model.layers.1.self_attn.v_proj has lora_A (4, 64) and lora_B (30, 4)" in msg and "[32, 4]" in msg


@pytest.mark.parametrize("missing", ["adapter_model.safetensors", "adapter_config.json"])
def test_missing_file(qwen, missing):
    spec, _, tmp = qwen
    path = _copy(tmp, f"no_{missing.split('.')[0]}")
    (path / missing).unlink()
    assert f"{missing} is missing" in _refusal(path, spec)
    assert "no such folder" in _refusal(tmp / "nowhere", spec)


def test_peft_lora_on_moe_experts_is_refused(tmp_path):
    spec = load_spec(SPECS["deepseek_v3"])
    base, _ = build_hf_model("deepseek_v3", hf_dims(spec), str(tmp_path / "base"), seed=0)
    write_adapter(base, tmp_path / "experts", ["q_b_proj", "gate_proj", "up_proj", "down_proj"], 4, 8, False, seed=0)
    assert "LoRA on parameters (target_parameters" in _refusal(tmp_path / "experts", spec)


def test_the_engine_refuses_a_bad_adapter_before_it_starts(qwen):
    from graphgen.runtime import open_engine

    spec, _, tmp = qwen
    with pytest.raises(AdapterError, match="exceeds lora.max_lora_rank"):
        open_engine(SPECS["qwen3_dense"], str(tmp / "base"), lora_modules={"big": str(tmp / "r16")})
