"""ENABLE_DYNAMIC_SHAPE_MULTI_STREAM is in the environment before torch_npu is imported (audit 3 N6).

It is a CANN process variable (torchair docs/zh/ascend_ir/features/advanced/multi_stream.md:22-26);
graphgen used to set it when the first prefill module compiled, after the decode graphs had started GE.
Now `_import_torchair`, the one place graphgen imports torch_npu, sets it first. torch_npu cannot be
imported here, so a finder stands in for it and records the environment at the moment its import runs."""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

import pytest

from graphgen.npu.run.compile import MULTI_STREAM_ENV, NpuUnavailable, _import_torchair

NAME = MULTI_STREAM_ENV[0]


class _TorchNpuProbe(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.seen = "not imported"

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.seen = os.environ.get(NAME)
        raise ImportError("no CANN here (a test finder in place of torch_npu)")


@pytest.mark.parametrize("before, expected", [(None, "1"), ("0", "0")])  # a person's own setting is kept
def test_the_multi_stream_variable_is_set_before_torch_npu_imports(monkeypatch, before, expected):
    probe = _TorchNpuProbe()
    if before is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, before)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [probe, *sys.meta_path])
    with pytest.raises(NpuUnavailable):
        _import_torchair(False)
    assert probe.seen == expected


def test_compiling_a_module_no_longer_sets_it(monkeypatch):
    """The old place (compile_module's first prefill compile) is gone: a process that imported torch_npu
    itself is warned instead, since the variable would come too late."""
    import inspect

    from graphgen.npu.run import compile as comp

    assert "MULTI_STREAM_ENV" not in inspect.getsource(comp.compile_module)
    fake = type(sys)("torch_npu")  # a real torch_npu, imported before graphgen set the variable
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.delenv(NAME, raising=False)
    with pytest.warns(RuntimeWarning, match=NAME), pytest.raises(NpuUnavailable):
        _import_torchair(False)
