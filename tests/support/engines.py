"""Multi-rank engines shared by the tests of a run (the ``rank_engines`` session fixture of
tests/conftest.py): one engine per (spec, weights, options), started on first use, closed at the end
of the session. A start costs world + 1 processes and a weights load; the tests that only read
tokens, logits and counters of their own requests need not pay it each.

A test on a shared engine:

* uses prompts no other user sends (a pool hit on another test's blocks would change its variants
  and hit counts): each test draws its own from its own seed;
* reads counters as the change its own requests made (`counters_since`), never absolute;
* leaves the engine as it found it (a probe that patches a rank undoes it before the test ends);
* never breaks it on purpose: a fault, a kill, a mutated graph or swapped weights needs a private
  engine, and that test says why in one line.

An engine that failed (`RankFailure` closes it) is started again for its next user.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["SharedEngines", "counters_since"]


class SharedEngines:
    """``get(spec, weights, **options)``: the session's engine of that key (`open_engine`'s arguments).
    At most ``keep`` engines stay started (the least recently used one is closed for a new key: each
    holds world + 1 processes)."""

    def __init__(self, keep: int = 2):
        self._engines: dict = {}   # key -> engine, least recently used first
        self.keep = keep
        self.starts = 0   # engines started (a test of the factory reads it)

    def get(self, spec, weights, **options):
        from graphgen.runtime import open_engine

        key = (str(Path(spec).resolve()), str(weights), tuple(sorted(options.items())))
        eng = self._engines.pop(key, None)
        if eng is None or eng._closed:
            while len(self._engines) >= self.keep:
                old = self._engines.pop(next(iter(self._engines)))
                if not old._closed:
                    old.close()
            eng = open_engine(spec, weights, **options)
            self.starts += 1
        self._engines[key] = eng
        return eng

    def close(self) -> None:
        for eng in self._engines.values():
            if not eng._closed:
                eng.close()
        self._engines.clear()


def counters_since(before: list[dict], after: list[dict]) -> list[dict]:
    """Each rank's numeric counters of ``after`` minus ``before`` (``DistributedEngine.rank_stats``)."""
    return [{k: v - b.get(k, 0) for k, v in a.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for b, a in zip(before, after)]
