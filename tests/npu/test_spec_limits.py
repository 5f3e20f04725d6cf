"""check_spec_limits: a spec declaring the NPU target is checked against the kernels' documented limits.

Each case edits ONE field of a shipped full-size spec (which passes: the control) and loads the text
with the real spec loader; the check must report that field, the limit row and its wheel-doc source.
"""
from __future__ import annotations

import re
import pytest

from graphgen.modelspec.loader import parse_spec_text
from graphgen.npu.check.limits import BY_KEY
from graphgen.npu.check.speclimits import check_spec_limits
from support.npu_limits import DSV3, LIMIT_CASES, QWEN

def _edit(text: str, key: str, new: str) -> str:
    out, n = re.subn(rf"(?m)^(\s*{re.escape(key)}:)\s*\S.*$", rf"\1 {new}", text, count=1)
    assert n == 1, key
    return out


def test_full_size_specs_are_inside_the_documented_limits():
    assert check_spec_limits(parse_spec_text(QWEN, "qwen3_32b.yaml")) == []
    assert check_spec_limits(parse_spec_text(DSV3, "deepseek_v3_1.yaml")) == []


CASES = LIMIT_CASES  # one table, shared with the other limit test (tests/support/npu_limits.py)


@pytest.mark.parametrize("base,key,new,path,row", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[4]}" for c in CASES])
def test_spec_outside_a_limit_is_reported(base, key, new, path, row):
    text = _edit(QWEN if base == "qwen" else DSV3, key, new)
    spec = parse_spec_text(text, f"{base}.yaml")
    found = check_spec_limits(spec)
    hits = [f for f in found if f[0] == path and f"[{row}]" in f[1]]
    assert hits, found
    assert hits[0][2] == BY_KEY[row].source and new.split(",")[0].strip("[") in hits[0][1]


def test_spec_without_the_npu_target_is_not_checked():
    text = QWEN.replace("  npu:\n    compile_modes: [max-autotune]\n    device_memory_gib: 64\n", "")
    assert "npu:" not in text.split("targets:")[1]
    assert check_spec_limits(parse_spec_text(_edit(text, "dtype", "float32"), "q.yaml")) == []


def test_the_doc_conflicts_the_first_hardware_run_must_measure_match_the_checklist():
    """Audit 4 M4/M7/M8: doc_conflicts computes, per shipped spec, the calls one reading of the docs refuses;
    docs/npu.md's H8 states the same numbers (a changed bucket or layout that moves them fails here)."""
    from pathlib import Path

    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.check.speclimits import doc_conflicts

    ROOT = Path(__file__).resolve().parents[2]

    docs = (ROOT / "docs" / "npu.md").read_text()
    two = dict(doc_conflicts(load_spec(ROOT / "specs" / "deepseek_v3_1_2node.yaml")))
    assert set(two) == {"M4", "M7"} and "[8192, 7168] = 58720256 elements" in two["M4"]
    assert "x `[8192, 7168]`" in docs and "58,720,256 elements" in docs
    assert set(dict(doc_conflicts(load_spec(ROOT / "specs" / "qwen3_32b.yaml")))) == {"M8"}
    assert doc_conflicts(load_spec(ROOT / "specs" / "deepseek_v3_1.yaml")) == []  # dp 1, bf16: 7.3M elements
    for sid in ("M4", "M7", "M8"):
        assert f"**{sid}**" in docs
