"""The family registry as the one home of family knowledge."""

from __future__ import annotations

import ast
import math

import pytest

from graphgen.families import FAMILIES
from graphgen.ir.graph import Graph
from graphgen.modelspec.loader import load_spec
from support.paths import REPO

SPECS = {"qwen3_dense": "tiny_qwen3", "deepseek_v3": "tiny_deepseek_v3"}
# The compatibility matrix is one declared table (rendered into docs/spec.md); its rows name the
# families a feature applies to by design.
ALLOWED = {"graphgen/modelspec/compat.py"}


def test_no_family_name_in_code_outside_families():
    """No Python module outside graphgen/families compares against or indexes by a family name
    (docstrings and comments may mention one)."""
    names = set(FAMILIES)
    offenders = []
    for path in sorted((REPO / "graphgen").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("graphgen/families/") or rel in ALLOWED:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings:
                offenders.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not offenders, "family knowledge outside graphgen/families:\n" + "\n".join(offenders)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ir_kv_layout_is_the_family_kv_components(family):
    spec = load_spec(REPO / "specs" / f"{SPECS[family]}.yaml")
    fam = FAMILIES[family]
    g = Graph("t")
    fam.build(g, spec.dims, "prefill", block_size=spec.kv_cache.block_size, kv_dtype=spec.kv_cache.dtype)
    comps = fam.kv_components(spec.dims)
    writes = [n for n in g.nodes if n.op == "kv_write"]
    assert len(writes) == spec.dims.num_hidden_layers
    for n in writes:
        assert n.attrs["components"] == tuple(c for c, _ in comps)
        assert n.attrs["widths"] == tuple(math.prod(s) for _, s in comps)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_ir_weight_is_in_the_checkpoint_layout(family):
    """Every ``w_*`` the builder names is a non-empty key of the family's stacked layout, and every
    non-empty layout key is used (lm_head only when untied)."""
    spec = load_spec(REPO / "specs" / f"{SPECS[family]}.yaml")
    fam = FAMILIES[family]
    g = Graph("t")
    fam.build(g, spec.dims, "decode", block_size=spec.kv_cache.block_size, kv_dtype=spec.kv_cache.dtype)
    used = {v for n in g.nodes for k, v in n.attrs.items() if k.startswith("w_") and v is not None}
    layout = {k for k, s in fam.checkpoint_layout(spec.dims, stacked=True).items() if 0 not in s}
    assert used <= layout
    assert layout - used <= {"lm_head.weight"}


def test_loader_output_is_the_stacked_layout(tmp_path):
    """Wiring, not meaning (the writer and the loader share the layout; the layout itself is checked
    against transformers in test_family_gaps.py): the loader returns exactly the stacked layout,
    empty shared experts dropped."""
    import safetensors  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
    import dataclasses

    from graphgen.runtime.checkpoint.hf import load_hf_weights, write_random_hf_checkpoint

    spec = load_spec(REPO / "specs" / "tiny_deepseek_v3.yaml")
    dims = dataclasses.replace(spec.dims, n_shared_experts=0, q_lora_rank=None)
    write_random_hf_checkpoint(str(tmp_path), "deepseek_v3", dims, seed=1)
    got = {k: tuple(t.shape) for k, t in load_hf_weights(str(tmp_path)).items()}
    want = {k: s for k, s in FAMILIES["deepseek_v3"].checkpoint_layout(dims, stacked=True).items() if 0 not in s}
    assert got == want
