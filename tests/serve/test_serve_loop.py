"""The engine-loop thread's inbox (serve/loop.py): typed messages, one handler each.

In-process, on the real tiny Qwen3 engine (no server: what is checked is the loop's dispatch, not
HTTP): every message type of `InboxMessage` has a handler (negative control: a message type
without one is refused by the table check), an added request streams its tokens to its callback
and equals the engine run directly, an abort ends a request with the reason the client saw, and a
stop drains then ends the thread.
"""
from __future__ import annotations

import queue
import typing
from dataclasses import dataclass

import pytest

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import SamplingParams, open_engine
from graphgen.serve.adapter import EngineAdapter
from graphgen.serve.loop import AbortRequest, AddRequest, EngineLoop, InboxMessage, StopLoop
from graphgen.serve.metrics import ServerMetrics
from support.paths import TINY_QWEN3

SPEC = load_spec(TINY_QWEN3)  # the session's `ckpt` (tests/conftest.py) is this spec's checkpoint


def _missing_handlers(handlers: dict, message_union) -> list[str]:
    return sorted(t.__name__ for t in typing.get_args(message_union) if t not in handlers)


def test_every_inbox_message_has_one_handler():
    assert _missing_handlers(EngineLoop._HANDLERS, InboxMessage) == []
    assert set(EngineLoop._HANDLERS) == set(typing.get_args(InboxMessage))

    @dataclass(frozen=True)
    class Unhandled:  # negative control: a new message without its row in the table
        x: int

    assert _missing_handlers(EngineLoop._HANDLERS, typing.Union[InboxMessage, Unhandled]) == ["Unhandled"]


def test_add_abort_and_stop_through_the_inbox(ckpt):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 9, 13, 2, 7, 11]
    with open_engine(SPEC, ckpt, num_blocks=32) as e:
        direct = e.generate([prompt], 6)[0]
        loop = EngineLoop(EngineAdapter(e), ServerMetrics())
        # an add and its abort queued before the thread reads the inbox: it applies both in order before
        # any step, so the request ends with the reason the client saw (deterministic: no race with a step)
        cut: queue.Queue = queue.Queue()
        loop.submit("b", [3, 4, 5], SamplingParams(max_tokens=100, ignore_eos=True), cut.put)
        loop.abort("b", reason="stop")
        loop.start()
        end = cut.get(timeout=60)
        assert end.finished and end.finish_reason == "stop" and end.new_token_ids == (), end
        got: queue.Queue = queue.Queue()
        loop.submit("a", prompt, greedy, got.put)
        streamed, last = [], None
        while last is None or not last.finished:
            last = got.get(timeout=60)
            streamed += list(last.new_token_ids)
        assert streamed == direct.tokens and last.finish_reason == "length"
        loop.stop(drain_timeout_s=5.0)
        assert not loop.alive and loop.error is None
        # after the stop an added request is refused, not lost
        late: queue.Queue = queue.Queue()
        loop._apply(AddRequest("c", (1, 2), greedy, late.put, 0.0))
        assert late.get_nowait().finish_reason == "abort"


def test_messages_are_frozen():
    msg = AbortRequest("r")
    with pytest.raises(Exception):
        msg.req_id = "s"  # type: ignore[misc]
    assert StopLoop(1.0).deadline == 1.0 and AbortRequest("r").forks is True


class _Ending:
    """The real tiny engine's adapter, whose ``has_work`` (idle) or ``step`` (a request running) raises the
    `RankFailure` a lost node gives (the loss itself: tests/parallel/test_nodes.py, tests/runtime/test_cluster.py);
    counts ``shutdown`` calls (an ended engine's would raise again)."""

    def __init__(self, adapter, where: str, sentence: str):
        self._a, self.where, self.sentence, self.shutdowns, self.armed = adapter, where, sentence, 0, False

    def __getattr__(self, name):
        return getattr(self._a, name)

    def has_work(self):
        if self.armed and self.where == "has_work":
            from graphgen.runtime import RankFailure

            raise RankFailure(self.sentence)
        return self._a.has_work()

    def step(self):
        if self.armed and self.where == "step":
            from graphgen.runtime import RankFailure

            raise RankFailure(self.sentence)
        return self._a.step()

    def shutdown(self):
        self.shutdowns += 1
        self._a.shutdown()


@pytest.mark.parametrize("where", ["has_work", "step"])
def test_an_engine_that_ends_is_told_once_without_a_traceback(where, ckpt, caplog):
    """Issue 43 item 5: a `RankFailure` from the idle poll or from a step ends the loop: the request in flight
    (if any) gets the sentence as its error, ``on_engine_end`` hears it once with the count, nothing is
    logged with a traceback, and the ended engine is not shut down (its second failure was the second
    traceback); without ``on_engine_end`` it is one log line."""
    import logging

    words = "(between commands)" if where == "has_work" else "during step"
    sentence = f"node 1 (ranks 2-3) was lost: its connection to the driver closed {words}"
    with open_engine(SPEC, ckpt, num_blocks=32) as e:
        for hook in (True, False):
            eng = _Ending(EngineAdapter(e), where, sentence)
            loop, told, out = EngineLoop(eng, ServerMetrics()), [], queue.Queue()
            if hook:
                loop.on_engine_end = lambda s, n: told.append((s, n))
            caplog.clear()
            with caplog.at_level(logging.DEBUG, logger="graphgen.serve"):
                loop.start()
                if where == "step":
                    eng.armed = True  # armed before the request: its first step raises
                    loop.submit(f"end-{hook}", [5, 9, 13], SamplingParams(max_tokens=50, ignore_eos=True), out.put)
                else:
                    eng.armed = True
                loop._thread.join(30)
            assert not loop.alive and str(loop.error) == sentence and eng.shutdowns == 0
            assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
            if where == "step":
                end = out.get(timeout=5)
                assert end.finished and end.finish_reason == "error" and end.error == sentence, end
            if hook:
                assert told == [(sentence, 1 if where == "step" else 0)] and not caplog.records
            else:
                assert [r.getMessage() for r in caplog.records] == [f"the engine ended: {sentence}"]
