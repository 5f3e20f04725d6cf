"""`support.engines.SharedEngines` (the ``rank_engines`` session fixture): one engine per key, a
closed (failed) one started again, at most ``keep`` alive; and `counters_since`. With a stand-in for
``open_engine`` (what is shared is the point here, not an engine: tests/parallel runs real ones)."""
from __future__ import annotations

import graphgen.runtime
from support.engines import SharedEngines, counters_since


class _Engine:
    def __init__(self, spec, weights, **options):
        self.key, self._closed = (spec, weights, options), False

    def close(self):
        self._closed = True


def test_one_engine_per_key_restarted_when_closed_and_at_most_keep(monkeypatch):
    monkeypatch.setattr(graphgen.runtime, "open_engine", _Engine)
    shared = SharedEngines(keep=2)
    a = shared.get("specs/a.yaml", "w", num_blocks=32, timeout=60)
    assert shared.get("specs/a.yaml", "w", timeout=60, num_blocks=32) is a and shared.starts == 1
    assert shared.get("specs/a.yaml", "w", num_blocks=16, timeout=60) is not a   # other options: another key
    a.close()                                                                     # e.g. a RankFailure
    a2 = shared.get("specs/a.yaml", "w", num_blocks=32, timeout=60)
    assert a2 is not a and not a2._closed and shared.starts == 3
    b = shared.get("specs/b.yaml", "w")     # a third key: the least recently used (num_blocks=16) closes
    assert not a2._closed and not b._closed and len(shared._engines) == 2
    shared.close()
    assert a2._closed and b._closed


def test_counters_since():
    before = [{"puts": 2, "hit_blocks": 1, "name": "x"}, {"puts": 0, "hit_blocks": 1}]
    after = [{"puts": 5, "hit_blocks": 4, "name": "x"}, {"puts": 0, "hit_blocks": 4, "new": 2}]
    assert counters_since(before, after) == [{"puts": 3, "hit_blocks": 3}, {"puts": 0, "hit_blocks": 3, "new": 2}]
