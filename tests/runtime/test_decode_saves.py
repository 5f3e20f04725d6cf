"""Decode-time saves (issue 17 item 4, ``pool.save_decode``): a block a decode step fills is saved,
so turn 2 of a conversation (turn 1's prompt + answer + new text) hits turn 1's answer.

The hit is checked exactly (the blocks a decode filled), its KV by turn 2's tokens and logits
against the same turn computed cold; the safety rule (a block with a decode save in flight is never
back in the free list before its commit) with a gated pool put, and its negative control without
the pin."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from graphgen.runtime import open_engine
from graphgen.runtime.core.faults import Faults
from test_continuous_batching import BS, SPEC, ckpt, prompts  # noqa: F401  (fixture)

TURN1 = prompts(1, seed=31, lo=10, hi=11)[0]  # 10 tokens: 2 full blocks saved by its prefill
ANSWER = 12


def _engine(ckpt, save_decode: bool, write: str = "sync", **kw):
    spec = dataclasses.replace(SPEC, pool=dataclasses.replace(SPEC.pool, write=write, save_decode=save_decode))
    return open_engine(spec, ckpt, **kw)


def _two_turns(ckpt, save_decode: bool, write: str = "sync"):
    with _engine(ckpt, save_decode, write, collect_logits=True) as e:
        answer = e.generate([TURN1], ANSWER)[0].tokens
        e.drain()
        puts = e.stats["puts"]
        turn2 = TURN1 + answer + [7, 8, 9]
        return turn2, e.generate([turn2], 4)[0], puts


@pytest.mark.parametrize("write", ["sync", "async"])
def test_turn_2_hits_turn_1s_answer_with_save_decode_and_not_without(ckpt, write):
    turn2, on, puts_on = _two_turns(ckpt, True, write)
    _, off, puts_off = _two_turns(ckpt, False, write)
    # turn 1 computed KV for its prompt and the first ANSWER - 1 tokens (the last is never fed back)
    filled = (len(TURN1) + ANSWER - 1) // BS
    assert on.hit_tokens == filled * BS                       # the answer's blocks came from the pool
    assert off.hit_tokens == (len(TURN1) // BS) * BS          # only turn 1's prompt blocks
    assert (puts_on, puts_off) == (filled, len(TURN1) // BS)  # turn 1: + exactly the blocks decodes filled
    with _engine(ckpt, False, "off", collect_logits=True) as e:
        cold = e.generate([turn2], 4)[0]
    assert on.tokens == cold.tokens
    worst = max((a - b).abs().max().item() for a, b in zip(on.step_logits, cold.step_logits))
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("pinned", [True, False])
def test_a_block_with_a_decode_save_in_flight_is_not_freed_before_its_commit(ckpt, pinned):
    gate = threading.Event()
    with _engine(ckpt, True, "async", faults=Faults(put_gate=gate)) as e:
        if not pinned:  # negative control: the connector's pins do nothing
            e.connector.alloc = type("NoPins", (), {"pin": lambda s, ids: None, "unpin": lambda s, ids: None})()
        e.generate([TURN1], ANSWER)
        held = e.alloc.num_blocks - e.alloc.num_free   # the request finished: only pinned blocks held
        gate.set()
        e.drain()
        assert e.alloc.num_free == e.alloc.num_blocks
    if pinned:
        assert held == (len(TURN1) + ANSWER - 1) // BS   # prefill's 2 + the decode-filled blocks
    else:
        assert held == 0                                 # without pins they were reusable at once


def test_blocks_decode_rows_fill_in_mixed_batches_are_saved_too(ckpt):
    """Turn 1 decodes while a long prompt is chunked next to it (budget 8: every step a mixed batch
    of its decode row and a chunk): the blocks its decode rows fill are saved as in decode steps."""
    long = prompts(1, seed=32, lo=60, hi=61)[0]
    with _engine(ckpt, True, "sync", max_num_batched_tokens=8) as e:
        llm, plans, inner = e.core, [], e.runner.submit
        e.runner.submit = lambda plan, **kw: (plans.append(plan), inner(plan, **kw))[1]
        r = llm.add_request("t1", TURN1, max_tokens=ANSWER)
        llm.step()
        llm.add_request("long", long, max_tokens=1)
        while llm.has_work():
            llm.step()
        e.drain()
        assert sum(p.mixed for p in plans) >= 8                # most of turn 1's decodes shared steps with chunks
        turn2 = TURN1 + r.tokens + [7, 8, 9]
        hit = e.generate([turn2], 1)[0].hit_tokens
    assert hit == (len(TURN1) + ANSWER - 1) // BS * BS           # every block its decode rows filled
