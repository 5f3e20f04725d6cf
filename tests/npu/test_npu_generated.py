"""Generated NPU modules: API conformance, compile-mode rules, and post-AOT structure on the CPU STAND-IN.

Nothing here runs on an NPU.  (a)/(b) read the generated source against the torch-npu 2.14.0
manifest; (c)/(d) compile the tiny specs' modules with graphgen's CPU stand-in of torchair, which
proves FX graph structure (order, stream scopes, in-place writes after the modelled torchair
re-inplace) -- not NPU behaviour, numerics or speed.  Modules are rendered from the specs in
memory, so the tests follow the templates, not whatever sits in generated/.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from graphgen.generate import build_outputs, default_spec_paths
from graphgen.npu.check.conformance import check_module_source

ROOT = Path(__file__).resolve().parents[2]
TINY = ("tiny_qwen3_npu", "tiny_deepseek_v3_npu")  # the hardware-shaped specs (bf16, head_dim 128, block 128)
TAGGED = ("npu_create_tagged_event", "npu_tagged_event_record", "npu_tagged_event_wait")


FILES, _ = build_outputs(default_spec_paths(ROOT / "specs"))  # every spec rendered once, in memory


def _render_all() -> dict[str, str]:
    return {rel: text for rel, text in FILES.items() if "/npu/" in rel}


def _render_reduce_overhead() -> dict[str, str]:
    """reduce-overhead renders of the tiny Qwen3's saving variants, in memory only.  No spec ships
    them: its TND attention (D != 512) is documented unsupported in reduce-overhead
    (_op_plugin_docs.py:8737).  They exercise the mode's EVENT lowering (tagged events), which does
    not depend on the attention call: structure tests only."""
    from graphgen.lower.compile import compile_variant
    from graphgen.modelspec.loader import load_spec

    spec = load_spec(ROOT / "specs" / "tiny_qwen3_npu.yaml")
    return {f"{spec.name}/npu/reduce_overhead/{v}.py": compile_variant(spec, v, "npu", mode="reduce-overhead",
                                                                        spec_file="specs/tiny_qwen3_npu.yaml")
            for v in ("mempool_prefill_layer", "splitfuse")}


NPU = _render_all()
NPU_NAMES = sorted(NPU)
RO = _render_reduce_overhead()
ALL = {**NPU, **RO}


@functools.lru_cache(maxsize=4)  # a full-size module's tree is ~8 MB: keep the few a test is reading
def _tree(src: str) -> ast.Module:
    """The module's AST, parsed once per source while tests read it (they never change it)."""
    return ast.parse(src)


def _calls(src: str) -> list[str]:
    """Dotted names of every call in the module."""
    out = []
    for node in ast.walk(_tree(src)):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                out.append(".".join([f.id, *reversed(parts)]))
    return out


def test_every_npu_spec_has_modules_for_every_variant_and_mode():
    from graphgen.modelspec.loader import load_specs

    paths = default_spec_paths(ROOT / "specs")
    expected = set()
    for spec in load_specs(paths):
        if spec.targets.npu is None:
            continue
        for mode in spec.targets.npu.compile_modes:
            for v in spec.variants:
                expected.add(f"{spec.name}/npu/{mode.replace('-', '_')}/{v}.py")
    assert expected and expected == set(NPU)
    assert {n.split("/")[0] for n in NPU} >= set(TINY)


# ------------------------------------------------------------------------------------ (a) conformance
@pytest.mark.parametrize("name", NPU_NAMES)
def test_conformance(name):
    src = NPU[name]
    assert check_module_source(src, filename=name) == []
    calls = _calls(src)
    # the lowering really goes through torchair/torch_npu (an empty module would pass vacuously)
    assert any(c.startswith("torch_npu.npu_fused_infer_attention_score") for c in calls)
    assert sum(c == "torch_npu.npu_scatter_nd_update_" for c in calls) >= 2
    assert "NEVER RUN ON AN NPU" in ast.get_docstring(_tree(src))


# ------------------------------------------------------------------------------------ (b) mode rules
@pytest.mark.parametrize("name", NPU_NAMES + sorted(RO))
def test_mode_rules(name):
    src = ALL[name]
    mode = re.search(r"^COMPILE_MODE = '([^']+)'", src, re.M).group(1)
    assert name.split("/")[2] == mode.replace("-", "_")
    calls = _calls(src)
    has_events = "torchair.scope.npu_stream_switch" in calls  # saving variants: a save stream with events
    if mode == "max-autotune":
        assert not [c for c in calls if c.split(".")[-1] in TAGGED], "tagged events raise in max-autotune"
        if has_events:
            assert "torchair.ops.record" in calls and "torchair.ops.wait" in calls
    else:
        assert "torchair.scope.npu_wait_tensor" not in calls, "npu_wait_tensor raises in reduce-overhead"
        if has_events:
            assert "torchair.ops.npu_tagged_event_record" in calls and "torchair.ops.npu_tagged_event_wait" in calls
            # created at module level: outside forward (the compiled region)
            fwd = next(n for n in _tree(src).body if isinstance(n, ast.FunctionDef) and n.name == "forward")
            assert "npu_create_tagged_event" not in ast.unparse(fwd)


def test_only_npu_modules_import_torchair():
    for rel, text in FILES.items():
        if rel.endswith(".py") and "/npu/" not in rel:
            assert "torchair" not in text and "torch_npu" not in text, rel
    for rel, text in NPU.items():
        assert re.search(r"^import torchair$", text, re.M) and re.search(r"^import torch_npu$", text, re.M), rel


def test_no_shipped_module_uses_reduce_overhead():
    """Every shipped NPU module is max-autotune: the attention calls the specs need (TND, D != 512) are
    documented unsupported in reduce-overhead (_op_plugin_docs.py:8737)."""
    assert NPU and all("/npu/max_autotune/" in n for n in NPU)


def test_tagged_event_tags_unique_across_all_modules():
    tags: dict[str, str] = {}
    for name, src in {**NPU, **RO}.items():
        model, _, _, variant = name[:-3].split("/")
        if "npu_create_tagged_event" not in src:  # no such call can be in it: not worth a parse
            continue
        for node in ast.walk(_tree(src)):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("npu_create_tagged_event"):
                (kw,) = [k for k in node.keywords if k.arg == "tag"]
                tag = ast.literal_eval(kw.value)
                assert tag.startswith(f"graphgen.{model}.{variant}."), tag
                assert tag not in tags, f"{tag} in {name} and {tags[tag]}"
                tags[tag] = name
    assert tags  # the reduce-overhead renders do create events


# ------------------------------------------------------------------------------------ (c) post-AOT on the stand-in
import torch
from graphgen.npu.check import aotcheck  # noqa: E402
from graphgen.npu.standin import fakes as standin

needs_standin = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


@pytest.fixture(autouse=True)
def _tiny_specs_are_outside_the_kernel_limits():
    """The tiny specs these tests trace are float32 with block size 4 and head_dim 16: outside the
    kernels' documented limits by construction (tests/npu/test_limits.py proves the stand-in rejects
    them).  This file checks post-AOT structure, so it runs with the limits off."""
    with standin.enforce_limits(False):
        yield
def _spec(model):
    from graphgen.modelspec.loader import load_specs

    return load_specs([ROOT / "specs" / f"{model}.yaml"])[0]


def _run(trace, name, src=None):
    """Compile with the stand-in and run one step (``trace``: the session's memoized ``standin_trace``, so a
    module is traced once per run whichever tests check it); returns (module, captured graph, kv, staging, b)."""
    spec = _spec(name.split("/")[0])
    t = trace(ROOT / "generated" / name, spec, ALL[name] if src is None else src)
    assert t.logits.shape == (len(t.inputs.actual_seq_lengths), spec.dims.vocab_size)
    assert t.n_graphs == 1  # fullgraph: one compiled graph per step
    return t.module, t.graph, t.kv, t.staging, t.inputs


def _problems(cg, kv, staging):
    caches = [cg.placeholder_for(t) for layer in kv for t in layer]
    stagings = [cg.placeholder_for(t) for layer in staging for t in layer]
    return aotcheck.check_kv_save_graph(cg.gm, caches, stagings), caches


TINY_NAMES = [n for n in NPU_NAMES if n.split("/")[0] in TINY]


@needs_standin
@pytest.mark.parametrize("name", TINY_NAMES + sorted(RO))
def test_post_aot_structure(name, standin_trace):
    mod, cg, kv, staging, b = _run(standin_trace, name)
    problems, caches = _problems(cg, kv, staging)
    if mod.META["saves"]:
        # write -> record -> (save stream) wait -> gather into staging, all in place and in scope
        assert problems == [], "\n".join(problems)
        # the raw post-AOT graph has the functionalisation epilogue; the modelled re-inplace removed it
        raw = aotcheck.check_kv_save_graph(cg.raw, caches, [cg.placeholder_for(t) for l in staging for t in l])
        assert any("after the final scope_exit" in p for p in raw)
    else:
        # no save: no stream scope, and every cache component is written in place (no copy_ epilogue)
        assert "air.scope_enter" not in cg.gm.code
        roots = aotcheck.alias_roots(cg.gm)
        written = {ph.name for n in cg.gm.graph.nodes for ph in aotcheck.writes_of(n, roots)}
        assert set(caches) <= written
    assert "aten.copy_" not in cg.gm.code
    # the stand-in's scatter kernels are exact: the step's K/V landed at its slots and, when saving,
    # staging holds exactly the saved blocks of the written cache (so the save read after the write)
    blk, off = b.kv_index.unbind(-1)
    for layer in kv:
        for comp in layer:
            assert comp[blk, off].abs().sum(-1).gt(0).all()
    for layer_kv, layer_st in zip(kv, staging):
        for comp, st in zip(layer_kv, layer_st):
            assert torch.equal(st[:b.save_block_ids.numel()], comp.index_select(0, b.save_block_ids))


# ------------------------------------------------------------------------------------ (d) mutations must fail
MUT = "tiny_qwen3_npu/npu/{}/mempool_prefill_layer.py"



def _lines_tagged(src, node_id):
    return [i for i, l in enumerate(src.splitlines()) if l.rstrip().endswith(f"# {node_id}")]


def _drop(src, node_id):
    lines = src.splitlines()
    (i,) = _lines_tagged(src, node_id)
    indent = len(lines[i]) - len(lines[i].lstrip())
    lines[i] = " " * indent + "pass"  # keep the with-block non-empty
    return "\n".join(lines) + "\n"


def _move_after(src, line_idx, after_idx, indent=None):
    lines = src.splitlines()
    line = lines[line_idx]
    if indent is not None:
        line = " " * indent + line.lstrip()
    lines.insert(after_idx + 1, line)
    del lines[line_idx if line_idx < after_idx else line_idx + 1]
    return "\n".join(lines) + "\n"


@needs_standin
@pytest.mark.parametrize("mode", ["max_autotune", "reduce_overhead"])
def test_mutation_drop_wait_fails_aotcheck(mode, standin_trace):
    name = MUT.format(mode)
    src = _drop(ALL[name], "L00.kv_save.wait")
    assert src != ALL[name]
    _, cg, kv, staging, _ = _run(standin_trace, name, src)
    problems, _ = _problems(cg, kv, staging)
    assert any("is not ordered after write" in p for p in problems), problems


@needs_standin
@pytest.mark.parametrize("mode", ["max_autotune", "reduce_overhead"])
def test_mutation_kv_write_after_record_fails_aotcheck(mode, standin_trace):
    name = MUT.format(mode)
    src = ALL[name]
    w = _lines_tagged(src, "L00.kv_write")[0]
    (rec,) = _lines_tagged(src, "L00.kv_write.record")
    mutated = _move_after(src, w, rec)
    _, cg, kv, staging, _ = _run(standin_trace, name, mutated)
    problems, _ = _problems(cg, kv, staging)
    assert any("is not ordered after write" in p for p in problems), problems


@needs_standin
def test_mutation_kv_write_into_save_scope_fails_aotcheck(standin_trace):
    name = MUT.format("reduce_overhead")
    src = ALL[name]
    w = _lines_tagged(src, "L00.kv_write")[0]
    (wait,) = _lines_tagged(src, "L00.kv_save.wait")
    _, cg, kv, staging, _ = _run(standin_trace, name, _move_after(src, w, wait, indent=8))
    problems, _ = _problems(cg, kv, staging)
    assert any("inside a stream scope" in p for p in problems), problems


@needs_standin
def test_mutation_save_out_of_scope_fails_aotcheck(standin_trace):
    name = MUT.format("max_autotune")
    src = ALL[name]
    save = _lines_tagged(src, "L00.kv_save")[0]
    attn = _lines_tagged(src, "L00.attn")[0]  # first main-stream line after the with-block
    _, cg, kv, staging, _ = _run(standin_trace, name, _move_after(src, save, attn - 1, indent=4))
    problems, _ = _problems(cg, kv, staging)
    assert any("is not on stream 'kv_save'" in p for p in problems), problems


@pytest.mark.parametrize("old, new, needle", [
    ("torchair.ops.record()", "torchair.ops.record_event()", "not in the torchair API manifest"),
    ("torchair.scope.npu_stream_switch(", "torchair.scope.npu_stream_switched(", "not in the torchair API manifest"),
    ("torch_npu.npu_scatter_nd_update_(", "torch_npu.npu_scatter_nd_updat_(", "not a torch_npu op"),
    ("input_layout=", "layout=", "unknown keyword argument 'layout'"),
    ("torchair.ops.wait([", "torchair.ops.wait(tensor=[", "unknown keyword argument 'tensor'"),
])
def test_mutation_renamed_call_fails_conformance(old, new, needle):
    src = ALL[MUT.format("max_autotune")]
    head, body = src.split("\ndef forward(", 1)  # mutate code, not the docstring that names the calls
    assert old in body
    problems = check_module_source(head + "\ndef forward(" + body.replace(old, new, 1))
    assert any(needle in p for p in problems), problems


def test_mutation_tagged_event_in_max_autotune_breaks_mode_rule():
    # the rule test must be able to fail: a reduce-overhead body pasted into a max-autotune module
    src = ALL[MUT.format("reduce_overhead")].replace("COMPILE_MODE = 'reduce-overhead'", "COMPILE_MODE = 'max-autotune'")
    with pytest.raises(AssertionError):
        ALL["__mutant__/npu/max_autotune/x.py"] = src
        try:
            test_mode_rules("__mutant__/npu/max_autotune/x.py")
        finally:
            del ALL["__mutant__/npu/max_autotune/x.py"]


# ------------------------------------------------------------------------------------ (e) MLA by phase
DSV3 = "tiny_deepseek_v3_npu/npu/max_autotune/{}.py"
FULL_DSV3 = "deepseek_v3_1/npu/max_autotune/{}.py"


def _fia_calls(src, api="torch_npu.npu_fused_infer_attention_score"):
    return [c for c in ast.walk(_tree(src)) if isinstance(c, ast.Call) and ast.unparse(c.func) == api]


@pytest.mark.parametrize("name", [f.format(v) for f in (DSV3, FULL_DSV3)
                                  for v in ("mempool_prefill", "splitfuse", "mempool_prefill_layer", "splitfuse_layer")
                                  if f.format(v) in NPU])
def test_deepseek_prefill_and_splitfuse_have_no_absorbed_mla(name):
    """Absorbed MLA (FIA with query_rope) is documented for 1-16 query tokens per sequence only: no
    prefill/splitfuse module may contain it; its attention is the un-absorbed TND form, Q/K D = 192."""
    src = NPU[name]
    calls = _fia_calls(src)
    assert calls, "the module must still call fused_infer_attention_score"
    for c in calls:
        kws = {k.arg: ast.unparse(k.value) for k in c.keywords}
        assert "query_rope" not in kws and "key_rope" not in kws and "block_table" not in kws, ast.unparse(c)
        assert kws["input_layout"] == "'TND'" and kws["sparse_mode"] == "3"
    assert "_mla_attention_absorbed" not in src


@pytest.mark.parametrize("fmt", [DSV3, FULL_DSV3])
def test_deepseek_decode_keeps_absorbed_mla_and_splitfuse_gathers_history(fmt):
    decode, prefill, splitfuse = (NPU[fmt.format(v)] for v in ("decode", "mempool_prefill", "splitfuse"))
    # the static decode graph: v2 in BNSD (docs/npu.md "Decode as a static graph"), no v1 call left
    assert _fia_calls(decode) == []
    (call,) = _fia_calls(decode, "torch_npu.npu_fused_infer_attention_score_v2")
    kws = {k.arg: ast.unparse(k.value) for k in call.keywords}
    # sparse_mode 0 without a mask for one query token per row; 3 with the mask for a verify row (S > 1)
    assert {"query_rope", "key_rope", "block_table", "actual_seq_kvlen"} <= set(kws)
    assert kws["sparse_mode"] == "0 if s == 1 else 3" and kws["atten_mask"] == "None if s == 1 else atten_mask"
    assert kws["input_layout"] == "'BNSD'" and "TILING_SINK = True" in decode
    assert "_mla_unabsorbed" not in decode
    # the history gather (block table -> latent rows) is what makes splitfuse differ from prefill
    assert "_paged_rows(" in splitfuse and "_paged_rows(" not in prefill
    assert "= _mla_splitfuse(" in splitfuse and "= _mla_prefill(" in prefill


@needs_standin
def test_standin_rejects_the_old_absorbed_prefill():
    """The old lowering ran prefill chunks through the absorbed form: the stand-in now refuses a
    query_rope call with more than 16 query tokens in a sequence (it would have caught it)."""
    standin.install()
    t, n, bs = 40, 32, 128
    q = torch.zeros(t, n, 512, dtype=torch.bfloat16)
    ckv = torch.zeros(2, bs, 512, dtype=torch.bfloat16)
    kpe = torch.zeros(2, bs, 64, dtype=torch.bfloat16)
    kw = dict(query_rope=torch.zeros(t, n, 64, dtype=torch.bfloat16), key_rope=kpe, actual_seq_lengths=[t],
              actual_seq_lengths_kv=[t], block_table=torch.tensor([[0]], dtype=torch.int32), num_heads=n,
              num_key_value_heads=1, scale=1.0, input_layout="TND", sparse_mode=3, block_size=bs,
              atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
    with pytest.raises(ValueError, match=r"fia\.mla\.query_len"), standin.enforce_limits(True):
        torch.ops.npu.npu_fused_infer_attention_score(q, ckv, ckv, **kw)
    kw.update(query_rope=kw["query_rope"][:16], actual_seq_lengths=[16], actual_seq_lengths_kv=[16])
    out, _ = torch.ops.npu.npu_fused_infer_attention_score(q[:16], ckv, ckv, **kw)  # 16 is inside the envelope
    assert out.shape == (16, n, 512)


