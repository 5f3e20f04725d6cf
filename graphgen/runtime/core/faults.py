"""Fault injection for tests and demos of the asynchronous KV save path.

`Faults` holds the knobs; the runtime calls its hooks at fixed points:

* ``save_delay_s``   -- ``faults.save_sleep()`` inside each save op on the ``kv_save`` stream: makes
  the save lag behind the forward, so a missing event or a block reused too early shows up.
* ``forward_delay_s`` -- ``faults.forward_sleep()`` before each KV write on the ``main`` stream: makes
  the forward lag, so a save that does not wait for its event reads unwritten KV.
* ``load_delay_s``   -- ``faults.load_sleep()`` inside each load op on the ``kv_load`` stream: makes
  the history load lag, so a KV write or attention that does not wait for its load reads a stale block.
* ``put_delay_s``    -- sleep in each pool put (via `FaultyPool`): a slow pool (e.g. Mooncake over TCP).
* ``put_fail``       -- probability in [0, 1] that a put fails, or a callable ``key -> bool``. The
  draw is deterministic: a hash of (seed, key, attempt number of that key), so the outcome does not
  depend on thread interleaving and a retry of the same key gets a fresh draw.
* ``seed``           -- seeds the ``put_fail`` draw.
* ``weights_delay_s`` -- ``faults.weights_sleep()`` once, as a rank process starts loading its weights
  (`graphgen.runtime.parallel.rank`): a slow checkpoint read, against the start phases' deadlines.
* ``save_gate`` / ``put_gate`` / ``weights_gate`` -- an object with ``wait()`` (a ``threading.Event``, or a `FileGate`
  across processes) that each save op / each pool put waits on before its delay: a test holds the
  save (or the commit, or a rank's load) back for exactly as long as it looks, instead of hoping a sleep
  outlasts it.
  No text form (`parse`/`format`).

CLI form (`Faults.parse`): ``save_delay=0.05,put_fail=0.5,forward_delay=0.01,put_delay=0.02,load_delay=0.01,weights_delay=5,seed=1``
(the ``_s`` suffix is optional; ``Faults.format`` writes this form back).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from typing import Any, Callable, Union


__all__ = ["Faults", "FileGate"]

PutFail = Union[float, Callable[[str], bool]]


class FileGate:
    """A gate that opens when ``path`` exists: picklable, so a rank process can wait on a file the
    test creates. ``wait()`` polls every ``poll_s`` and raises `TimeoutError` after ``timeout_s``
    (a test that never opens it fails instead of hanging)."""

    def __init__(self, path, timeout_s: float = 120.0, poll_s: float = 0.005):
        self.path, self.timeout_s, self.poll_s = str(path), timeout_s, poll_s

    def open(self) -> None:
        with open(self.path, "w"):
            pass

    def wait(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {self.path} not opened within {self.timeout_s:g} s")
            time.sleep(self.poll_s)


@dataclasses.dataclass(frozen=True)
class Faults:
    save_delay_s: float = 0.0
    forward_delay_s: float = 0.0
    put_delay_s: float = 0.0
    put_fail: PutFail = 0.0
    seed: int = 0
    load_delay_s: float = 0.0
    save_gate: Any = None
    put_gate: Any = None
    weights_delay_s: float = 0.0
    weights_gate: Any = None

    # short CLI names -> field names
    _ALIASES = {"save_delay": "save_delay_s", "forward_delay": "forward_delay_s",
                "put_delay": "put_delay_s", "load_delay": "load_delay_s", "weights_delay": "weights_delay_s"}

    def __post_init__(self) -> None:
        for f in ("save_delay_s", "forward_delay_s", "put_delay_s", "load_delay_s", "weights_delay_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError(f"Faults.{f} must be a number >= 0, got {v!r}")
        pf = self.put_fail
        if not callable(pf) and (not isinstance(pf, (int, float)) or isinstance(pf, bool)
                                 or not 0.0 <= pf <= 1.0):
            raise ValueError(f"Faults.put_fail must be a probability in [0, 1] or a callable "
                             f"key -> bool, got {pf!r}")
        for f in ("save_gate", "put_gate", "weights_gate"):
            g = getattr(self, f)
            if g is not None and not callable(getattr(g, "wait", None)):
                raise ValueError(f"Faults.{f} must have a wait() method (threading.Event, FileGate), got {g!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"Faults.seed must be an int, got {self.seed!r}")

    @classmethod
    def parse(cls, text: str) -> "Faults":
        """``"save_delay=0.05,put_fail=0.5,seed=1"`` -> Faults. Empty text -> no faults."""
        fields = {f.name for f in dataclasses.fields(cls)}
        known = sorted(fields | set(cls._ALIASES))
        kw: dict[str, Any] = {}
        for item in (p.strip() for p in text.split(",")):
            if not item:
                continue
            name, eq, raw = (s.strip() for s in item.partition("="))
            if not eq or not raw:
                raise ValueError(f"fault {item!r}: expected name=value (known names: {known})")
            field = cls._ALIASES.get(name, name)
            if field not in fields:
                raise ValueError(f"unknown fault {name!r}; known names: {known}")
            if field in kw:
                raise ValueError(f"fault {name!r} given twice")
            try:
                kw[field] = int(raw) if field == "seed" else float(raw)
            except ValueError:
                raise ValueError(f"fault {name!r}: {raw!r} is not "
                                 f"{'an int' if field == 'seed' else 'a number'}") from None
        return cls(**kw)

    def format(self) -> str:
        """The `parse` form of the non-default knobs (a callable ``put_fail`` or a gate cannot be written)."""
        if self.save_gate is not None or self.put_gate is not None or self.weights_gate is not None:
            raise ValueError("a save/put/weights gate has no text form")
        parts = []
        for short, field in (("save_delay", "save_delay_s"), ("forward_delay", "forward_delay_s"),
                             ("put_delay", "put_delay_s"), ("put_fail", "put_fail"),
                             ("load_delay", "load_delay_s"), ("weights_delay", "weights_delay_s")):
            v = getattr(self, field)
            if callable(v):
                raise ValueError("a callable put_fail has no text form")
            if v:
                parts.append(f"{short}={v:g}")
        if self.seed:
            parts.append(f"seed={self.seed}")
        return ",".join(parts)

    @property
    def active(self) -> bool:
        return bool(self.save_delay_s or self.forward_delay_s or self.put_delay_s or self.load_delay_s
                    or self.weights_delay_s or callable(self.put_fail) or self.put_fail
                    or self.save_gate is not None or self.put_gate is not None or self.weights_gate is not None)

    # hooks called by the runtime ------------------------------------------------------------
    def save_sleep(self) -> None:
        if self.save_gate is not None:
            self.save_gate.wait()
        if self.save_delay_s:
            time.sleep(self.save_delay_s)

    def forward_sleep(self) -> None:
        if self.forward_delay_s:
            time.sleep(self.forward_delay_s)

    def load_sleep(self) -> None:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)

    def weights_sleep(self) -> None:
        if self.weights_gate is not None:
            self.weights_gate.wait()
        if self.weights_delay_s:
            time.sleep(self.weights_delay_s)

    def put_sleep(self) -> None:
        if self.put_gate is not None:
            self.put_gate.wait()
        if self.put_delay_s:
            time.sleep(self.put_delay_s)

    def put_fails(self, key: str, attempt: int = 0) -> bool:
        """Whether put number ``attempt`` (0-based, per key) of ``key`` fails. Pure function."""
        pf = self.put_fail
        if callable(pf):
            return bool(pf(key))
        if pf <= 0.0:
            return False
        if pf >= 1.0:
            return True
        h = hashlib.sha256(f"{self.seed}\0{attempt}\0{key}".encode()).digest()
        return int.from_bytes(h[:8], "little") / 2.0 ** 64 < pf
