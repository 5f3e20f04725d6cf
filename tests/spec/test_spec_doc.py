"""docs/spec.md's field tables and matrix are generated from the code and must be in sync."""

from __future__ import annotations

from pathlib import Path

from graphgen.modelspec.schema import DOC_BEGIN, DOC_END, markdown_tables

DOC = Path(__file__).resolve().parents[2] / "docs" / "spec.md"


def test_spec_doc_tables_in_sync():
    text = DOC.read_text()
    assert text.count(DOC_BEGIN) == 1 and text.count(DOC_END) == 1
    start = text.index(DOC_BEGIN)
    end = text.index(DOC_END) + len(DOC_END) + 1
    assert text[start:end] == markdown_tables(), (
        "docs/spec.md is stale: rerun python -m graphgen.modelspec.schema --write-doc")


def test_spec_doc_example_is_a_shipped_spec():
    # The example in the doc is the tiny Qwen3 spec verbatim, so it is known to load.
    text = DOC.read_text()
    spec = (DOC.parents[1] / "specs" / "tiny_qwen3.yaml").read_text()
    assert f"```yaml\n{spec}```" in text
