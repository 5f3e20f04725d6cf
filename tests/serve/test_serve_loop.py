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
