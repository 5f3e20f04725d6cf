"""The model runner: runs one generated module for one step and hands back what it started.

Per step it binds the module's events to a fresh generation (so a wait of this step can never be
satisfied by an earlier step's record), runs ``mod.run`` on the CPU runtime (with the step's loaded history blocks), and returns
`StepHandles`: the logits, the save program the module launched (a `Job` on the save stream) and
the save's event bound to this step (``HOST_EVENT``: what a commit must wait for). Nothing is
recovered afterwards from shared state: the module's launches go through a per-step view of the
runtime (`StepRuntime`) that keeps them.

If the forward raises, the step's events are aborted (the save program, blocked on an event the
forward will never record, is released with `EventAborted`), its launched jobs are waited for, and
the error propagates.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from ...ir.graph import SAVE_STREAM
from ..core.cpu_runtime import CpuRuntime
from ..core.streams import BoundEvent, EventSet, Job

__all__ = ["StepHandles", "StepRuntime", "CpuModelRunner"]


@dataclass(frozen=True)
class StepHandles:
    """What one step started. ``save_job``/``save_done`` are None when the module saves nothing."""

    logits: torch.Tensor
    save_job: Optional[Job] = None
    save_done: Optional[BoundEvent] = None


class StepRuntime:
    """``rt`` as one step's module sees it: every op and event call goes to the shared runtime;
    ``launch`` also keeps the job, per stream, for the runner to return. With an ``observer`` (see
    `graphgen.trace.StepObserver`) the save copies and the record of the step's host event (its KV
    is staged; on the save stream for ``write: async``, inline on main for ``sync``) are reported."""

    __slots__ = ("_rt", "launched", "_obs", "_t0", "_step", "_host")

    def __init__(self, rt: CpuRuntime, observer=None, forward_start: float = 0.0, step: int = 0,
                 host_event: Optional[str] = None):
        self._rt = rt
        self.launched: dict[str, Job] = {}
        self._obs, self._t0, self._step, self._host = observer, forward_start, step, host_event

    def launch(self, stream: str, fn: Callable[[], None]) -> Job:
        if stream in self.launched:  # one program per stream per step: a second one is a codegen bug
            raise RuntimeError(f"the step launched a second program on stream {stream!r}")
        job = self._rt.start(stream, fn)
        self.launched[stream] = job
        return job

    def record(self, ev) -> None:
        self._rt.record(ev)
        if self._obs is not None and ev.name == self._host:  # the step's KV is staged (either write mode)
            self._obs.save_done(self._t0, time.perf_counter(), step=self._step)

    # the save copies, timed when observed (kv_save_layers is the bulk form of kv_save)
    def kv_save(self, cache, block_ids, staging) -> None:
        if self._obs is None:
            return self._rt.kv_save(cache, block_ids, staging)
        t = time.perf_counter()
        self._rt.kv_save(cache, block_ids, staging)
        self._obs.save_copy(t, time.perf_counter(), blocks=len(block_ids))

    def kv_save_layers(self, kv, layers, block_ids, staging) -> None:
        if self._obs is None:
            return self._rt.kv_save_layers(kv, layers, block_ids, staging)
        t = time.perf_counter()
        self._rt.kv_save_layers(kv, layers, block_ids, staging)
        self._obs.save_copy(t, time.perf_counter(), blocks=len(block_ids), layers=len(layers))

    def __getattr__(self, name: str):
        return getattr(self._rt, name)


class CpuModelRunner:
    """Runs the generated CPU modules of one spec (``modules``: variant -> module)."""

    def __init__(self, modules: Mapping[str, types.ModuleType], weights: Mapping, cache, rt: CpuRuntime, *,
                 event_timeout: Optional[float] = 120.0):
        self.modules = dict(modules)
        self.W = weights
        self.cache = cache
        self.rt = rt
        self.events = {v: EventSet(m.EVENTS, default_timeout=event_timeout) for v, m in self.modules.items()}
        self._gen = 0  # step counter: the generation every event of a step is bound to
        self.observer = None  # a graphgen.trace.StepObserver: forward spans, save copies, save done

    def saves(self, variant: str) -> bool:
        """Whether the variant's module has a save program (then it takes a staging area)."""
        return self.modules[variant].HOST_EVENT is not None

    def execute(self, variant: str, inputs, staging=None, loads=()) -> StepHandles:
        """Run one step. ``staging``: the save's pool staging (exactly when the module saves);
        ``loads``: the loaded history blocks per layer (`KVConnector.take_loads`; empty when the
        variant loads nothing), copied into the cache by the module's kv_load stream."""
        mod = self.modules[variant]
        if (staging is None) != (mod.HOST_EVENT is None):
            raise ValueError(f"{variant}: a staging area is needed exactly when the module saves "
                             f"(HOST_EVENT={mod.HOST_EVENT!r}, staging given: {staging is not None})")
        self._gen += 1
        ev = self.events[variant].bind(self._gen)
        obs = self.observer
        t0 = time.perf_counter()
        rt = StepRuntime(self.rt, obs, t0, self._gen, mod.HOST_EVENT)
        try:
            with torch.inference_mode():
                logits = mod.run(rt, self.W, inputs, self.cache, staging, loads, ev)
        except BaseException:
            ev.abort("the forward failed")
            for job in rt.launched.values():
                job.wait()
            raise
        if obs is not None:
            obs.forward(variant, t0, time.perf_counter(), tokens=int(inputs.input_ids.numel()),
                        seqs=int(inputs.seq_lens.numel()), step=self._gen)
        return StepHandles(logits, rt.launched.get(SAVE_STREAM),
                           ev[mod.HOST_EVENT] if mod.HOST_EVENT is not None else None)
