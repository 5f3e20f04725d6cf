"""Host-side streams and events for the CPU target.

The CPU lowering models a device with several streams: ``main`` is the caller's thread (its ops
simply run), ``kv_save`` and ``kv_load`` are worker threads (`Stream`) that execute launched
callables in FIFO order, exactly like work queued on a device stream. Cross-stream ordering is expressed only with
events.

Events are **reusable across steps**: every record and wait carries the step's *generation* (a
monotonically increasing step counter owned by the engine). ``wait(n)`` returns once a record with a
generation ``>= n`` happened, so a wait for step *n* can never be satisfied by step *n-1*'s record,
and an event never has to be "reset" between steps (a reset is exactly where such bugs hide).

Generated code does not handle generations: it receives a view bound to the step,
``ev = events.bind(gen)``, and writes ``rt.record(ev["ev.L00.kv_write"])`` /
``rt.wait(ev["ev.L00.kv_write"])`` (the runtime calls the handle's ``record``/``wait``).
Event names are explicit and unique per graph (prior-art defect 3: events matched by position).

Jobs (`Job`) track completion from the moment they are *queued*, not from when the worker picks them
up (prior-art defect 2: a "done" flag that read done before the job even started).

No waits here spin in Python: everything blocks on `threading.Condition` / `queue.SimpleQueue`.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping

__all__ = [
    "Event", "EventTimeout", "EventAborted", "EventSet", "BoundEvents", "BoundEvent",
    "Job", "JobTimeout", "Stream",
]


class EventTimeout(TimeoutError):
    """A wait on an event did not see the required generation within its timeout."""


class EventAborted(RuntimeError):
    """The generation being waited for was aborted (its producer failed) and will never be recorded."""


class Event:
    """A named, reusable event with per-step generations.

    ``record(gen)`` marks generation ``gen`` done; ``wait(gen)`` blocks until a record with generation
    ``>= gen`` happened. Generations must be recorded in non-decreasing order (an event is recorded by
    one stream, in program order; a step going backwards is an engine bug and is refused loudly).
    ``abort(gen, reason)`` releases waiters of generations ``<= gen`` with `EventAborted` so a failed
    step cannot leave the save stream blocked forever; later generations are unaffected.
    """

    __slots__ = ("name", "_cond", "_recorded", "_aborted", "_abort_reason")

    def __init__(self, name: str):
        self.name = name
        self._cond = threading.Condition(threading.Lock())
        self._recorded = -1          # highest recorded generation; -1 = never (generations are >= 0)
        self._aborted = -1           # highest aborted generation
        self._abort_reason = ""

    @staticmethod
    def _check_gen(gen: int) -> int:
        # bool is an int subclass; True/False as a generation is always a bug in the caller
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
            raise ValueError(f"event generation must be an int >= 0, got {gen!r}")
        return gen

    def record(self, gen: int) -> None:
        gen = self._check_gen(gen)
        with self._cond:
            if gen < self._recorded:
                raise ValueError(
                    f"event {self.name!r}: record of generation {gen} after generation "
                    f"{self._recorded} (generations must not go backwards)")
            self._recorded = gen
            self._cond.notify_all()

    def abort(self, gen: int, reason: str = "aborted") -> None:
        gen = self._check_gen(gen)
        with self._cond:
            if gen > self._aborted:
                self._aborted = gen
                self._abort_reason = reason
            self._cond.notify_all()

    def wait(self, gen: int, timeout: float | None = None) -> None:
        """Block until generation ``gen`` (or later) is recorded.

        Raises `EventTimeout` after ``timeout`` seconds (never returns silently: a wait that "fails
        quietly" lets the consumer read memory before it was written, prior-art defect 1), or
        `EventAborted` if ``gen`` was aborted before being recorded.
        """
        gen = self._check_gen(gen)
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._recorded >= gen or self._aborted >= gen, timeout)
            if self._recorded >= gen:
                return
            if self._aborted >= gen:
                raise EventAborted(
                    f"event {self.name!r}: generation {gen} aborted ({self._abort_reason})")
            assert not ok
            raise EventTimeout(
                f"event {self.name!r}: generation {gen} not recorded within {timeout}s "
                f"(last recorded generation: {self._recorded})")

    def __repr__(self) -> str:
        return f"Event({self.name!r}, last_recorded={self._recorded})"


class BoundEvent:
    """An `Event` bound to one generation: what generated code records and waits on."""

    __slots__ = ("event", "gen", "timeout")

    def __init__(self, event: Event, gen: int, timeout: float | None = None):
        self.event = event
        self.gen = gen
        self.timeout = timeout

    @property
    def name(self) -> str:
        return self.event.name

    def record(self) -> None:
        self.event.record(self.gen)

    def wait(self, timeout: float | None = None) -> None:
        self.event.wait(self.gen, self.timeout if timeout is None else timeout)

    def __repr__(self) -> str:
        return f"BoundEvent({self.event.name!r}, gen={self.gen})"


class EventSet:
    """The events of ONE generated graph, by name.

    Names must be unique (a duplicate is refused: events are never matched by position, and two
    nodes silently sharing one event is how the seed shifted every wait, prior-art defect 3). Build
    one EventSet per generated graph/module; do not share events between graphs.
    ``default_timeout`` applies to waits through bound handles that pass no timeout.
    """

    def __init__(self, names: Iterable[str], *, default_timeout: float | None = None):
        names = list(names)
        for n in names:
            if not isinstance(n, str) or not n:
                raise ValueError(f"event names must be non-empty strings, got {n!r}")
        seen: set[str] = set()
        dups: set[str] = set()
        for n in names:
            (dups if n in seen else seen).add(n)
        if dups:
            raise ValueError(f"duplicate event names: {sorted(dups)}")
        self._events: dict[str, Event] = {n: Event(n) for n in names}
        self.default_timeout = default_timeout

    def _unknown(self, name: object) -> KeyError:
        return KeyError(f"unknown event {name!r}; known events: {sorted(self._events)}")

    def __getitem__(self, name: str) -> Event:
        try:
            return self._events[name]
        except KeyError:
            raise self._unknown(name) from None

    def __contains__(self, name: object) -> bool:
        return name in self._events

    def __iter__(self) -> Iterator[str]:
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._events)

    def bind(self, gen: int) -> "BoundEvents":
        return BoundEvents(self, Event._check_gen(gen))

    def abort(self, gen: int, reason: str = "aborted") -> None:
        """Release every waiter of generation ``<= gen`` on every event (the step failed)."""
        for e in self._events.values():
            e.abort(gen, reason)


class BoundEvents(Mapping[str, BoundEvent]):
    """``events.bind(gen)``: ``ev[name]`` -> `BoundEvent` for that step. Unknown names -> KeyError."""

    def __init__(self, events: EventSet, gen: int):
        self._set = events
        self.gen = gen

    def __getitem__(self, name: str) -> BoundEvent:
        return BoundEvent(self._set[name], self.gen, self._set.default_timeout)

    def __iter__(self) -> Iterator[str]:
        return iter(self._set)

    def __len__(self) -> int:
        return len(self._set)

    def abort(self, reason: str = "aborted") -> None:
        self._set.abort(self.gen, reason)


# --------------------------------------------------------------------------------------------- jobs

class JobTimeout(TimeoutError):
    """`Job.wait`/`Job.result`/`Job.exception` timed out."""


_QUEUED, _RUNNING, _DONE = "queued", "running", "done"


class Job:
    """One launched callable. Not done from the instant it is created (= queued) until it finished.

    ``done()`` is True once it finished (successfully or not); ``wait(timeout)`` blocks until then and
    raises `JobTimeout` otherwise; ``result(timeout)`` returns the value or re-raises the job's
    exception; ``exception()`` returns it (or None).
    """

    __slots__ = ("name", "_fn", "_args", "_kwargs", "_state", "_finished", "_value", "_exc")

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: dict):
        self.name = name
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self._state = _QUEUED
        self._finished = threading.Event()   # blocking, not polled
        self._value: Any = None
        self._exc: BaseException | None = None

    def _run(self) -> None:
        self._state = _RUNNING
        try:
            self._value = self._fn(*self._args, **self._kwargs)
        except BaseException as e:  # captured for result(); the worker must survive any job
            self._exc = e
        finally:
            self._fn = self._args = self._kwargs = None  # type: ignore[assignment]  # drop refs
            self._state = _DONE
            self._finished.set()

    @property
    def state(self) -> str:
        return self._state

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._finished.wait(timeout):
            raise JobTimeout(f"job {self.name!r} not finished within {timeout}s (state: {self._state})")

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.wait(timeout)
        return self._exc

    def result(self, timeout: float | None = None) -> Any:
        self.wait(timeout)
        if self._exc is not None:
            raise self._exc
        return self._value

    def __repr__(self) -> str:
        return f"Job({self.name!r}, {self._state}{', failed' if self._exc else ''})"


class Stream:
    """A worker thread executing launched callables one at a time in FIFO order, like work queued on
    a device stream (the CPU target's save stream and the engine's host/commit stream).

    The thread is a daemon blocked on a queue when idle (costs nothing). A job that raises does not
    stop the worker: its exception is kept in the `Job`. ``close()`` lets queued jobs finish, then
    stops the thread; launching on a closed stream raises RuntimeError.
    """

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._closed = False
        self._seq = 0
        self._q: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._worker, name=f"stream-{name}", daemon=True)
        self._thread.start()

    def _worker(self) -> None:
        while True:
            job = self._q.get()
            if job is None:   # close() sentinel, queued after every job launched before it
                return
            job._run()

    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Job:
        if not callable(fn):
            raise TypeError(f"stream {self.name!r}: launch() needs a callable, got {fn!r}")
        with self._lock:   # job creation and enqueue are one step: FIFO == launch order
            if self._closed:
                raise RuntimeError(f"stream {self.name!r} is closed")
            self._seq += 1
            job = Job(f"{self.name}#{self._seq}:{getattr(fn, '__name__', type(fn).__name__)}",
                      fn, args, kwargs)
            self._q.put(job)
        return job

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Stream({self.name!r}{', closed' if self._closed else ''})"
