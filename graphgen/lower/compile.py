"""The one entry from a spec to target source: run the pass pipeline on one variant and render it.

Used by the file writer (``graphgen.generate``) and by the runtimes, which need a module's source
and nothing else: no golden text, no file paths, no spec surgery. Rendering (:func:`render_graph`)
takes the graph alone, plus the NPU target's options (:class:`~graphgen.lower.npu.NpuOptions`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..install import source_checkout
from ..passes.manager import run_pipeline
from .cpu import render_cpu
from .npu import NpuOptions, render_npu

TARGETS = ("cpu", "npu")


def display_path(path) -> str:
    """Stable, machine-independent name of a spec file for headers (never an absolute path): relative
    to the working folder, else to the source checkout (when there is one), else the bare name."""
    p = Path(path).resolve()
    for base in (Path.cwd().resolve(), source_checkout()):
        if base is None:  # an installed wheel: no checkout to be relative to
            continue
        try:
            return p.relative_to(base).as_posix()
        except ValueError:
            continue
    return p.name


def mode_dir(mode: str) -> str:
    """Folder name of an NPU compile mode (``max-autotune`` -> ``max_autotune``)."""
    return mode.replace("-", "_")


def module_path(spec_name: str, variant: str, target: str, mode: Optional[str] = None) -> str:
    """Where ``graphgen generate`` writes a variant's module, relative to the output folder."""
    if target == "cpu":
        return f"{spec_name}/cpu/{variant}.py"
    return f"{spec_name}/npu/{mode_dir(mode)}/{variant}.py"


def npu_options(npu_target, mode: str) -> NpuOptions:
    """The NPU lowering options for one compile mode of a spec's ``targets.npu`` section."""
    return NpuOptions(mode=mode, save_stream_tag=npu_target.save_stream_tag,
                      save_stream_priority=npu_target.save_stream_priority)


def render_graph(graph, target: str, options: Optional[NpuOptions] = None) -> str:
    """Source of one verified graph for ``target`` (``options``: required for the NPU target)."""
    if target == "cpu":
        return render_cpu(graph)
    if target == "npu":
        if options is None:
            raise ValueError("the npu target needs NpuOptions (compile mode, save stream)")
        return render_npu(graph, options)
    raise ValueError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")


def compile_variant(spec, variant: str, target: str = "cpu", *, mode: Optional[str] = None,
                    spec_file: str = "", check: bool = True) -> str:
    """Source of one variant for one target: pipeline + render, nothing written."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    options = None
    if target == "npu":
        if spec.targets.npu is None:
            raise ValueError(f"spec {spec.name} does not declare the npu target")
        options = npu_options(spec.targets.npu, mode or spec.targets.npu.compile_modes[0])
    graph = run_pipeline(spec, variant, spec_file=spec_file, check=check)
    return render_graph(graph, target, options)
