"""`graphgen compile --target npu`: one clear sentence without torch_npu; stand-in structure check.

The first test is the command's entry point, a real subprocess in a fresh interpreter (where neither
torch_npu nor the stand-in's fake of it is importable); the others run the CLI in this interpreter
(`support.inproc.cli_inproc`), and the stand-in trace is the session's (``standin_trace``, tests/npu/conftest.py).
"""

import importlib.util
import subprocess
import sys

import pytest
from support.inproc import cli_inproc
from support.paths import REPO
from support.standin import STANDIN_TIMEOUT_S


@pytest.mark.slow  # a graphgen process (the real entry point, no torch_npu)
@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_without_torch_npu_compile_fails_with_one_sentence_and_exit_3():
    res = subprocess.run([sys.executable, "-m", "graphgen.cli", "compile", "--target", "npu", "--spec",
                          "specs/tiny_qwen3_npu.yaml", "--variant", "decode"], cwd=REPO, capture_output=True,
                         text=True, timeout=STANDIN_TIMEOUT_S)
    assert res.returncode == 3
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr
    assert "NPU compilation needs an Ascend machine with CANN installed" in lines[0]


def test_standin_trace_reports_structure_only(standin_trace, monkeypatch):
    from graphgen.npu.run import structure

    monkeypatch.setattr(structure, "trace", standin_trace)  # the module's trace, shared with test_npu_generated
    res = cli_inproc("compile", "--target", "npu", "--spec", "specs/tiny_qwen3_npu.yaml", "--variant",
                     "mempool_prefill_layer", "--mode", "max-autotune", "--standin", timeout=STANDIN_TIMEOUT_S)
    assert res.returncode == 0, res.stderr
    assert "post-AOT structure ok" in res.stdout and "nothing ran on an NPU" in res.stdout


def test_compile_rejects_unknown_variant_and_mode():
    res = cli_inproc("compile", "--target", "npu", "--spec", "specs/qwen3_32b.yaml", "--variant", "nope")
    assert res.returncode == 2 and "no variant 'nope'" in res.stderr
    res = cli_inproc("compile", "--target", "npu", "--spec", "specs/qwen3_32b.yaml", "--variant", "decode", "--mode",
                     "reduce-overhead")
    assert res.returncode == 2 and "is not generated" in res.stderr


def test_standin_check_catches_a_dropped_wait(tmp_path, monkeypatch):
    """The CLI's check is the real aotcheck: a module without its wait fails it."""
    from graphgen.npu.run.structure import trace_and_check
    from graphgen.modelspec.loader import load_spec

    src = (REPO / "generated/tiny_qwen3_npu/npu/max_autotune/mempool_prefill_layer.py").read_text()
    lines = [l for l in src.splitlines(keepends=True) if "# L01.kv_save.wait" not in l]
    assert len(lines) == len(src.splitlines()) - 1
    bad = tmp_path / "mempool_prefill_layer.py"
    bad.write_text("".join(lines))
    report = trace_and_check(bad, load_spec(REPO / "specs/tiny_qwen3_npu.yaml"))
    assert not report.ok and any("wait" in p for p in report.problems), report.problems
