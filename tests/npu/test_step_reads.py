"""Gather rows only for the modules that read them, and S checked against the TND limit (audit 3 N9).

Every prefill/mixed step built ``kv_gather_rows`` (S = (B - 1) * max_blocks * BS + T ints: 9,216 per plain
Qwen3-32B bucket, 41,984 per DeepSeek mixed cell) on the host, in Python, though only DeepSeek's
splitfuse reads them. A generated module now lists the step fields it reads (``STEP_READS``, from the
emitted code), the runner builds the rows only for a module that reads them, and the rows are built
per sequence in torch, not per row in Python. The S a history graph gathers goes into TND attention as
its key length, so `graphgen validate` checks it against the documented T <= 65536."""
from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.npu.run.inputs import gather_rows, npu_step_inputs

ROOT = Path(__file__).resolve().parents[2]
NPU_SPECS = ["qwen3_32b", "deepseek_v3_1", "deepseek_v3_1_dp_ep", "deepseek_v3_1_mtp", "tiny_qwen3_npu",
             "tiny_deepseek_v3_npu"]


def _const(path: Path, name: str):
    """A module-level constant of a generated module, read from its one line (the modules are large)."""
    with path.open() as f:
        for line in f:
            if line.startswith(f"{name} = "):
                src = line
                while src.count("(") > src.count(")"):
                    src += next(f)
                return ast.literal_eval(src.split(" = ", 1)[1])
    raise AssertionError(f"{path}: no {name}")


@pytest.mark.parametrize("name", ["tiny_qwen3_npu", "tiny_deepseek_v3_npu"])  # the full-size ones: same template
def test_step_reads_lists_exactly_the_fields_the_module_reads(name):
    for path in sorted((ROOT / "generated" / name / "npu").rglob("*.py")):
        read = {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "b"}  # b.<field> in the code
        assert set(_const(path, "STEP_READS")) <= set(_const(path, "STEP_FIELDS")), path
        assert read == set(_const(path, "STEP_READS")), path  # not vacuous: a field left out is never read


def test_only_deepseeks_history_graphs_read_gather_rows():
    reads = {p.relative_to(ROOT / "generated").as_posix(): "kv_gather_rows" in _const(p, "STEP_READS")
             for name in NPU_SPECS for p in (ROOT / "generated" / name / "npu").rglob("*.py")}
    assert reads["qwen3_32b/npu/max_autotune/splitfuse.py"] is False
    assert reads["qwen3_32b/npu/max_autotune/mempool_prefill.py"] is False
    assert reads["deepseek_v3_1/npu/max_autotune/splitfuse.py"] is True
    assert reads["deepseek_v3_1/npu/max_autotune/mempool_prefill.py"] is False
    assert sorted(k for k, v in reads.items() if v) == sorted(k for k in reads if k.split("/")[-1].startswith(
        ("splitfuse", "mtp_draft")) and "deepseek" in k), reads


def test_inputs_without_gather_rows_for_a_module_that_does_not_read_them():
    kw = dict(input_ids=[1, 2, 3], positions=[4, 5, 6], slot_mapping=[4, 5, 6], block_tables=[[2, 3]],
              seq_lens=[7], query_lens=[3], logits_indices=[2], block_size=4)
    assert npu_step_inputs(**kw, gather=False).kv_gather_rows is None
    assert npu_step_inputs(**kw).kv_gather_rows.tolist() == [8, 9, 10, 11, 12, 13, 14]  # the old default


def test_vectorised_gather_rows_equal_the_per_row_form():
    rnd = random.Random(3)
    for _ in range(20):
        bs, b = rnd.choice([4, 16, 128]), rnd.randint(1, 4)
        lens = [rnd.randint(1, 5 * bs) for _ in range(b)]
        tables = [[rnd.randrange(100) for _ in range(-(-n // bs))] for n in lens]
        want = [t[p // bs] * bs + p % bs for t, n in zip(tables, lens) for p in range(n)]
        rows = sum(lens) + rnd.randint(0, 9)
        assert gather_rows(tables, lens, bs, rows, pad_block=7).tolist() == want + [7 * bs] * (rows - sum(lens))
    with pytest.raises(ValueError, match="exceed the bucket"):
        gather_rows([[1]], [4], 4, rows=3)


@pytest.mark.parametrize("name", NPU_SPECS)
def test_the_validate_check_of_S_uses_the_runtimes_lengths(name):
    """speclimits is torch-free, the runtime's buckets are not: the two computations of S (and of the
    context length) agree on every shipped NPU spec."""
    from graphgen.npu.check import speclimits
    from graphgen.npu.run.bucketing import Buckets, max_model_len
    from graphgen.npu.run.mixed_grid import MixedGrid

    spec = load_spec(ROOT / "specs" / f"{name}.yaml")
    assert speclimits._max_model_len(spec) == max_model_len(spec)
    b = Buckets.from_spec(spec)
    grid = MixedGrid.from_buckets(b)
    bs = spec.kv_cache.block_size
    pads = [b.padding("prefill", b.prefill_seqs, t - b.prefill_seqs - 1) for t in b.prefill_tokens]
    pads += [grid.padding(s, 0) for s in grid.cell_steps(bs)]
    assert speclimits._max_gather_rows(spec) == max(p.gather_rows(bs) for p in pads)
    assert speclimits._max_gather_rows(spec) <= 65536  # the shipped specs fit the TND limit
