"""The committed torchair/torch_npu manifest and the conformance checker built on it."""
import json
from pathlib import Path

import pytest

from graphgen.npu.check.conformance import check_module_source, load_manifest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def manifest():
    return load_manifest()


def _names(entry):
    return [p["name"] for p in entry["params"]]


def test_manifest_records_its_source(manifest):
    w = manifest["wheel"]
    assert w["name"].startswith("torch_npu-2.14.0-") and w["name"].endswith(".whl")
    assert len(w["sha256"]) == 64
    assert all(e["source"].startswith("torch_npu/dynamo/torchair/") for e in manifest["python_api"].values())
    assert all(e["sources"] for e in manifest["op_schemas"].values())


def test_manifest_is_sorted_and_deterministic(manifest):
    text = (ROOT / "graphgen/npu/manifest.json").read_text()
    assert json.loads(text) == manifest
    for section in ("python_api", "op_schemas"):
        assert list(manifest[section]) == sorted(manifest[section])


def test_torchair_api_matches_torchair_md(manifest):
    api = manifest["python_api"]
    sw = api["torchair.scope.npu_stream_switch"]
    assert _names(sw) == ["stream_tag", "stream_priority", "enable_inner_parallel"]
    assert [p["default"] for p in sw["params"]] == [None, "0", "True"]
    assert _names(api["torchair.scope.npu_wait_tensor"]) == ["self", "dependency"]
    assert _names(api["torchair.ops.record"]) == []
    assert _names(api["torchair.ops.wait"]) == ["tensors"]
    assert _names(api["torchair.ops.npu_create_tagged_event"]) == ["tag"]
    assert _names(api["torchair.ops.npu_tagged_event_record"]) == ["event"]
    assert _names(api["torchair.ops.npu_tagged_event_wait"]) == ["event"]
    assert _names(api["torchair.ops.npu_record_tagged_stream"]) == ["input", "tagged_stream"]
    gb = api["torchair.get_npu_backend"]
    assert _names(gb) == ["compiler_config", "custom_decompositions"]
    assert all(p["kind"] == "keyword_only" for p in gb["params"])
    cc = api["torchair.inference.cache_compile"]
    assert _names(cc)[:4] == ["func", "config", "dynamic", "cache_dir"]
    mode = api["torchair.CompilerConfig"]["attributes"]["mode"]
    assert mode["default"] == "max-autotune" and "reduce-overhead" in mode["choices"]


def test_op_schemas_match_torchair_md(manifest):
    s = manifest["op_schemas"]
    assert s["air::scope_enter"]["schema"] == "scope_enter(str[] keys, str[] values, bool need_execute=False) -> None"
    assert s["air::record"]["schema"] == "record(*, Device? device=None) -> Tensor"
    assert s["air::wait"]["schema"] == "wait(Tensor[] x) -> ()"
    assert s["air::record_tagged_stream_"]["schema"] == "record_tagged_stream_(Tensor(a!) input, str tag) -> ()"
    assert s["air::tagged_event_record"]["schema"] == "tagged_event_record(str tag, bool created_inside=False) -> ()"
    pa = s["npu::npu_scatter_pa_kv_cache"]
    assert _names(pa)[:5] == ["key", "value", "key_cache", "value_cache", "slot_mapping"]
    assert [p["mutable"] for p in pa["params"][:4]] == [False, False, True, True]
    assert "npu::npu_scatter_pa_kv_cache_functional" in s
    assert s["npu::npu_scatter_nd_update_"]["params"][0]["mutable"]
    fia = {p["name"]: p for p in s["npu::npu_fused_infer_attention_score"]["params"]}
    for k in ("atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table", "query_rope",
              "key_rope", "num_heads", "scale", "input_layout", "num_key_value_heads", "sparse_mode", "block_size"):
        assert fia[k]["kind"] == "keyword_only", k
    assert _names(s["npu::npu_rms_norm"]) == ["self", "gamma", "epsilon"]
    assert _names(s["npu::npu_swiglu"]) == ["self", "dim"]
    assert _names(s["npu::npu_apply_rotary_pos_emb"]) == ["query", "key", "cos", "sin", "layout", "rotary_mode"]
    for n in ("npu_incre_flash_attention", "npu_add_rms_norm", "npu_mla_prolog", "npu_kv_rmsnorm_rope_cache",
              "npu_moe_gating_top_k", "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing",
              "npu_interleave_rope"):
        assert f"npu::{n}" in s, n


GOOD = '''
import torch, torchair, torch_npu
from torchair.scope import npu_stream_switch
def f(x, cache, idx, g):
    torch_npu.npu_scatter_nd_update_(cache, idx, x)
    r = torchair.ops.record()
    with npu_stream_switch("kv_save", 0):
        torchair.ops.wait([r])
    y, _ = torch.ops.npu.npu_rms_norm(x, g, epsilon=1e-6)
    torch.ops.air.scope_exit()
    cfg = torchair.CompilerConfig()
    return torchair.get_npu_backend(compiler_config=cfg)
'''


def test_checker_passes_correct_calls(manifest):
    assert check_module_source(GOOD, manifest) == []


@pytest.mark.parametrize("src, needle", [
    ("import torchair\ntorchair.ops.record_event()\n", "torchair.ops.record_event is not in the torchair API"),
    ("import torch_npu\ntorch_npu.npu_no_such_kernel(1)\n", "not a torch_npu op"),
    ("import torchair\ntorchair.scope.npu_stream_switch('s', priority=1)\n", "unknown keyword argument 'priority'"),
    ("import torchair\ntorchair.scope.npu_stream_switch('s', 0, True, 4)\n", "too many positional arguments"),
    ("import torchair\ntorchair.get_npu_backend(None)\n", "too many positional arguments"),
    ("import torch_npu\ntorch_npu.npu_scatter_nd_update_(c, i)\n", "missing required argument 'updates'"),
    ("import torch\ntorch.ops.npu.npu_swiglu(x, dim=-1, axis=0)\n", "unknown keyword argument 'axis'"),
    ("import torch\ntorch.ops.air.wait(a, b)\n", "too many positional arguments"),
    ("import torchair as ta\nta.ops.npu_tagged_event_record()\n", "missing required argument 'event'"),
])
def test_checker_flags_problems_with_line_numbers(manifest, src, needle):
    problems = check_module_source(src, manifest, filename="gen.py")
    assert any(needle in p for p in problems), problems
    assert all(p.startswith("gen.py:2:") for p in problems), problems
