"""`graphgen compile --target npu --spec S [--variant V] [--mode M] --standin --steps N`: a mixed loop per
variant and mode through the CPU stand-in, padded to the spec's buckets; graphs compiled vs buckets.

What this proves: the CLI wiring (buckets from the spec, every variant/mode, the exit status) on top of
``run_standin_loop``, whose counting is tested in test_buckets.py.  The count is Dynamo/AOT graphs on
CPU -- what each GE compile would cost on an NPU; nothing here ran on an NPU.

The commands run in this interpreter (`support.inproc.cli_inproc`): the entry point of ``graphgen compile``
is proven by a real subprocess in test_compile_cli.py.  The 24-step run is the session's ``hw_steps``
(tests/npu/conftest.py), whose loop results test_buckets.py checks too.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from graphgen.npu.standin import fakes as standin
from support.inproc import cli_inproc
from support.standin import STANDIN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
HW = Path(__file__).parent / "data/hw_tiny_qwen3.yaml"
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
LINE = re.compile(r"^(\w+)\s+([\w-]+)\s+steps=(\d+)\s+graphs compiled=(\d+)\s+buckets=(\d+)\s+(.*)$", re.M)


def _compile(*args):
    return cli_inproc("compile", "--target", "npu", *args, timeout=STANDIN_TIMEOUT_S)


def test_hardware_shaped_spec_compiles_at_most_one_graph_per_bucket_in_24_steps(hw_steps):
    res = hw_steps.res
    assert res.returncode == 0, res.stdout + res.stderr
    rows = LINE.findall(res.stdout)
    # every variant of the spec, in its one declared mode, 24 steps each
    assert sorted((v, m) for v, m, *_ in rows) == [("decode", "max-autotune"), ("mempool_prefill", "max-autotune"),
                                                    ("splitfuse", "max-autotune")]
    for v, m, steps, graphs, buckets, verdict in rows:
        assert steps == "24" and 1 <= int(graphs) <= int(buckets) == 4 and verdict == "ok", rows
    assert "nothing ran on an NPU" in res.stdout


def test_more_graphs_than_buckets_exits_1(monkeypatch, capsys):
    """Negative control: claim a single bucket per phase; the decode loop (varying batch) compiles more.  Its
    first two steps already visit two batch buckets (1 and 8): two graphs, the smallest run that shows it."""
    from graphgen.cli import main
    from graphgen.npu.run import bucketing

    monkeypatch.setattr(bucketing.Buckets, "count", lambda self, phase: 1)
    rc = main(["compile", "--target", "npu", "--spec", str(HW), "--variant", "decode", "--standin", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 1, out
    (row,) = LINE.findall(out)
    assert row[0] == "decode" and int(row[3]) > 1 and row[4] == "1" and row[5] == "MORE GRAPHS THAN BUCKETS"


def test_a_spec_outside_the_kernel_limits_exits_2_naming_the_limit(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(HW.read_text().replace("  dtype: bfloat16", "  dtype: float32"))
    res = _compile("--spec", str(bad), "--variant", "decode", "--standin", "--steps", "2")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "[fia.dtype]" in res.stderr and f"{bad}:" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_steps_without_standin_and_without_torch_npu_exits_3_with_one_sentence():
    standin.uninstall()  # a stand-in left in sys.modules would be imported as torch_npu (and refused otherwise)
    assert "torch_npu" not in sys.modules and "torchair" not in sys.modules
    res = _compile("--spec", str(HW), "--steps", "4")
    assert res.returncode == 3
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Ascend machine with CANN installed" in lines[0]


def test_variant_is_required_without_steps():
    res = _compile("--spec", str(HW), "--standin")
    assert res.returncode == 2 and "--variant is required" in res.stderr


def test_deepseek_splitfuse_compiles_at_most_one_graph_per_bucket():
    """The un-absorbed MLA splitfuse gathers each sequence's history through its block table; that gather
    must not make the graph depend on the lengths (a per-length gather compiled 7 graphs for 4 buckets
    in 24 steps).  16 steps of varying history and new-token lengths."""
    res = _compile("--spec", str(ROOT / "specs/tiny_deepseek_v3_npu.yaml"), "--variant", "splitfuse",
                   "--standin", "--steps", "16")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = LINE.findall(res.stdout)
    assert [r[0] for r in rows] == ["splitfuse"]
    assert 1 <= int(rows[0][3]) <= int(rows[0][4]) and rows[0][5] == "ok", rows
