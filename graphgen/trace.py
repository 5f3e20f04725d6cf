"""Chrome trace-event JSON (opens in Perfetto / chrome://tracing): who ran what, when, on which track.

One :class:`TraceRecorder` per process run. A *track* is a named row (one ``tid`` in the JSON, labelled
with a ``thread_name`` metadata event), e.g. the forward stream, the save stream, the host commit,
the scheduler — so spans that overlap in time show side by side. Thread-safe: spans may be opened
on any thread; events are buffered in memory (bounded: ``max_events``; later events are counted as
dropped) and written once, atomically, by :meth:`close`.

Track names the runtime uses (constants below, so writers and readers agree):

- ``scheduler`` — one span per engine step decision (``schedule``) and per step (``step``);
- ``forward`` — the forward of one generated graph (``forward:<variant>``);
- ``save`` — the save stream's copy into staging (``kv_save``);
- ``host`` — the host commit of one step's saved blocks (``commit``);
- ``prefill`` — per step, over its forward: one ``chunk`` span per prefill row (a prompt or a chunk
  of one: ``req``, ``positions`` [start, end), ``last``) and a ``decode_stall`` span when running requests
  that could decode are not in the step (``rows``);
- ``server`` — HTTP-side events (``request`` spans from arrival to the last token).

``NULL`` is a recorder that records nothing, so call sites need no ``if trace:``.

:class:`StepObserver` is what the runtime reports to when one is attached (``Engine.observe``): the
model runner (forward spans, save copies, save done), the KV connector (commits) and the step
engine (scheduling). It turns those reports into trace spans and ``(name, seconds)`` timing samples
(``forward``: one step's graph; ``save``: forward start -> the step's KV in staging; ``commit``: the save's event seen -> every
block put) and per-step counts (``prefill_tokens``: a step's prompt tokens; ``decode_rows_stalled``). With no observer attached the runtime pays one ``is None`` test per report.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Optional

__all__ = ["TraceRecorder", "NULL", "StepObserver", "TRACK_SCHEDULER", "TRACK_FORWARD", "TRACK_SAVE", "TRACK_HOST",
           "TRACK_SERVER", "TRACK_PREFILL"]

TRACK_SCHEDULER = "scheduler"
TRACK_FORWARD = "forward"
TRACK_SAVE = "save"
TRACK_HOST = "host"
TRACK_SERVER = "server"
TRACK_PREFILL = "prefill"
_TRACK_ORDER = (TRACK_SCHEDULER, TRACK_FORWARD, TRACK_PREFILL, TRACK_SAVE, TRACK_HOST, TRACK_SERVER)


class TraceRecorder:
    def __init__(self, path: Optional[str], *, process_name: str = "graphgen", max_events: int = 1_000_000):
        self.path = path
        self.max_events = max_events
        self.dropped = 0
        self._events: list[dict] = []
        self._tids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._closed = False
        self._meta = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": process_name}}]
        for t in _TRACK_ORDER:
            self._tid(t)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def _us(self, t: Optional[float] = None) -> float:
        return round(((time.perf_counter() if t is None else t) - self._t0) * 1e6, 3)

    def _tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
            self._meta.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": track}})
            self._meta.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid,
                               "args": {"sort_index": tid}})
        return tid

    def _add(self, ev: dict) -> None:
        with self._lock:
            if self._closed:
                return
            if len(self._events) >= self.max_events:
                self.dropped += 1
                return
            ev["tid"] = self._tid(ev.pop("track"))
            self._events.append(ev)

    # ---- recording ----------------------------------------------------------------------------
    def complete(self, track: str, name: str, start: float, end: float, **args) -> None:
        """A finished span from ``time.perf_counter()`` stamps (for spans measured elsewhere)."""
        if self.enabled:
            self._add({"ph": "X", "name": name, "pid": 1, "track": track, "ts": self._us(start),
                       "dur": max(0.0, round((end - start) * 1e6, 3)), "args": args})

    @contextmanager
    def span(self, track: str, name: str, **args):
        """``with trace.span("forward", "forward:decode", tokens=3): ...`` — one complete event."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(track, name, start, time.perf_counter(), **args)

    def begin(self, track: str, name: str, **args) -> None:
        """Begin/end pairs, for spans opened and closed in different places of one thread's code."""
        if self.enabled:
            self._add({"ph": "B", "name": name, "pid": 1, "track": track, "ts": self._us(), "args": args})

    def end(self, track: str, name: str) -> None:
        if self.enabled:
            self._add({"ph": "E", "name": name, "pid": 1, "track": track, "ts": self._us()})

    def instant(self, track: str, name: str, **args) -> None:
        if self.enabled:
            self._add({"ph": "i", "s": "t", "name": name, "pid": 1, "track": track, "ts": self._us(), "args": args})

    def counter(self, name: str, **values) -> None:
        if self.enabled:
            self._add({"ph": "C", "name": name, "pid": 1, "track": TRACK_SCHEDULER, "ts": self._us(), "args": values})

    # ---- output -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        with self._lock:
            events = sorted(self._events, key=lambda e: e["ts"])
            return {"traceEvents": self._meta + events, "displayTimeUnit": "ms",
                    "otherData": {"dropped_events": self.dropped}}

    def close(self) -> Optional[str]:
        """Write the JSON (atomically: a temp file renamed into place). Idempotent."""
        if not self.enabled or self._closed:
            return None
        doc = self.to_json()
        with self._lock:
            self._closed = True
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".json", dir=d)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(tmp, self.path)
        return self.path


NULL = TraceRecorder(None)


class StepObserver:
    """The runtime's reports -> trace spans (``trace``) and timing samples (kept when ``keep_timings``;
    bounded: the oldest samples go first). Called from the forward, save and host threads."""

    def __init__(self, trace: TraceRecorder = NULL, *, keep_timings: bool = False, max_timings: int = 100_000):
        self.trace = trace
        self._timings: Optional[deque] = deque(maxlen=max_timings) if keep_timings else None

    def forward(self, variant: str, start: float, end: float, *, tokens: int, seqs: int, step: int) -> None:
        self.trace.complete(TRACK_FORWARD, f"forward:{variant}", start, end, tokens=tokens, seqs=seqs, step=step)
        if self._timings is not None:
            self._timings.append(("forward", end - start))

    def save_copy(self, start: float, end: float, *, blocks: int, layers: int = 1) -> None:
        self.trace.complete(TRACK_SAVE, "kv_save", start, end, blocks=blocks, layers=layers)

    def save_done(self, forward_start: float, end: float, *, step: int) -> None:
        """The step's save program finished: its KV is in staging."""
        if self._timings is not None:
            self._timings.append(("save", end - forward_start))

    def commit(self, start: float, end: float, *, blocks: int, puts: int) -> None:
        self.trace.complete(TRACK_HOST, "commit", start, end, blocks=blocks, puts=puts)
        if self._timings is not None:
            self._timings.append(("commit", end - start))

    def step(self, what: str, step_no: int, start: float, end: float) -> None:
        """The step engine's spans: ``schedule`` (and ``launch`` instants with async scheduling);
        its ``forward`` spans are the runner's (with the variant) and are not repeated here."""
        if what == "schedule":
            self.trace.complete(TRACK_SCHEDULER, "schedule", start, end, step=step_no)
        elif what == "launch":
            self.trace.complete(TRACK_SCHEDULER, "launch", start, end, step=step_no)

    def step_rows(self, plan, step_no: int, start: float, end: float) -> None:
        """What one step's forward (``start`` .. ``end``) carried: its prefill rows (chunks) and the
        decode rows it stalled (see `StepPlan`); only steps with prompt work are sampled."""
        for row in plan.rows:
            if not row.decode:
                self.trace.complete(TRACK_PREFILL, "chunk", start, end, req=str(row.request.req_id),
                                    positions=list(row.chunk), last=row.samples, step=step_no)
        if plan.decode_rows_stalled:
            self.trace.complete(TRACK_PREFILL, "decode_stall", start, end, rows=plan.decode_rows_stalled,
                                step=step_no)
        if self._timings is not None and plan.prefill_tokens:
            self._timings.append(("prefill_tokens", float(plan.prefill_tokens)))
            self._timings.append(("decode_rows_stalled", float(plan.decode_rows_stalled)))

    def take_timings(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        while self._timings:
            out.append(self._timings.popleft())
        return out
