"""A start that takes minutes: its phases, their deadlines, and the progress lines it prints.

An engine's start runs through `PHASES` in order: ``start`` (the process: interpreter, torch, the
process group), ``load`` (the weights: checkpoint read, slices to the device, load-time weights) and
``warmup`` (graph compiles: a full-size NPU rank compiles 28 GE graphs at 0.5-1.5 min each, as
vllm-ascend measured: audit 3 N1). Each phase has its own deadline (`Deadlines`, ``--rank-timeout``),
apart from the per-step deadline a rank has to answer one command, so a rank that loads a 60 GB
checkpoint or compiles for half an hour is never killed by the step deadline, and a rank that hangs is
still reported once its phase's deadline passes.

* `Progress`: what starting code reports, ``phase(name, total)`` and ``advance(n)`` (bytes loaded,
  graphs compiled), and ``stepping()`` when back to answering commands; `current_progress()` is this process's reporter (`reporting` sets it: a rank process reports
  to its launcher, `graphgen.runtime.parallel.rank`; a one-process engine's start, `starting`, to a
  `Board` on stderr of its own; outside a start, nothing is printed).
* `Board`: the lines, one every ``interval_s`` while something is starting: per rank its phase, bytes
  loaded / total and GB/s, or graphs compiled i/N with an ETA; a bar redrawn in place when the stream
  is a terminal.
* `RankPhases`: the launcher's clock over its ranks: which phase each is in since when, and which are
  past their deadline (a phase's, or the step deadline between phases).

Clocks are injectable (``clock=``): tests run the deadlines on a fast clock, never by sleeping through them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from typing import Callable, Optional

__all__ = ["PHASES", "STEP", "Deadlines", "Progress", "Board", "RankPhases", "current_progress", "reporting", "starting"]

PHASES = ("start", "load", "warmup")
STEP = "step"  # between phases: a command, bounded by the step deadline
_WHAT = {"start": "start its process", "load": "load its weights", "warmup": "compile its graphs", STEP: "answer"}
_UNIT = {"load": "B", "warmup": "graphs"}


@dataclasses.dataclass(frozen=True)
class Deadlines:
    """Seconds each start phase may take (``--rank-timeout``): generous, since a full-size NPU rank reads
    tens of GB and compiles for tens of minutes; a hung rank is still reported within them."""
    start: float = 600.0
    load: float = 3600.0
    warmup: float = 7200.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"the {f.name} deadline must be a number of seconds > 0, got {v!r}")

    def of(self, phase: str) -> float:
        return getattr(self, phase)

    @property
    def longest(self) -> float:
        return max(self.start, self.load, self.warmup)

    @classmethod
    def parse(cls, text: str) -> "Deadlines":
        """``"900"`` (every phase) or ``"load=7200,warmup=14400"`` (those phases; the others default)."""
        text = text.strip()
        try:
            if "=" not in text:
                s = float(text)
                return cls(s, s, s)
            kw = {}
            for item in text.split(","):
                name, _, raw = (p.strip() for p in item.partition("="))
                if name not in PHASES:
                    raise ValueError(f"unknown phase {name!r} (phases: {', '.join(PHASES)})")
                kw[name] = float(raw)
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"--rank-timeout {text!r}: {e}; expected SECONDS or "
                             f"start=S,load=S,warmup=S") from None


class Progress:
    """This process's reports: the phase it entered (``total``: bytes or graphs it expects, or None)
    and what it has done since. ``emit(event)`` gets a dict ``{"phase", "done", "total", "note"}`` at
    each phase change and at most every ``min_interval_s`` otherwise (and when a phase completes)."""

    def __init__(self, emit: Callable[[dict], None], *, clock: Callable[[], float] = time.monotonic,
                 min_interval_s: float = 0.5):
        self._emit, self._clock, self._interval = emit, clock, min_interval_s
        self._lock = threading.Lock()
        self.phase_name: Optional[str] = None
        self.done, self.note = 0, ""
        self.total: Optional[int] = None
        self._sent = float("-inf")

    def phase(self, name: str, total: Optional[int] = None) -> None:
        """Enter phase ``name``; in it already (a loader inside a rank's load phase), only set ``total``."""
        with self._lock:
            if name == self.phase_name:
                if total is not None:
                    self.total = int(total)
                return
            self.phase_name, self.done, self.total, self.note = name, 0, total, ""
            self._send()

    def stepping(self) -> None:
        """Back to answering commands (`STEP`): the step deadline again."""
        self.phase(STEP)

    def expect(self, total: int) -> None:
        """The phase's total, once known (a loader learns it from the checkpoint's headers)."""
        with self._lock:
            self.total = int(total)

    def advance(self, n: int = 1, note: str = "") -> None:
        with self._lock:
            self.done += int(n)
            self.note = note or self.note
            if self._clock() - self._sent >= self._interval or (self.total is not None and self.done >= self.total):
                self._send()

    def _send(self) -> None:
        self._sent = self._clock()
        self._emit({"phase": self.phase_name, "done": self.done, "total": self.total, "note": self.note})


def _amount(done: float, total: Optional[float], unit: str) -> str:
    """``8.0/61.0 GB`` (bytes: GB, or MB below a GB), ``7/28 graphs``; ``?`` for an unknown total."""
    if unit != "B":
        return f"{int(done)}/{int(total) if total is not None else '?'} {unit}"
    scale, name = (1e9, "GB") if max(done, total or 0) >= 1e9 else (1e6, "MB")
    return f"{done / scale:.1f}/{f'{total / scale:.1f}' if total else '?'} {name}"


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@dataclasses.dataclass
class _RankLine:
    phase: str = "start"
    since: float = 0.0
    done: int = 0
    total: Optional[int] = None
    note: str = ""


class Board:
    """Progress lines for ``ranks`` starting ranks: `update` with each rank's events, `tick` to print a
    line when ``interval_s`` passed since the last (the first only after ``interval_s``: a quick start
    prints nothing), `finish` to end (a last line when any was printed)."""

    def __init__(self, ranks: int = 1, out=None, *, clock: Callable[[], float] = time.monotonic,
                 interval_s: float = 5.0, tty: Optional[bool] = None):
        self._out, self._tty = out, tty  # None: sys.stderr as it is when a line is printed
        self.clock, self.interval = clock, interval_s
        self.started = self._last = clock()
        self.rows = {r: _RankLine(since=self.started) for r in range(ranks)}
        self.printed = 0

    def update(self, rank: int, event: dict) -> None:
        row = self.rows.setdefault(rank, _RankLine(since=self.clock()))
        if event["phase"] != row.phase:
            row.phase, row.since = event["phase"], self.clock()
        row.done, row.total, row.note = event["done"], event["total"], event.get("note", "")
        self.tick()

    def line(self) -> str:
        now = self.clock()
        parts = []
        for r, row in sorted(self.rows.items()):
            took = max(now - row.since, 1e-9)
            unit = _UNIT.get(row.phase)
            text = f"rank {r} {row.phase}"
            if unit:
                text += " " + _amount(row.done, row.total, unit)
            if unit == "B":
                text += f" {row.done / took / 1e9:.2f} GB/s"
            elif unit and row.done and row.total:
                text += f" eta {_duration(took / row.done * (row.total - row.done))}"
            if unit and row.total and self.tty:
                filled = int(20 * min(1.0, row.done / row.total))
                text += " [" + "#" * filled + "." * (20 - filled) + "]"
            parts.append(text)
        return f"starting ({_duration(now - self.started)}): " + " | ".join(parts)

    def tick(self) -> None:
        now = self.clock()
        starting = [row for row in self.rows.values() if row.phase != STEP]
        if now - self._last < self.interval or all(now - row.since < self.interval for row in starting):
            return  # a phase shorter than the interval prints nothing; nor do ranks answering commands
        self._last = self.clock()
        self._print(self.line())

    @property
    def out(self):
        return self._out if self._out is not None else sys.stderr

    @property
    def tty(self) -> bool:
        if self._tty is not None:
            return self._tty
        try:
            return bool(self.out.isatty())
        except (AttributeError, ValueError, OSError):
            return False

    def _print(self, text: str, end: bool = False) -> None:
        try:
            self.out.write(("\r" + text + ("\n" if end else "")) if self.tty else text + "\n")
            self.out.flush()
        except (ValueError, OSError):  # a closed or broken stream: progress is never worth a failure
            return
        self.printed += 1

    def finish(self, what: str = "started") -> None:
        if self.printed:
            self._print(f"{what} in {_duration(self.clock() - self.started)}", end=True)


class RankPhases:
    """The launcher's view of its ranks' deadlines: each rank's phase (`PHASES` while starting, `STEP`
    while answering a command) since when, on ``clock``. A phase's deadline is ``deadlines``'; a
    command's is ``step_timeout`` from when it was sent. A rank that reports a phase mid-command (a graph
    compiled on first use) gets that phase's deadline until it reports `STEP` again."""

    def __init__(self, world: int, deadlines: Deadlines, step_timeout: float, *,
                 clock: Callable[[], float] = time.monotonic):
        self.deadlines, self.step_timeout, self.clock = deadlines, step_timeout, clock
        now = clock()
        self.phase = {r: "start" for r in range(world)}
        self.since = {r: now for r in range(world)}
        self.last: dict[int, dict] = {}

    def command(self) -> None:
        """A command was sent to every rank: each is answering it now."""
        now = self.clock()
        for r in self.phase:
            self.phase[r], self.since[r] = STEP, now

    def report(self, rank: int, event: dict) -> None:
        if event["phase"] != self.phase[rank]:
            self.phase[rank], self.since[rank] = event["phase"], self.clock()
        self.last[rank] = event

    def limit(self, rank: int) -> float:
        phase = self.phase[rank]
        return self.step_timeout if phase == STEP else self.deadlines.of(phase)

    def late(self, ranks) -> list[int]:
        now = self.clock()
        return [r for r in ranks if now - self.since[r] > self.limit(r)]

    def describe(self, late: list[int], what: str) -> str:
        """The sentence naming the late ranks, their phase, its deadline and their last progress."""
        phase = self.phase[late[0]]
        if phase == STEP:
            return f"rank(s) {late} did not answer {what} within {self.step_timeout:.0f} s"
        last = self.last.get(late[0])
        seen = ""
        if last is not None and phase in _UNIT and (last["done"] or last["total"]):
            seen = f"; rank {late[0]} last reported {_amount(last['done'], last['total'], _UNIT[phase])}"
        return (f"rank(s) {late} did not {_WHAT[phase]} ({phase} phase) within {self.limit(late[0]):.0f} s "
                f"(--rank-timeout {phase}=SECONDS raises it){seen}")


_current: dict = {"progress": None}


def current_progress() -> Progress:
    """This process's reporter: the one `reporting` (or `starting`) set; outside any, a fresh one that
    prints nothing (a load outside an engine's start, e.g. ``load_hf_weights`` called directly: one
    process-wide board would carry a finished start's phase and bytes into every later load)."""
    p = _current["progress"]
    return p if p is not None else Progress(lambda ev: None)


@contextlib.contextmanager
def starting(ranks: int = 1, out=None):
    """One engine start in this process: its loads and compiles report to a `Board` of its own (lines
    only when the start takes longer than the board's interval; a last line when any was printed).
    Inside a start already (a rank process reporting to its launcher), the reporter there is kept."""
    if _current["progress"] is not None:
        yield _current["progress"]
        return
    board = Board(ranks, out)
    with reporting(Progress(lambda ev: board.update(0, ev))) as progress:
        try:
            yield progress
        finally:
            board.finish()


@contextlib.contextmanager
def reporting(progress: Progress):
    """Make ``progress`` this process's reporter inside the block."""
    saved = _current["progress"]
    _current["progress"] = progress
    try:
        yield progress
    finally:
        _current["progress"] = saved
