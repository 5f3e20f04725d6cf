"""import_hf: Hugging Face config.json -> spec, with transformers-written configs and bad ones."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest

from graphgen.modelspec import model as m
from graphgen.modelspec.errors import SpecError
from graphgen.modelspec.import_hf import import_hf, spec_from_hf_config
from graphgen.modelspec.loader import load_spec, parse_spec_text
from support.paths import REPO

import transformers


def _tiny_qwen3_config(**over):
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=40960,
              tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    kw.update(over)
    return transformers.Qwen3Config(**kw)


def _tiny_ds_config(**over):
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
              first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_interleave=True,
              max_position_embeddings=163840)
    kw.update(over)
    return transformers.DeepseekV3Config(**kw)


def _save(cfg, path: Path, dtype=None) -> Path:
    cfg.save_pretrained(path)
    if dtype is not None:  # what save_pretrained writes for a model loaded in that dtype
        data = json.loads((path / "config.json").read_text())
        data["dtype"] = dtype
        (path / "config.json").write_text(json.dumps(data, indent=2))
    return path


def test_qwen3_matches_tiny_spec(tmp_path):
    hf = _save(_tiny_qwen3_config(), tmp_path / "tiny_qwen3", dtype="float32")
    out = tmp_path / "out" / "tiny_qwen3.yaml"
    spec = import_hf(hf, out)
    shipped = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    assert spec.name == "tiny_qwen3" and spec.family == "qwen3_dense"
    assert spec.dims == shipped.dims
    assert spec.kv_cache.dtype == "float32"
    assert set(spec.variants) == {"decode", "mempool_prefill", "splitfuse"}
    assert spec.pool.write == "async" and spec.features == ("prefix_cache",)
    assert spec.targets.cpu == m.CpuTarget() and spec.targets.npu is not None
    assert load_spec(out) == spec  # the written file parses back equal


def test_deepseek_matches_tiny_spec_and_notes_mtp(tmp_path):
    hf = _save(_tiny_ds_config(num_nextn_predict_layers=1), tmp_path / "ds", dtype="bfloat16")
    out = tmp_path / "ds.yaml"
    spec = import_hf(hf, out, name="tiny_ds")
    assert spec.dims == load_spec(REPO / "specs" / "tiny_deepseek_v3.yaml").dims
    assert spec.kv_cache.dtype == "bfloat16"
    text = out.read_text()
    assert "num_nextn_predict_layers: 1" in text and "no weights to check: no mtp: section" in text
    assert "mtp" not in spec.features and spec.mtp is None
    assert parse_spec_text(text) == spec


def test_deepseek_yarn_from_rope_parameters(tmp_path):
    yarn = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf = _save(_tiny_ds_config(rope_scaling=yarn), tmp_path / "ds_yarn")
    spec = import_hf(hf, tmp_path / "o.yaml", name="ds_yarn")
    assert spec.dims.rope_scaling == m.RopeScaling(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                                   beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert spec.kv_cache.dtype == "float32"  # the config names no dtype


# The published configs (transformers 4 layout), transcribed from the Hugging Face repos; the
# shipped specs must be exactly their import.
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "intermediate_size": 25600, "max_position_embeddings": 40960,
    "max_window_layers": 64, "model_type": "qwen3", "num_attention_heads": 64, "num_hidden_layers": 64,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
DEEPSEEK_V3_1 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280,
}


# DeepSeek-V3.1's quantization_config as published (its config.json: FP8 weights, 128x128 block scales)
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_the_published_fp8_config_imports_with_its_quantization_recorded(tmp_path):
    from graphgen.modelspec.dump import dump_spec_yaml

    spec = spec_from_hf_config(dict(DEEPSEEK_V3_1, quantization_config=FP8), "ds")
    assert spec.quantization == m.Quantization(method="none", checkpoint=m.Fp8Checkpoint(weight_block_size=(128, 128)))
    assert spec.dims == spec_from_hf_config(DEEPSEEK_V3_1, "ds").dims
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(DEEPSEEK_V3_1, quantization_config=FP8)))
    out = import_hf(hf, tmp_path / "ds.yaml", "ds", quantization="w8a8_dynamic")
    text = (tmp_path / "ds.yaml").read_text()
    assert "quant_method: fp8" in text and "weight_block_size: [128, 128]" in text and "w8a8_dynamic" in text
    assert load_spec(tmp_path / "ds.yaml") == out and out.quantization.method == "w8a8_dynamic"
    # an unquantized import writes no quantization section at all
    assert "quantization" not in dump_spec_yaml(spec_from_hf_config(DEEPSEEK_V3_1, "d"))


@pytest.mark.parametrize("config,shipped", [(QWEN3_32B, "qwen3_32b"), (dict(DEEPSEEK_V3_1, quantization_config=FP8),
                                                                        "deepseek_v3_1")])
def test_published_configs_give_shipped_specs(config, shipped):
    spec = spec_from_hf_config(config, shipped)
    want = load_spec(REPO / "specs" / f"{shipped}.yaml")
    assert spec.dims == want.dims
    assert spec.kv_cache == want.kv_cache and spec.pool == want.pool
    # the deployment layout (parallel, device memory) is not in a Hugging Face config: the shipped
    # specs add it by hand
    targets = dataclasses.replace(want.targets, npu=dataclasses.replace(want.targets.npu, device_memory_gib=None))
    assert spec.variants == want.variants and spec.features == want.features and spec.targets == targets
    assert spec.quantization.checkpoint == want.quantization.checkpoint  # the published FP8 checkpoint


def test_q_lora_null_imports_as_uncompressed_queries(tmp_path):
    """DeepSeek-V2-Lite style: q_lora_rank null is kept as null (not a default rank), and the
    written YAML parses back to the same spec (numerics: tests/families/test_family_gaps.py)."""
    hf = tmp_path / "lite"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(DEEPSEEK_V3_1, q_lora_rank=None), indent=2))
    spec = import_hf(hf, tmp_path / "lite.yaml")
    assert spec.dims.q_lora_rank is None
    assert "q_lora_rank: null" in (tmp_path / "lite.yaml").read_text()
    assert load_spec(tmp_path / "lite.yaml") == spec


def test_written_spec_inside_repo_has_schema_line(tmp_path):
    # The schema comment is a path relative to the written file, so only specs under the checkout get one.
    hf = _save(_tiny_qwen3_config(), tmp_path / "q")
    outside = tmp_path / "q.yaml"
    import_hf(hf, outside)
    assert "$schema" not in outside.read_text()


def test_default_name_is_sanitised(tmp_path):
    hf = _save(_tiny_qwen3_config(), tmp_path / "Qwen3-0.6B")
    assert import_hf(hf, tmp_path / "o.yaml").name == "qwen3_0_6b"


# ---------------------------------------------------------------- unsupported configs

def _bad(tmp_path, config: dict) -> SpecError:
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config, indent=2))
    with pytest.raises(SpecError) as info:
        import_hf(d, tmp_path / "out.yaml", name="x")
    assert not (tmp_path / "out.yaml").exists()
    return info.value


def _line(tmp_path, key: str) -> int:
    lines = (tmp_path / "hf" / "config.json").read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if line.lstrip().startswith(f'"{key}"'))


BAD = [
    ("other_model_type", dict(QWEN3_32B, model_type="llama"), "model_type", "'llama' is not supported", "qwen3 or deepseek_v3"),
    ("missing_field", {k: v for k, v in QWEN3_32B.items() if k != "hidden_size"}, None,
     "hidden_size: missing", 'add "hidden_size"'),
    ("qwen3_rope_scaling", dict(QWEN3_32B, rope_scaling={"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}),
     "rope_scaling", "Qwen3 with RoPE scaling (yarn) is not implemented", "without rope scaling"),
    ("topk_method", dict(DEEPSEEK_V3_1, topk_method="greedy"), "topk_method", "'greedy' is not implemented",
     '"topk_method": "noaux_tc"'),
    ("scoring_func", dict(DEEPSEEK_V3_1, scoring_func="softmax"), "scoring_func", "'softmax' is not implemented",
     '"scoring_func": "sigmoid"'),
    ("quantized_gptq", dict(DEEPSEEK_V3_1, quantization_config={"quant_method": "gptq", "bits": 4}),
     "quantization_config", "quant_method 'gptq' is not supported: graphgen reads fp8 checkpoints only",
     "use the fp8 checkpoint"),
    ("fp8_e5m2", dict(DEEPSEEK_V3_1, quantization_config=dict(FP8, fmt="e5m2")), "quantization_config",
     "fmt 'e5m2' is not supported: graphgen reads fp8 checkpoints only (quant_method fp8, fmt e4m3", "as published"),
    ("fp8_no_block", dict(DEEPSEEK_V3_1, quantization_config={"quant_method": "fp8"}), "quantization_config",
     "weight_block_size None is not supported", "as published"),
    ("wrong_type", dict(QWEN3_32B, num_attention_heads="64"), "num_attention_heads", "expected an integer, got '64'",
     "write an integer (unquoted JSON)"),
    ("kv_heads", dict(QWEN3_32B, num_key_value_heads=7), "num_key_value_heads",
     "num_key_value_heads (7) must divide num_attention_heads (64)", "pick a divisor"),
    ("rope_kind", dict(DEEPSEEK_V3_1, rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling",
     "RoPE scaling type 'linear' is not implemented", "use yarn"),
    ("yarn_missing", dict(DEEPSEEK_V3_1, rope_scaling={"type": "yarn", "factor": 40}), "rope_scaling",
     "YaRN needs 'original_max_position_embeddings'", 'add "original_max_position_embeddings"'),
    ("sliding", dict(QWEN3_32B, use_sliding_window=True), "use_sliding_window", "True is not implemented",
     '"use_sliding_window": false'),
    ("dtype", dict(QWEN3_32B, torch_dtype="float8_e4m3fn"), "torch_dtype", "'float8_e4m3fn' has no KV-cache dtype",
     "float32, bfloat16, float16"),
]


@pytest.mark.parametrize("case,config,field,message,fix", BAD, ids=[b[0] for b in BAD])
def test_unsupported_config(tmp_path, case, config, field, message, fix):
    err = _bad(tmp_path, config)
    source = str(tmp_path / "hf" / "config.json")
    hits = [d for d in err.diagnostics if message in d.message]
    assert hits, str(err)
    d = hits[0]
    assert d.file == source and fix in d.fix
    if field is not None:  # the field is in the file: the error points at its line
        assert d.message.startswith(f"{field}: ") and d.line == _line(tmp_path, field)


def test_all_config_problems_reported_together(tmp_path):
    err = _bad(tmp_path, dict(DEEPSEEK_V3_1, scoring_func="softmax", hidden_act="gelu", kv_lora_rank="512"))
    fields = {d.message.split(":")[0] for d in err.diagnostics}
    assert {"scoring_func", "hidden_act", "kv_lora_rank"} <= fields


def test_invalid_json_and_missing_file(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{\n  "model_type": "qwen3",\n  oops\n}\n')
    with pytest.raises(SpecError, match=r"config\.json:3:\d+: error: invalid JSON"):
        import_hf(d, tmp_path / "o.yaml")
    with pytest.raises(SpecError, match=r"nowhere/config\.json:1:1: error: cannot read config"):
        import_hf(tmp_path / "nowhere", tmp_path / "o.yaml")


def test_bad_name(tmp_path):
    with pytest.raises(SpecError, match="not a Python identifier"):
        spec_from_hf_config(QWEN3_32B, "x; import os")
