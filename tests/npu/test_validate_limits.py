"""`graphgen validate` on a spec declaring the NPU target: exit 2 with file:line of the offending field,
the documented kernel limit and its source line; and the NpuTarget bucket fields' loader errors.

Each limit case edits ONE line of a shipped full-size spec (which validates cleanly: the control) and
runs the real CLI entry point (``graphgen.cli.main``) on the written file.  The expected line is found
by searching the edited text, not hard-coded, and the limit's words and source come from the one
table (``graphgen.npu.check.limits.BY_KEY``), so a row that moves or changes its text is still checked.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphgen.cli import main
from graphgen.npu.check.limits import BY_KEY
from support.npu_limits import DSV3, INSERT_CASES, LIMIT_CASES, QWEN, insert_npu_field

HW = (Path(__file__).parent / "data/hw_tiny_qwen3.yaml").read_text()


def _edit(text: str, key: str, new: str) -> tuple[str, int]:
    """Replace the value of the first ``key:`` line; returns (text, 1-based line of that key)."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        m = re.match(rf"^(\s*{re.escape(key)}:)\s*\S.*$", line)
        if m:
            lines[i] = f"{m.group(1)} {new}\n"
            return "".join(lines), i + 1
    raise AssertionError(key)


def _validate(tmp_path, text, capsys, name="spec.yaml"):
    p = tmp_path / name
    p.write_text(text)
    rc = main(["validate", str(p)])
    out = capsys.readouterr()
    return rc, out.out, out.err, p


@pytest.mark.parametrize("text,name", [(QWEN, "qwen3_32b"), (DSV3, "deepseek_v3_1"), (HW, "hw_tiny_qwen3")])
def test_shipped_npu_specs_validate_clean(tmp_path, capsys, text, name):
    rc, out, err, p = _validate(tmp_path, text, capsys, f"{name}.yaml")
    assert rc == 0, err
    assert f"{p}: ok" in out and "NPU kernel limits ok" in out


CASES = LIMIT_CASES  # one table, shared with the other limit test (tests/support/npu_limits.py)


@pytest.mark.parametrize("base,key,new,path,row", CASES, ids=[f"{c[0]}-{c[1]}={c[2]}-{c[4]}" for c in CASES])
def test_validate_rejects_a_spec_outside_a_documented_limit(tmp_path, capsys, base, key, new, path, row):
    text, line = _edit(QWEN if base == "qwen" else DSV3, key, new)
    rc, out, err, p = _validate(tmp_path, text, capsys)
    assert rc == 2, (out, err)
    limit = BY_KEY[row]
    hits = [l for l in err.splitlines() if f"[{row}]" in l]
    assert hits, err
    # file:line of the edited field, the limit in words, the offending value, the doc source
    assert hits[0].startswith(f"{p}:{line}:"), (hits[0], line)
    assert limit.text in hits[0] and f"source: {limit.source}" in hits[0] and path in hits[0]
    assert new.split(",")[0].strip("[") in hits[0]
    assert "fix: change" in err and "Traceback" not in err


@pytest.mark.parametrize("base,line,path,row", INSERT_CASES, ids=[f"{c[0]}-{c[3]}" for c in INSERT_CASES])
def test_validate_rejects_a_bucket_field_outside_a_documented_limit(tmp_path, capsys, base, line, path, row):
    text = insert_npu_field(QWEN if base == "qwen" else DSV3, line)
    at = text.splitlines().index(line.splitlines()[0]) + 1  # the offending field is the first inserted line
    rc, out, err, p = _validate(tmp_path, text, capsys)
    assert rc == 2, (out, err)
    hits = [l for l in err.splitlines() if f"[{row}]" in l]
    assert hits and hits[0].startswith(f"{p}:{at}:"), err
    assert BY_KEY[row].text in hits[0] and f"source: {BY_KEY[row].source}" in hits[0] and path in hits[0]
    assert "fix: change" in err


def test_every_limit_row_but_the_compile_option_has_a_spec_case():
    """Each row a spec field can break has a failing-spec case; fia.tnd.tiling_sink / fia2.tnd.tiling_sink
    are a compile option (the module's TILING_SINK), refused by the stand-in (tests/npu/test_static_decode.py)."""
    from graphgen.npu.check.speclimits import CHECKS

    spec_rows = {c[4] for c in LIMIT_CASES} | {c[3] for c in INSERT_CASES}
    # moe_gating.groups: the spec loader itself rejects every spec that would break it (e.g. "num_experts_per_tok
    # (8) exceeds the 4 experts in the topk_group (4) groups kept per token"), so no spec reaches the row
    assert {c.row for c in CHECKS} - {"moe_gating.groups"} <= spec_rows, {c.row for c in CHECKS} - spec_rows
    assert {"fia2.decode.dims", "fia2.gqa.ratio", "fia2.mla.heads", "fia.tnd.sequences"} <= spec_rows


def test_every_violation_of_a_spec_is_reported_at_once(tmp_path, capsys):
    text, l1 = _edit(QWEN, "dtype", "float32")
    text, l2 = _edit(text, "head_dim", "96")
    rc, _, err, p = _validate(tmp_path, text, capsys)
    assert rc == 2
    assert f"{p}:{l1}:" in err and f"{p}:{l2}:" in err and "2 error(s)" in err


def test_spec_without_npu_target_is_not_held_to_the_kernel_limits(tmp_path, capsys):
    text = HW.replace("  npu:\n    compile_modes: [max-autotune]\n", "")
    assert "npu:" not in text
    text, _ = _edit(text, "head_dim", "16")
    rc, out, err, _ = _validate(tmp_path, text, capsys)
    assert rc == 0, err and "NPU kernel limits" not in out


# ---- NpuTarget bucket fields: loader errors with file:line and the fix ------------------------------

def _with_npu(extra: str) -> str:
    return HW.replace("    compile_modes: [max-autotune]\n", "    compile_modes: [max-autotune]\n" + extra)


@pytest.mark.parametrize("extra,key,words", [
    ("    decode_batch_buckets: [1, 4, 2]\n", "decode_batch_buckets", "must be ascending: 2 after 4"),
    ("    decode_batch_buckets: [1, 2, 2]\n", "decode_batch_buckets", "2 is listed twice"),
    ("    prefill_token_buckets: [256, 128]\n", "prefill_token_buckets", "must be ascending"),
    ("    prefill_seqs: 4\n    prefill_token_buckets: [4, 128]\n", "prefill_token_buckets",
     "smaller than prefill_seqs + 1 = 5"),
    ("    decode_batch_buckets: []\n", "decode_batch_buckets", "is empty"),
    ("    decode_batch_buckets: [0, 1]\n", "decode_batch_buckets", "must be >= 1"),
    ("    max_model_len: 64\n", "max_model_len", "shorter than one block"),
    ("    max_model_len: 8192\n", "max_model_len", "exceeds the model's max_position_embeddings (4096)"),
    ("    dtype: float32\n", "dtype", "is not one of bfloat16, float16"),
    ("    staging_buffers: 0\n", "staging_buffers", "must be >= 1"),
])
def test_bad_npu_bucket_fields_name_file_line_and_fix(tmp_path, capsys, extra, key, words):
    text = _with_npu(extra)
    lines = text.splitlines()
    start = lines.index("  npu:")
    line = next(i + 1 for i, l in enumerate(lines) if i > start and l.strip().startswith(f"{key}:"))
    rc, _, err, p = _validate(tmp_path, text, capsys)
    assert rc == 2, err
    assert f"{p}:{line}:" in err and words in err and "fix:" in err, err


def test_npu_bucket_fields_reach_the_buckets():
    from graphgen.modelspec.loader import parse_spec_text
    from graphgen.npu.run.bucketing import Buckets

    spec = parse_spec_text(_with_npu("    decode_batch_buckets: [1, 3]\n    prefill_token_buckets: [128, 384]\n"
                                     "    prefill_seqs: 3\n    max_model_len: 1000\n"), "x.yaml")
    b = Buckets.from_spec(spec)
    assert (b.decode_batch, b.prefill_tokens, b.prefill_seqs) == ((1, 3), (128, 384), 3)
    assert b.max_blocks == 8 and b.save_rows == 384 // 128   # ceil(1000 / 128); largest bucket / block
    d = Buckets.from_spec(parse_spec_text(HW, "hw.yaml"))
    assert d.max_blocks == 4096 // 128 and d.decode_batch == (1, 2, 4, 8)
