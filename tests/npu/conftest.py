"""Fixtures of the NPU tests: compile once, check many.

A stand-in compile costs seconds of Dynamo and AOT per graph (docs/testing.md); these session fixtures
trace each graph once per test run and hand the result to every test that checks it.  Tests only read
what they get; a test that needs a different graph (a mutated module, a negative control) traces its own.

- ``standin_trace(path, spec, source=None)``: `graphgen.npu.run.structure.trace`, memoized per module path,
  source text and spec (test_npu_generated, test_save_join, and ``graphgen compile --standin`` in
  test_compile_cli, which reaches it through ``structure.trace``);
- ``hw_steps``: ``graphgen compile --target npu --spec tests/npu/data/hw_tiny_qwen3.yaml --standin --steps 24``
  run once in this interpreter: its output and the `LoopResult`s its `run_standin_loop` returned
  (test_compile_steps_cli checks the output, test_buckets the counts).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from support.standin import HW_TINY_QWEN3, STANDIN_TIMEOUT_S


@pytest.fixture(autouse=True, scope="module")
def _remove_standin_modules_afterwards():
    """The stand-in's fake torch_npu/torchair must not leak into other tests (transformers probes
    find_spec('torch_npu')); each test module that needs them calls standin.install() again."""
    yield
    from graphgen.npu.standin import fakes as standin

    standin.uninstall()


@pytest.fixture(scope="session")
def standin_trace():
    """``structure.trace`` memoized per (module path, source text, spec name): one trace per module per run."""
    from graphgen.npu.run import structure

    traced: dict = {}
    real = structure.trace

    def trace(module_path, spec, source=None, *, check_limits: bool = False):
        text = source if source is not None else Path(module_path).read_text()
        key = (str(Path(module_path).resolve()), text, spec.name, check_limits)
        if key not in traced:
            traced[key] = real(module_path, spec, text, check_limits=check_limits)
        return traced[key]

    return trace


@pytest.fixture(scope="session")
def hw_steps():
    """``graphgen compile --standin --steps 24`` on the hardware-shaped tiny Qwen3, every variant, once per run:
    ``.res`` (exit status, stdout, stderr) and ``.results`` (what its run_standin_loop returned)."""
    from graphgen.npu.run import bucketing
    from support.inproc import cli_inproc

    real, got = bucketing.run_standin_loop, []

    def spy(*args, **kwargs):
        got.append(real(*args, **kwargs))
        return got[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bucketing, "run_standin_loop", spy)
        res = cli_inproc("compile", "--target", "npu", "--spec", HW_TINY_QWEN3, "--standin", "--steps", "24",
                         timeout=STANDIN_TIMEOUT_S)
    assert len(got) == 1, res.stdout + res.stderr
    return SimpleNamespace(res=res, results=got[0])
