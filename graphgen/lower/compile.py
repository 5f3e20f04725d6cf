"""The one entry from a spec to target source: run the pass pipeline on one variant and render it.

Used by the file writer (``graphgen.generate``) and by the runtimes, which need a module's source
and nothing else: no golden text, no file paths, no spec surgery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..passes.manager import run_pipeline
from .render import render

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("cpu", "npu")


def display_path(path) -> str:
    """Stable, machine-independent name of a spec file for headers (never an absolute path)."""
    p = Path(path).resolve()
    for base in (Path.cwd().resolve(), REPO_ROOT):
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


def render_graph(graph, target: str, *, mode: Optional[str] = None, spec=None) -> str:
    """Source of one verified graph for ``target`` (``mode``: the NPU compile mode)."""
    if target == "cpu":
        return render("cpu/variant.py.j2", graph)
    if target == "npu":
        npu = spec.targets.npu
        return render("npu/variant.py.j2", graph, mode=mode, stream_tag=npu.save_stream_tag,
                      stream_priority=npu.save_stream_priority, spec=spec)
    raise ValueError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")


def compile_variant(spec, variant: str, target: str = "cpu", *, mode: Optional[str] = None,
                    spec_file: str = "") -> str:
    """Source of one variant for one target: pipeline + render, nothing written."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    if target == "npu":
        if spec.targets.npu is None:
            raise ValueError(f"spec {spec.name} does not declare the npu target")
        mode = mode or spec.targets.npu.compile_modes[0]
    graph = run_pipeline(spec, variant, spec_file=spec_file)
    return render_graph(graph, target, mode=mode, spec=spec)
