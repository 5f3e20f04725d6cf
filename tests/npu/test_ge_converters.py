"""GE converter coverage (graphgen/npu/check/geops.py against the committed ge_converters.json).

What a pass proves: every op target of the post-AOT graphs -- the tiny hardware-shaped specs at every
bucket through the CPU stand-in, the shipped full-size modules on meta tensors at one bucket per
variant -- has a torchair 2.14.0 GE converter that does not only raise.  Not that the converter
accepts these arguments, nor anything GE does next (docs/npu.md, "GE converter coverage").  The table
is read from the committed JSON only; nothing here downloads the wheel.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ge_trace  # noqa: E402  (tests/npu/ge_trace.py)
from graphgen.npu.check import geops  # noqa: E402
from graphgen.npu.standin import fakes as standin  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
needs_standin = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed")
TINY = {"tiny_qwen3_npu": ["decode", "mempool_prefill", "splitfuse", "mempool_prefill_layer", "splitfuse_layer"],
        "tiny_deepseek_v3_npu": ["decode", "mempool_prefill", "splitfuse", "mempool_prefill_layer",
                                 "splitfuse_layer"]}
FULL = {"qwen3_32b": ["decode", "mempool_prefill", "splitfuse"],
        "deepseek_v3_1": ["decode", "mempool_prefill", "splitfuse"],
        "deepseek_v3_1_dp_ep": ["decode", "mempool_prefill", "splitfuse"],
        # with its MTP layer: the draft graph, and the verify step (the decode module, K + 1 tokens per row)
        "deepseek_v3_1_mtp": ["decode", "mempool_prefill", "splitfuse", "mtp_draft", "verify"]}
ADDRESS = re.compile(r"0x[0-9a-f]{6,}|<.* at ")


def _extractor():
    spec = importlib.util.spec_from_file_location("extract_ge_converters", ROOT / "scripts/extract_ge_converters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- the committed table
def test_table_is_from_the_manifests_wheel_and_byte_deterministic():
    table = geops.load_table()
    manifest = json.loads((ROOT / "graphgen/npu/manifest.json").read_text())
    assert table["wheel"] == manifest["wheel"]  # same wheel name, sha256 and version
    assert _extractor().dump(table) == geops.TABLE.read_text()  # sorted, one converter per line


def test_table_has_the_facts_the_check_relies_on():
    c = geops.load_table()["converters"]
    assert c["aten.sort.stable"]["kind"] == "raises"
    assert c["aten.sort.stable"]["sources"][0].startswith("air/_ge_concrete_graph/ge_converter/aten/sort.py:36 ")
    assert c["aten.sort.default"]["kind"] == "real" and c["aten.index_select.default"]["kind"] == "real"
    assert c["npu.npu_fused_infer_attention_score.default"]["kind"] == "real"
    assert c["air.tagged_event_record.default"]["kind"] == "raises"  # tagged events raise in GE (audit 2, row 20)
    assert c["aten.sym_size"]["form"] == "packet"  # covers only the packet, not aten.sym_size.default
    assert c["aten.sym_size.default"]["kind"] == "raises"
    special = {e["target"] for e in geops.load_table()["special_targets"]}
    assert {"air.scope_enter.default", "air.scope_exit.default", "air.record.default", "air.wait.default"} <= special
    dec = geops.load_table()["decompositions"]["aot_table"]
    assert [d["target"] for d in dec] == ["_c10d_functional.all_to_all_single.default", "npu_define.allgather.default"]


@pytest.mark.parametrize("body, kind", [
    ('"""doc"""\n    raise RuntimeError("x ge_converter is not supported!")', "raises"),
    ("raise NotImplementedError('x')", "raises"),
    ("if a:\n        raise RuntimeError('a')\n    else:\n        raise RuntimeError('b')", "raises"),
    ("y = 1\n    raise RuntimeError('late')", "raises"),
    # negative controls: a raise on some paths only is a real converter
    ("if a:\n        raise RuntimeError('a')\n    return ge.Sort(x)", "real"),
    ("return ge.Sort(x)", "real"),
    ("if a:\n        raise RuntimeError('a')", "real"),
])
def test_raises_classifier(body, kind):
    fn = ast.parse(f"def f(x, a):\n    {body}\n").body[0]
    assert ("raises" if _extractor().always_raises(_extractor()._body(fn)) else "real") == kind


# --------------------------------------------------------------------------- the check itself
def test_check_names_op_variant_mode_and_bucket():
    w = geops.where("s.yaml", "splitfuse", "max-autotune", {"batch": 3, "tokens": 128})
    (p,) = geops.check_targets(["aten.sort.stable", "aten.mm.default"], ["_operator.getitem"], where=w)
    assert "aten.sort.stable" in p and "splitfuse" in p and "max-autotune" in p and "batch=3, tokens=128" in p
    assert "sort.py:36" in p  # cites the wheel


def test_check_flags_missing_converters_and_python_functions():
    ps = geops.check_targets(["npu.npu_not_a_real_op.default", "aten.not_an_op.default"],
                             ["graphgen.npu.check.geops.where", "_operator.getitem", "_operator.add"], where="w")
    assert len(ps) == 3, ps
    assert "npu.npu_not_a_real_op.default has no GE converter" in ps[0] and "Ascend IR" in ps[0]
    assert "aten.not_an_op.default has no GE converter" in ps[1]
    assert "graphgen.npu.check.geops.where is neither an OpOverload nor a builtin" in ps[2]


def test_no_allow_list_an_npu_op_without_a_converter_fails_the_check():
    """Audit 3 N4: the allow-list that let npu_moe_token_unpermute through (on the claim torchair would
    build its converter from the Ascend IR; it would look for NpuMoeTokenUnpermute, CANN's op is
    MoeTokenUnpermute) is gone, so that op -- the MoE's unpermute before this issue -- fails like any
    other; the trio that replaced it has real converters in the table."""
    assert not hasattr(geops, "ALLOWED")
    (p,) = geops.check_targets(["npu.npu_moe_token_unpermute.default"], [], where="w")
    assert "npu.npu_moe_token_unpermute.default has no GE converter" in p
    conv = geops.load_table()["converters"]
    for op in ("npu_moe_init_routing", "npu_moe_compute_expert_tokens", "npu_moe_finalize_routing"):
        assert conv[f"npu.{op}.default"]["kind"] == "real", op
        assert conv[f"npu.{op}.default"]["sources"][0].startswith("air/_ge_concrete_graph/ge_converter/custom/")


def _moe_ops_are_the_trio(report) -> None:
    """Every MoE graph the converter check saw holds the trio (checked against the table like every
    other op) and not the unpermute: the check runs on these op lists, not on an allow-list."""
    for g in report["graphs"]:
        if "npu.npu_moe_gating_top_k.default" in g["ops"]:
            assert {"npu.npu_moe_init_routing.default", "npu.npu_moe_compute_expert_tokens.default",
                    "npu.npu_moe_finalize_routing.default"} <= set(g["ops"]), (g["variant"], g["bucket"])
            assert "npu.npu_moe_token_unpermute.default" not in g["ops"]


def test_reduce_overhead_graphs_are_not_checked_against_ge_converters():
    assert geops.check_targets(["aten.sort.stable"], [], where="w", mode="reduce-overhead") == []


def test_the_standin_aot_uses_torchairs_decomposition_table():
    backend = standin.StandinBackend()
    op = torch.ops._c10d_functional.all_to_all_single.default
    assert op in backend.decompositions
    with pytest.raises(geops.UnmodelledDecomposition, match="air/_utils/__init__.py:476"):
        backend.decompositions[op]()


# --------------------------------------------------------------------------- the shipped specs
def _cached_report(name, variants, full_size, trace):
    key = ge_trace.cache_key(name, variants, full_size)
    report = None if os.environ.get("GRAPHGEN_REFRESH_GE_OPS") else ge_trace.cached(name, key)
    if report is None:
        report = trace()
        if os.environ.get("GRAPHGEN_REFRESH_GE_OPS"):
            ge_trace.store(name, key, report)
        else:
            warnings.warn(f"tests/npu/data/ge_ops/{name}.json is stale (module, stand-in or torch changed): "
                          f"retraced; refresh the cache with {ge_trace.REFRESH}")
    return report


@needs_standin
@pytest.mark.parametrize("name", sorted(TINY))
def test_cached_converter_check_on_tiny_npu_specs_at_every_bucket(name):
    report = _cached_report(name, TINY[name], False, lambda: ge_trace.trace_tiny(ROOT / "specs" / f"{name}.yaml"))
    seen = {(g["variant"], g["bucket"]["tokens"]) for g in report["graphs"]}
    assert len(seen) == len(TINY[name]) * 4, seen  # 4 buckets per variant in these specs
    assert geops.check_ops_report(report) == []
    _moe_ops_are_the_trio(report)


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    import torch.distributed._functional_collectives  # noqa: F401  (registers the collectives' meta kernels)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    yield lambda size: dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    if dist.is_initialized():
        dist.destroy_process_group()


@needs_standin
@pytest.mark.parametrize("name", sorted(FULL))
def test_cached_converter_check_on_full_size_modules_on_meta(name, fake_group):
    def trace():
        graphs = []
        try:
            for v in FULL[name]:
                graphs.append(ge_trace.trace_full_size_meta(name, v, fake_group))
                import torch.distributed as dist

                dist.destroy_process_group()
        finally:
            standin.uninstall()
        return {"spec": name, "torch": torch.__version__, "graphs": graphs}

    report = _cached_report(name, FULL[name], True, trace)
    assert sorted(g["variant"] for g in report["graphs"]) == sorted(FULL[name])
    assert geops.check_ops_report(report) == []
    _moe_ops_are_the_trio(report)


# --------------------------------------------------------------------------- negative control
# The helpers as they were before the host-side rows (graphgen/lower/npu_helpers.py at 53d3f78), with
# block_size defaulted because today's call sites no longer pass it.
OLD_HELPERS = '''def _paged_rows(cache_part, block_table, seq_lens, block_size):
    b, m = block_table.shape
    rows = (block_table.long()[:, :, None] * block_size
            + torch.arange(block_size, device=block_table.device)).reshape(b, m * block_size)
    pos = torch.arange(m * block_size, device=block_table.device)
    valid = torch.stack([pos < seq_lens[i] for i in range(b)])  # lengths as values, not shapes
    order = torch.argsort((~valid).to(torch.int8).flatten(), stable=True)  # valid rows first, (seq, pos) order
    return cache_part.reshape(-1, cache_part.shape[-1]).index_select(0, rows.flatten().index_select(0, order))


def _mla_splitfuse(q_nope, q_pe, cache, w_kv_b, block_table, actual_seq_lengths, actual_seq_lengths_kv, atten_mask,
                   *, num_heads, qk_nope_head_dim, v_head_dim, scale, block_size=128):
    cum_kv = [sum(actual_seq_lengths_kv[:i + 1]) for i in range(len(actual_seq_lengths_kv))]
    c_kv = _paged_rows(cache[0], block_table, actual_seq_lengths_kv, block_size)
    k_pe = _paged_rows(cache[1], block_table, actual_seq_lengths_kv, block_size)
    return _mla_unabsorbed(q_nope, q_pe, c_kv, k_pe, w_kv_b, actual_seq_lengths, cum_kv, atten_mask,
                           num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, scale=scale)


'''


def _old_argsort_form(src: str) -> str:
    """Source hook: put the in-graph stable argsort back into a generated DeepSeek splitfuse module."""
    i, j = src.index("def _paged_rows("), src.index("def _moe_residual(")
    src = src[:i] + OLD_HELPERS + src[j:]
    assert "b.kv_gather_rows" in src
    return src.replace("b.kv_gather_rows", "b.block_tables")


@needs_standin
def test_negative_control_old_argsort_paged_rows_fails_naming_sort_stable_variant_and_bucket():
    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.run.bucketing import Buckets, run_standin_loop

    spec = load_spec(ROOT / "specs/tiny_deepseek_v3_npu.yaml")
    src = (ROOT / "generated/tiny_deepseek_v3_npu/npu/max_autotune/splitfuse.py").read_text()
    # one bucket, one step: the smallest prefill bucket only
    b = Buckets.from_spec(spec)
    small = Buckets(b.decode_batch, b.prefill_tokens[:1], b.prefill_seqs, b.max_blocks, b.save_rows)
    results = run_standin_loop(spec, ["splitfuse"], ["max-autotune"], steps=0, buckets=small, every_bucket=True,
                               sources={("splitfuse", "max-autotune"): _old_argsort_form(src)})
    problems = geops.check_ops_report(geops.ops_report("specs/tiny_deepseek_v3_npu.yaml", results))
    assert problems, "the old in-graph argsort must fail the GE converter check"
    assert all("aten.sort.stable" in p for p in problems)
    assert "variant splitfuse (mode max-autotune, bucket {batch=3, tokens=128})" in problems[0]
    assert "sort.py:36" in problems[0]


@pytest.mark.slow  # a stand-in compile with --ops-json
# --------------------------------------------------------------------------- --ops-json and the seed
@needs_standin
def test_ops_json_shape_sorted_and_without_addresses(tmp_path):
    out = tmp_path / "ops.json"
    hw = Path(__file__).parent / "data/hw_tiny_qwen3.yaml"
    res = subprocess.run([sys.executable, "-m", "graphgen.cli", "compile", "--target", "npu", "--spec", str(hw),
                          "--variant", "decode", "--standin", "--steps", "1", "--ops-json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "GE converter check ok" in res.stdout
    doc = json.loads(out.read_text())
    assert set(doc) == {"spec", "torch", "graphs"} and doc["spec"] == str(hw) and doc["torch"] == torch.__version__
    assert [g["bucket"]["batch"] for g in doc["graphs"]] == [1, 2, 4, 8]  # one graph per decode bucket
    for g in doc["graphs"]:
        assert set(g) == {"variant", "mode", "bucket", "ops", "callables"}
        assert (g["variant"], g["mode"]) == ("decode", "max-autotune")
        assert g["ops"] == sorted(set(g["ops"])) and g["callables"] == sorted(set(g["callables"]))
        assert "aten.mm.default" in g["ops"] and "_operator.getitem" in g["callables"]
    assert not ADDRESS.search(out.read_text())


@pytest.mark.slow  # interpreters started under different hash seeds
def test_step_mix_seed_is_the_same_in_every_process():
    # the buckets the --steps mix visits, as run_standin_loop seeds it
    code = ("from graphgen.npu.run.bucketing import Buckets, mixed_steps, stable_seed; B = Buckets();"
            "print([[(B.padding(p, len(s), sum(q for _, q in s)).batch, B.padding(p, len(s), sum(q for _, q in s)).tokens)"
            " for s in mixed_steps(p, h, B, 16, 8, seed=stable_seed(v, 'max-autotune'))]"
            " for v, p, h in [('decode', 'decode', False), ('splitfuse', 'prefill', True)]])")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": s}).stdout for s in ("1", "2")}
    assert len(outs) == 1, outs
    # negative control: the old hash((variant, mode)) seed differs between these processes
    old = {subprocess.run([sys.executable, "-c", "print(hash(('decode', 'max-autotune')) % 1000)"],
                          capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": s}).stdout
           for s in ("1", "2", "12345")}
    assert len(old) > 1


def test_docs_name_the_torch_that_traced_the_op_lists():
    """Audit 3 N11: docs/npu.md says which torch traced the cached op lists (and how to refresh them on
    the NPU host); that statement is checked against every cache file's own record of it."""
    docs = (ROOT / "docs/npu.md").read_text()
    said = re.search(r"traced with torch `([^`]+)`", docs)
    assert said, "docs/npu.md no longer says which torch traced tests/npu/data/ge_ops"
    recorded = {json.loads(p.read_text())["key"]["torch"] for p in ge_trace.CACHE.glob("*.json")}
    assert recorded == {said.group(1)}, recorded
    assert "GRAPHGEN_REFRESH_GE_OPS=1" in docs and "extract_ge_converters.py --wheel" in docs


@needs_standin
def test_every_cached_op_list_is_fresh():
    """A change to what shapes a trace (the stand-in, the NPU inputs, bucketing, the converter table, a
    generated module) makes the cached op lists stale: the checks above then retrace (correct, but
    ~10 minutes of CI: the landing that hit it took 26 minutes). This names the stale caches at once,
    with the command that refreshes them, so the change that staled them refreshes them."""
    stale = [name for name, variants, full in [*((n, v, False) for n, v in TINY.items()),
                                               *((n, v, True) for n, v in FULL.items())]
             if ge_trace.cached(name, ge_trace.cache_key(name, variants, full)) is None]
    assert not stale, f"tests/npu/data/ge_ops: {', '.join(stale)} stale; refresh with {ge_trace.REFRESH}"


def _callees(source: str) -> set[str]:
    """The library functions a generated module calls (``torch.*``, ``F.*``, ``torch_npu.*``, ``torchair.*``)."""
    out = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Call):
            f, parts = n.func, []
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name) and f.id in ("torch", "F", "torch_npu", "torchair"):
                out.add(".".join([f.id, *reversed(parts)]))
    return out


def test_the_sharded_mtp_draft_module_calls_only_what_cached_modules_call():
    """Issue 38 item 2: import-hf --fit lays the published DeepSeek-V3.1 with its MTP layer out at tp 32, whose
    draft module no shipped spec generates, so no op list above covers it. What is checked instead, at the
    source level: every library function rank 0's tp-32 draft module calls is called by a module whose GE
    coverage is cached (deepseek_v3_1's tp-32 modules: the vocabulary-parallel embedding, the sharded MLA and
    MoE, their all-reduces; deepseek_v3_1_mtp's draft: eh_proj and the save). Not the same as tracing it: the
    same callees, not the same AOT graph (its trace on meta: tests/npu/test_full_size_meta.py). Negative control:
    the DP-attention modules call reduce_scatter_tensor, which none of those does."""
    import dataclasses

    from graphgen.lower.compile import compile_spec
    from graphgen.modelspec.loader import load_spec

    gen = ROOT / "generated"
    cached = set().union(*(_callees((gen / "deepseek_v3_1/npu/max_autotune" / f"{v}.py").read_text())
                           for v in FULL["deepseek_v3_1"]),
                         _callees((gen / "deepseek_v3_1_mtp/npu/max_autotune/mtp_draft.py").read_text()))
    spec = load_spec(ROOT / "specs/deepseek_v3_1_mtp.yaml")
    spec = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, tp=32))
    (compiled,) = compile_spec(spec, variants=["mtp_draft"], targets=["npu"], modes=["max-autotune"])
    draft = _callees(next(iter(compiled.sources.values())))
    assert "torch.ops._c10d_functional.all_reduce" in draft and "F.embedding" in draft  # it is sharded
    assert draft <= cached, sorted(draft - cached)
    dp = set().union(*(_callees((gen / "deepseek_v3_1_dp_ep/npu/max_autotune" / f"{v}.py").read_text())
                       for v in FULL["deepseek_v3_1_dp_ep"]))
    assert "torch.ops._c10d_functional.reduce_scatter_tensor" in dp - cached
