"""CPU STAND-IN for the device streams and events the NPU commit path uses -- a MODEL, never NPU behaviour.

The commit path (`graphgen.npu.run.staging.CommitPath`) talks to a small device interface
(`graphgen.npu.run.staging.NpuStreams` on hardware: ``torch.npu.Stream``/``Event``, pinned host memory,
``non_blocking`` D2H copies). CPU torch has no streams and refuses ``pin_memory=True`` without an
accelerator, so on the stand-in that interface is modelled here:

* `ModelledStream`: a FIFO of work items run by one host thread, in issue order, asynchronously
  to the caller: what a device stream is to the host. ``wait_event(ev)`` queues a wait (later items
  run only after ``ev`` fired), as ``Stream.wait_event`` does;
* `CallerStream`: the stand-in's main stream: work runs on the caller's thread as it is issued (the
  stand-in's compiled forward is synchronous), so an event recorded on it fires at once;
* `ModelledEvent`: fires when the stream it was recorded on reaches it; ``synchronize()`` blocks the
  host until then and re-raises the first error of that stream's earlier work;
* `ModelledStreams`: the device interface over these; ``host_empty`` is an ordinary (pageable) CPU
  tensor, since nothing can be pinned here.

Tests hold a stream back deterministically by queueing a gate's ``wait`` on it (``stream.run(gate.wait)``),
as `graphgen.runtime.core.faults` gates do for the CPU save and put. What this proves is the ordering
logic of the commit path under the modelled semantics (FIFO streams, cross-stream waits on events),
not that an NPU's streams behave so (that is the CUDA-like semantics torch_npu documents; unverified here).
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional

import torch

__all__ = ["ModelledEvent", "ModelledStream", "CallerStream", "ModelledStreams"]

TIMEOUT_S = 120.0  # a modelled wait that outlasts this raises (a test bug must fail, not hang)


class ModelledEvent:
    def __init__(self):
        self._fired = threading.Event()
        self._error: Optional[BaseException] = None

    def _fire(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._fired.set()

    def record(self, stream) -> None:
        stream._record(self)

    def query(self) -> bool:
        return self._fired.is_set()

    def synchronize(self, timeout: Optional[float] = None) -> None:
        if not self._fired.wait(TIMEOUT_S if timeout is None else timeout):
            raise TimeoutError("modelled device event not reached in time")
        if self._error is not None:
            raise self._error


class CallerStream:
    """Work runs on the caller's thread when issued (the stand-in forward is synchronous)."""

    name = "main"

    def run(self, fn: Callable[[], None]) -> None:
        fn()

    def wait_event(self, event: ModelledEvent) -> None:
        event.synchronize()

    def _record(self, event: ModelledEvent) -> None:
        event._fire()

    def close(self) -> None:
        pass


class ModelledStream:
    """A device stream as the host sees it: issued work runs later, in order, on one thread."""

    def __init__(self, name: str):
        self.name = name
        self._q: queue.Queue = queue.Queue()
        self._error: Optional[BaseException] = None  # the first failure: later events carry it
        self._t = threading.Thread(target=self._loop, name=f"graphgen-modelled-{name}", daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            kind, arg = item
            if kind == "record":
                arg._fire(self._error)
                continue
            try:
                arg()
            except BaseException as e:  # a device error surfaces at the next synchronize
                if self._error is None:
                    self._error = e

    def run(self, fn: Callable[[], None]) -> None:
        self._q.put(("run", fn))

    def wait_event(self, event: ModelledEvent) -> None:
        self._q.put(("run", event.synchronize))

    def _record(self, event: ModelledEvent) -> None:
        self._q.put(("record", event))

    def close(self) -> None:
        self._q.put(None)
        self._t.join(TIMEOUT_S)


class ModelledStreams:
    """The commit path's device interface on the stand-in (see `graphgen.npu.run.staging.NpuStreams`)."""

    modelled = True

    def __init__(self, main=None):
        self.main = main if main is not None else CallerStream()

    def current_stream(self):
        return self.main

    def new_stream(self, name: str) -> ModelledStream:
        return ModelledStream(name)

    def event(self) -> ModelledEvent:
        return ModelledEvent()

    def wait(self, stream, event: ModelledEvent) -> None:
        stream.wait_event(event)

    def copy(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src, non_blocking=True)`` issued on ``stream``: runs when the stream reaches it."""
        stream.run(lambda: dst.copy_(src))

    def gather(self, stream, dst: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
        """``dst[:] = src[index]`` issued on ``stream`` (the commit path's decode-time saves)."""
        stream.run(lambda: torch.index_select(src, 0, index, out=dst))

    def host_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)  # CPU torch refuses pin_memory=True here
