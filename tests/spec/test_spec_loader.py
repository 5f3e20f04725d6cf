"""Loader behaviour beyond single malformed files: shipped specs, YAML reading, dumping."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from graphgen.modelspec import model as m
from graphgen.modelspec.compat import MATRIX, check_compat
from graphgen.modelspec.errors import SpecError
from graphgen.modelspec.loader import dump_spec, dump_spec_yaml, load_spec, load_specs, load_yaml_data, parse_spec_text
from support.paths import REPO

SHIPPED = sorted((REPO / "specs").glob("*.yaml"))


def test_shipped_specs_exist():
    names = {p.stem for p in SHIPPED}
    assert {"tiny_qwen3", "tiny_deepseek_v3", "qwen3_32b", "deepseek_v3_1"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_spec_loads_and_round_trips(path):
    spec = load_spec(path)
    assert spec.name == path.stem  # file name and model name agree (generated/<name>/)
    assert list(check_compat(spec)) == []
    text = dump_spec_yaml(spec)
    assert parse_spec_text(text, "dump.yaml") == spec
    # The dump is plain YAML for any reader, including PyYAML's YAML 1.1 safe_load.
    assert yaml.safe_load(text) == dump_spec(spec)
    assert path.read_text().splitlines()[0] == "# yaml-language-server: $schema=schema.json"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_spec_standard_variants(path):
    spec = load_spec(path)
    v = spec.variants
    assert v["decode"].phase == "decode"
    assert (v["mempool_prefill"].phase, v["mempool_prefill"].history) == ("prefill", False)
    assert (v["splitfuse"].phase, v["splitfuse"].history) == ("prefill", True)
    assert spec.pool.write == "async" and "prefix_cache" in spec.features
    assert spec.targets.cpu is not None
    # a spec declaring the NPU target is inside the kernels' dtype limits (the float32 tiny specs are not,
    # so they target the CPU only)
    if spec.targets.npu is not None:
        assert spec.kv_cache.dtype in ("bfloat16", "float16")
    assert spec.variant_saves(v["mempool_prefill"]) and not spec.variant_saves(v["decode"])


def test_published_sizes():
    q = load_spec(REPO / "specs" / "qwen3_32b.yaml").dims
    assert (q.num_hidden_layers, q.hidden_size, q.num_attention_heads, q.num_key_value_heads, q.head_dim,
            q.intermediate_size, q.vocab_size, q.rope_theta, q.rms_norm_eps) == (
        64, 5120, 64, 8, 128, 25600, 151936, 1e6, 1e-6)
    ds = load_spec(REPO / "specs" / "deepseek_v3_1.yaml")
    d = ds.dims
    assert (d.num_hidden_layers, d.first_k_dense_replace, d.hidden_size, d.num_attention_heads, d.q_lora_rank,
            d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.intermediate_size,
            d.moe_intermediate_size, d.n_routed_experts, d.num_experts_per_tok, d.n_shared_experts, d.n_group,
            d.topk_group, d.routed_scaling_factor, d.vocab_size, d.rope_theta) == (
        61, 3, 7168, 128, 1536, 512, 128, 64, 128, 18432, 2048, 256, 8, 1, 8, 4, 2.5, 129280, 10000.0)
    assert d.rope_scaling == m.RopeScaling(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                                           beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    assert "mtp" not in ds.features
    assert "MTP is not implemented yet" in (REPO / "specs" / "deepseek_v3_1.yaml").read_text()
    for spec in (load_spec(REPO / "specs" / "qwen3_32b.yaml"), ds):
        assert (spec.kv_cache.block_size, spec.kv_cache.dtype) == (128, "bfloat16")
        assert spec.targets.npu.compile_modes == ("max-autotune",)


def test_load_specs_all_shipped():
    assert [s.name for s in load_specs(SHIPPED)] == [p.stem for p in SHIPPED]


def test_yaml_12_scalars():
    data = load_yaml_data("a: off\nb: yes\nc: 1e6\nd: 0o17\ne: ~\nf: 2024-01-01\ng: 012\nh: .inf\n")
    assert data == {"a": "off", "b": "yes", "c": 1e6, "d": 15, "e": None, "f": "2024-01-01", "g": 12,
                    "h": float("inf")}


def test_write_off_and_exponent_floats_parse():
    base = (REPO / "specs" / "tiny_qwen3.yaml").read_text()
    text = base.replace("  rope_theta: 1000000.0", "  rope_theta: 1e6")
    assert parse_spec_text(text).dims.rope_theta == 1e6
    # 'off' is the string (YAML 1.1 would read it as false and reject a valid spec).
    text = base.replace("  write: async", "  write: off").replace("    granularity: layer\n", "")
    assert parse_spec_text(text).pool.write == "off"


def test_alias_bomb_is_fast_and_recursive_anchor_terminates():
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    prev = "a"
    for i in range(12):  # 10**13 leaves if aliases were expanded
        bomb += f"b{i}: &b{i} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"
        prev = f"b{i}"
    with pytest.raises(SpecError):
        parse_spec_text(bomb)   # returns at all: 10**13 leaves expanded would not
    data = load_yaml_data(bomb)  # the raw document too: each alias is the anchored object, shared, not copied
    assert all(data[f"b{i}"][j] is data[f"b{i - 1}"] for i in range(1, 12) for j in range(10))
    with pytest.raises(SpecError):
        parse_spec_text("name: &n [*n]\n")


def test_anchors_within_limits_work():
    base = (REPO / "specs" / "tiny_qwen3.yaml").read_text()
    text = base.replace("  decode:\n    phase: decode\n", "  decode: &dec\n    phase: decode\n  decode2: *dec\n")
    spec = parse_spec_text(text)
    assert spec.variants["decode2"] == spec.variants["decode"]


def test_one_bad_field_does_not_hide_compat_errors():
    # dims fails to parse, yet the feature problems are still reported.
    base = (REPO / "specs" / "tiny_qwen3.yaml").read_text()
    text = base.replace("  hidden_size: 64", "  hidden_size: x").replace("[prefix_cache]", "[prefix_cache, mtp]")
    with pytest.raises(SpecError) as info:
        parse_spec_text(text)
    msgs = [d.message for d in info.value.diagnostics]
    assert any("hidden_size" in x for x in msgs) and any("'mtp'" in x for x in msgs)


def test_with_overrides_still_valid():
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    forced = spec.with_overrides(write="sync", granularity="layer")
    assert forced.pool == m.PoolWrite(write="sync", granularity="layer")
    assert all(forced.variant_granularity(v) == "layer" for v in forced.variants.values())


def test_dump_omits_unset_optionals_and_orders_keys():
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    data = dump_spec(spec)
    assert list(data)[:3] == ["name", "family", "description"]
    assert "save" not in data["variants"]["decode"] and "granularity" not in data["variants"]["decode"]
    only_npu = dataclasses.replace(spec, targets=m.Targets(npu=m.NpuTarget()))
    assert "cpu" not in dump_spec(only_npu)["targets"]
    assert parse_spec_text(dump_spec_yaml(only_npu)) == only_npu


def test_dump_quotes_strings_that_would_change_type():
    spec = load_spec(REPO / "specs" / "tiny_qwen3.yaml")
    for text in ["off", "1e6", "yes", "a: b", "x # y", "", " lead", "line1\nline2", "null", "[1]", "é"]:
        s2 = dataclasses.replace(spec, description=text)
        assert parse_spec_text(dump_spec_yaml(s2)) == s2, text
        assert yaml.safe_load(dump_spec_yaml(s2))["description"] == text


def test_matrix_rows_are_consistent():
    from graphgen.modelspec.compat import FAMILIES, STATUSES, WRITE_MODES

    assert len({r.subject for r in MATRIX}) == len(MATRIX)
    for r in MATRIX:
        assert r.status in STATUSES
        assert set(r.families) <= set(FAMILIES) and set(r.writes) <= set(WRITE_MODES)
        assert set(r.required_by) <= set(r.writes)
    assert {r.subject for r in MATRIX if not r.is_feature} == {f"write:{w}" for w in WRITE_MODES}


def test_spec_package_imports_no_heavy_modules():
    # The build path must stay torch-free, and the loader must not pay for jsonschema.
    import subprocess
    import sys

    code = ("import sys, graphgen.modelspec.loader, graphgen.modelspec.schema, graphgen.modelspec.import_hf; "
            "print(sorted(m for m in ('torch', 'jsonschema', 'transformers', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
