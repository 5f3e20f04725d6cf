"""The one door from a spec to target source: run the pass pipeline per variant and render it.

:func:`compile_spec` is the door: every (variant, target) of a spec with its verified graph and its
sources by ``generated/`` path. The file writer (``graphgen.generate``) uses it (it also prints the
graph as golden text); :func:`compile_variant`, for the runtimes, which need one module's source and
nothing else, goes through it too. Rendering (:func:`render_graph`) takes the graph alone, plus the
NPU target's options (:class:`~graphgen.lower.npu.NpuOptions`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

from ..install import source_checkout
from ..passes.manager import run_pipeline
from .cpu import render_cpu
from .npu import NpuOptions, render_npu

if TYPE_CHECKING:
    from ..ir.graph import Graph
    from ..modelspec.model import ModelSpec, NpuTarget

TARGETS = ("cpu", "npu")


def display_path(path: str | Path) -> str:
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
    if mode is None:
        raise ValueError("an NPU module's path names its compile mode")
    return f"{spec_name}/npu/{mode_dir(mode)}/{variant}.py"


def npu_options(npu_target: NpuTarget, mode: str) -> NpuOptions:
    """The NPU lowering options for one compile mode of a spec's ``targets.npu`` section."""
    return NpuOptions(mode=mode, save_stream_tag=npu_target.save_stream_tag,
                      save_stream_priority=npu_target.save_stream_priority)


def render_graph(graph: Graph, target: str, options: Optional[NpuOptions] = None) -> str:
    """Source of one verified graph for ``target`` (``options``: required for the NPU target)."""
    if target == "cpu":
        return render_cpu(graph)
    if target == "npu":
        if options is None:
            raise ValueError("the npu target needs NpuOptions (compile mode, save stream)")
        return render_npu(graph, options)
    raise ValueError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")


class Compiled(NamedTuple):
    """One variant lowered for one target: the verified graph and its sources (``module_path`` -> text;
    one per compile mode on the NPU target)."""
    variant: str
    target: str
    graph: Graph
    sources: dict[str, str]


def compile_spec(spec: ModelSpec, *, spec_file: str = "", check: bool = True, variants: Optional[Sequence[str]] = None,
                 targets: Optional[Sequence[str]] = None, modes: Optional[Sequence[str]] = None) -> list[Compiled]:
    """Pipeline + render for each variant (default: all, in spec order) and target (default: the ones
    the spec enables, ``cpu`` before ``npu``), each NPU source once per mode (default: the spec's
    ``compile_modes``). ``check`` runs every pass's requires/ensures (the verify pass runs either way);
    nothing is written."""
    if targets is None:
        targets = [t for t in TARGETS if getattr(spec.targets, t) is not None]
    for target in targets:
        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    npu = spec.targets.npu
    if "npu" in targets and npu is None:
        raise ValueError(f"spec {spec.name} does not declare the npu target")
    compiled = []
    for variant in spec.variants if variants is None else variants:
        graph = run_pipeline(spec, variant, spec_file=spec_file, check=check)
        for target in targets:
            if target == "cpu":
                sources = {module_path(spec.name, variant, "cpu"): render_graph(graph, "cpu")}
            else:
                assert npu is not None  # refused above
                sources = {module_path(spec.name, variant, "npu", m): render_graph(graph, "npu", npu_options(npu, m))
                           for m in (npu.compile_modes if modes is None else modes)}
            compiled.append(Compiled(variant, target, graph, sources))
    return compiled


def compile_variant(spec: ModelSpec, variant: str, target: str = "cpu", *, mode: Optional[str] = None,
                    spec_file: str = "", check: bool = True) -> str:
    """Source of one variant for one target (NPU: ``mode``, default the spec's first compile mode),
    through :func:`compile_spec`; nothing written."""
    if target == "npu" and mode is None and spec.targets.npu is not None:
        mode = spec.targets.npu.compile_modes[0]
    (one,) = compile_spec(spec, spec_file=spec_file, check=check, variants=(variant,), targets=(target,),
                          modes=None if mode is None else (mode,))
    (source,) = one.sources.values()
    return source
