"""Executing generated CPU modules: loading them, and the ``rt`` object they call.

Generated code calls ``rt.<op>(...)`` for every IR node, ``rt.record``/``rt.wait`` for events and
``rt.launch(stream, fn)`` to start a non-main stream's program. :class:`CpuRuntime` forwards ops to
:mod:`graphgen.runtime.core.ops`, runs the save stream's program on a worker thread (the main stream is
the caller's thread: its ops simply run), and applies fault injection (delays) where the hooks
belong: before each KV write (forward stream) and inside each save. The model runner gives each
step a view of it (`graphgen.runtime.engine.runner.StepRuntime`) that keeps what the step launched.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Callable, Optional

from ...ir.graph import LOAD_STREAM, SAVE_STREAM
from . import ops as _ops
from .faults import Faults
from .streams import Job, Stream


class CpuRuntime:
    def __init__(self, faults: Optional[Faults] = None, event_timeout: Optional[float] = 120.0):
        self.faults = faults or Faults()
        self.event_timeout = event_timeout
        # worker-thread streams, by IR stream name
        self.streams = {SAVE_STREAM: Stream(SAVE_STREAM), LOAD_STREAM: Stream(LOAD_STREAM)}

    # -- streams and events ----------------------------------------------------------------------
    def start(self, stream: str, fn: Callable[[], None]) -> Job:
        """Queue ``fn`` on ``stream``'s worker thread."""
        try:
            s = self.streams[stream]
        except KeyError:
            raise ValueError(f"generated code launched on stream {stream!r}; the CPU runtime has "
                             f"{sorted(self.streams)} (the main stream is the caller's thread)") from None
        return s.launch(fn)

    def record(self, ev) -> None:
        ev.record()

    def wait(self, ev) -> None:
        ev.wait(self.event_timeout)

    # -- ops with fault hooks --------------------------------------------------------------------
    def kv_write(self, cache, values, slot_mapping) -> None:
        self.faults.forward_sleep()  # "delay the forward stream": the KV lands late
        _ops.kv_write(cache, values, slot_mapping)

    def kv_save(self, cache, block_ids, staging) -> None:
        self.faults.save_sleep()  # "delay the save stream"
        _ops.kv_save(cache, block_ids, staging)

    def kv_save_layers(self, kv, layers, block_ids, staging) -> None:
        """The bulk (forward-granularity) save: every listed layer, in order."""
        for i in layers:
            self.kv_save(kv[i], block_ids, staging[i])

    def kv_load(self, cache, loads, block_ids) -> None:
        self.faults.load_sleep()  # "delay the load stream": the history lands late
        _ops.kv_load(cache, loads, block_ids)

    def kv_load_layers(self, kv, layers, loads, block_ids) -> None:
        """The bulk (forward-granularity) load: every listed layer, in order."""
        for i in layers:
            self.kv_load(kv[i], loads[i], block_ids)

    def __getattr__(self, name: str):
        # Every other op is the reference op itself, bound on first use so that later calls are a
        # plain attribute lookup (a decode step makes ~200 ``rt.<op>`` calls).
        try:
            op = getattr(_ops, name)
        except AttributeError:
            raise AttributeError(f"generated code called rt.{name}, which graphgen.runtime.core.ops lacks") from None
        setattr(self, name, op)
        return op

    def close(self) -> None:
        for s in self.streams.values():
            s.close()


def load_module(source: str, filename: str, name: str) -> types.ModuleType:
    """Execute generated source as a module without writing bytecode next to generated/."""
    mod = types.ModuleType(name)
    mod.__file__ = filename
    exec(compile(source, filename, "exec"), mod.__dict__)
    return mod


def load_cpu_modules(spec, spec_file: str, *, generated_dir: Optional[Path] = None,
                     source_hook: Optional[Callable[[str, str], str]] = None,
                     sources: Optional[dict[str, str]] = None) -> dict[str, types.ModuleType]:
    """The CPU module of every variant of ``spec``, compiled in memory (fast, torch-free), or taken
    from ``sources`` (variant -> source) when the caller compiled them already (a rank process gets
    them from the launcher, which compiled them once for every rank).

    When ``generated/`` holds the identical file, its path is used as the module's filename so
    tracebacks point at the checked-in code. ``source_hook(variant, source) -> source`` exists for
    tests that mutate generated code on purpose (e.g. drop a wait to show the event matters).
    """
    from ...lower.compile import compile_variant, module_path

    mods = {}
    for variant in spec.variants:
        rel = module_path(spec.name, variant, "cpu")
        source = sources[variant] if sources is not None else compile_variant(spec, variant, "cpu", spec_file=spec_file)
        filename = f"<graphgen:{rel}>"
        if generated_dir is not None:
            on_disk = Path(generated_dir) / rel
            if on_disk.exists() and on_disk.read_text(encoding="utf-8") == source:
                filename = str(on_disk)
        if source_hook is not None:
            mutated = source_hook(variant, source)
            if mutated != source:
                source, filename = mutated, f"<graphgen:{rel} (mutated by a test)>"
        mods[variant] = load_module(source, filename, f"graphgen_generated.{spec.name}.{variant}")
    return mods
