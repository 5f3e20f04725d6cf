"""The typed rank commands (`graphgen.runtime.parallel.commands`): one dispatch table covering every command,
an unknown one refused, the step API's replies (``invalid`` for refused input), a DP call only on its own
rank, and every command surviving the pickle that carries it to a rank process. No processes: a stand-in
engine records the calls (the ranks themselves: tests/parallel)."""
from __future__ import annotations

import dataclasses
import pickle
from types import SimpleNamespace

import pytest

from graphgen.runtime.parallel import commands as C


class _Core:
    def __init__(self):
        self.calls = []

    def add_request(self, req_id, prompt, params=None, *, max_tokens=None, fork_of=None):
        if not prompt:
            raise ValueError("empty prompt")
        self.calls.append(("add_request", req_id, tuple(prompt), max_tokens))

    def step(self):
        self.calls.append(("step",))
        return ["out"]

    def has_work(self):
        return True


def _rank(dp_rank=None):
    engine = SimpleNamespace(core=_Core())
    return C.Rank(engine, SimpleNamespace(rank=0), SimpleNamespace(dp_rank=dp_rank) if dp_rank is not None else None)


def test_every_command_has_a_handler_and_an_unknown_one_is_refused():
    commands = [getattr(C, n) for n in C.__all__ if dataclasses.is_dataclass(getattr(C, n))]
    handled = set(C.HANDLERS) | {C.Close, C.StepCall, C.Rank}  # Close ends the loop; StepCall is the base
    assert [c.__name__ for c in commands if c not in handled] == []
    with pytest.raises(TypeError, match="unknown rank command"):
        C.handle(_rank(), ("generate", ()))  # the old tuple protocol is no command


def test_step_calls_reply_ok_or_invalid_and_run_on_the_core():
    rank = _rank()
    assert C.handle(rank, C.AddRequest("a", [1, 2], max_tokens=3)) == ("ok", None)
    assert C.handle(rank, C.AddRequest("b", [])) == ("invalid", "empty prompt")  # nothing queued
    assert C.handle(rank, C.Step()) == ("ok", ["out"])
    assert rank.engine.core.calls == [("add_request", "a", (1, 2), 3), ("step",)]
    assert C.failure_words(C.HasWork()) == "(between commands)" and C.failure_words(C.Step()) == "during step"
    assert C.failure_words(C.OnDPRank(None, C.CoreStats())) == "(between commands)"


def test_a_dp_call_runs_on_its_own_dp_rank_only():
    rank = _rank(dp_rank=1)
    assert C.handle(rank, C.OnDPRank(0, C.AddRequest("a", [1]))) == ("ok", None)
    assert rank.engine.core.calls == []  # DP rank 0's request: not this rank's
    assert C.handle(rank, C.OnDPRank(1, C.AddRequest("a", [1]))) == ("ok", None)
    assert rank.engine.core.calls == [("add_request", "a", (1,), None)]


@pytest.mark.parametrize("cmd", [C.Generate([[1, 2]], 3, {"batch": True}), C.Drain(1.0), C.Stats(), C.SaveLedgers(),
                                 C.Probe(len, ()), C.Close(), C.AddRequest("r", [1], None, 4, None),
                                 C.OnDPRank(0, C.Step()), C.DPGenerate([[(0, 0, [1])]], 2, True)])
def test_commands_pickle_as_they_cross_to_a_rank(cmd):
    back = pickle.loads(pickle.dumps(cmd))
    assert back == cmd and type(back).EVERY_RANK == type(cmd).EVERY_RANK
