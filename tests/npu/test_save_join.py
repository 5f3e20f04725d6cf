"""The explicit save join of NPU graphs (issue 15 item 4, audit 2 row 8), on the CPU STAND-IN.

A saving NPU module records an event at the end of its save scope and waits on it on the main stream
before the op producing the logits, so the event the runner records after the graph covers the save
whatever GE does at the end of a graph.  ``aotcheck.check_save_join`` proves that edge in the post-AOT
graph (graph structure only: nothing here runs GE or an NPU); deleting or misplacing the wait fails it.
The CPU target keeps its host-event commit: its logits never wait for the save.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from graphgen.lower.compile import compile_variant
from graphgen.modelspec.loader import load_spec
from graphgen.npu.check import aotcheck
from graphgen.npu.standin import fakes as standin

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "tiny_qwen3_npu.yaml"
VARIANT = "mempool_prefill_layer"  # two save scopes, one save -> host event
needs_standin = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


def _src(mode):
    # as generate renders it (spec_file as in generated/): the unmutated module's trace is the session's
    # (standin_trace, tests/npu/conftest.py), shared with test_npu_generated's post-AOT structure test
    return compile_variant(load_spec(SPEC), VARIANT, "npu", mode=mode, spec_file="specs/tiny_qwen3_npu.yaml")


def _problems(trace, src, mode="max-autotune"):
    t = trace(ROOT / "generated" / "tiny_qwen3_npu" / "npu" / mode.replace("-", "_") / f"{VARIANT}.py",
              load_spec(SPEC), src)
    return t.module.GRAPH, aotcheck.check_save_join(t.graph.gm, t.module.GRAPH), t.problems()


def _lines(src):
    return src.splitlines()


def _join_index(lines):
    (i,) = [k for k, line in enumerate(lines) if line.rstrip().endswith("# save.join")]
    return i


@pytest.mark.parametrize("rel", ["tiny_qwen3_npu/npu/max_autotune/mempool_prefill.py",
                                 "tiny_deepseek_v3_npu/npu/max_autotune/splitfuse_layer.py",
                                 "qwen3_32b/npu/max_autotune/mempool_prefill.py",
                                 "deepseek_v3_1/npu/max_autotune/mempool_prefill.py"])
def test_saving_modules_join_before_the_logits(rel):
    lines = (ROOT / "generated" / rel).read_text().splitlines()
    i = _join_index(lines)
    assert lines[i].strip().startswith("torchair.ops.wait([ev_") and lines[i].startswith("    torch")  # main stream
    assert lines[i + 1].lstrip().startswith("logits = ") or "# lm_head" in lines[i + 1]
    ev = lines[i].split("[", 1)[1].split("]", 1)[0]
    rec = next(k for k, line in enumerate(lines) if line.strip().startswith(f"{ev} = torchair.ops.record()"))
    assert rec < i and lines[rec].startswith("        ")  # inside the save scope


def test_decode_has_no_join_and_cpu_keeps_the_host_event():
    spec = load_spec(SPEC)
    assert "# save.join" not in compile_variant(spec, "decode", "npu", mode="max-autotune")  # saves nothing
    cpu = compile_variant(spec, "mempool_prefill", "cpu")
    assert "HOST_EVENT = 'ev.save.kv_save'" in cpu and "# save.join" not in cpu


@needs_standin
@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_join_holds_and_dropping_it_fails(mode, standin_trace):
    src = _src(mode)
    graph, join, _ = _problems(standin_trace, src, mode)
    assert join == []
    lines = _lines(src)
    i = _join_index(lines)
    lines[i] = "    pass  # join dropped"
    graph, join, all_problems = _problems(standin_trace, "\n".join(lines) + "\n", mode)
    assert join and all(p.startswith(f"{graph}: ") and "not joined to the main stream" in p for p in join), join
    assert set(join) <= set(all_problems)  # structure.Traced.problems runs it (graphgen compile --standin)


@needs_standin
def test_join_after_the_logits_fails(standin_trace):
    lines = _lines(_src("max-autotune"))
    i = _join_index(lines)
    wait = lines.pop(i)
    ret = next(k for k, line in enumerate(lines) if line.strip() == "return logits")
    lines.insert(ret, wait)
    graph, join, _ = _problems(standin_trace, "\n".join(lines) + "\n")
    assert any(p.startswith(f"{graph}: ") and "which the output does not depend on" in p for p in join), join
