"""The declared engine interface and the step's one output (issue 31 items 1 and 2).

- `open_engine` returns an `EngineInterface` (graphgen/runtime/engine/interface.py) and refuses a
  target whose builder does not (`interface_gaps`, with its negative control); the ranks' engines
  are checked by the same call in every test that opens one (tests/parallel).
- `runner.collect` returns a `StepOutput`: each row's logits, the `SaveReport` of the saves the
  runner made (the forward's, then the plan's saves from the cache), its forward span.
- write-backs ride in the next plan: a dirty block leaving the device is held by the scheduler (one
  reference) until the plan that carries it has landed; a plan with nothing else to run is a step
  with no forward; the runner pins the block for its commit.
"""
from __future__ import annotations

import dataclasses
import types

import pytest

from graphgen.runtime import open_engine
from graphgen.runtime.engine.interface import EngineInterface, StepAPI, interface_gaps
from graphgen.runtime.engine.step_output import StepOutput
from graphgen.runtime.launch import TARGETS, register_target
from test_continuous_batching import BS, SPEC, ckpt, prompts  # noqa: F401  (fixture)


def test_a_one_process_engine_has_the_interface_and_a_partial_one_is_refused(ckpt):
    with open_engine(SPEC, ckpt, num_blocks=16) as e:
        assert interface_gaps(e) == []
        assert e.kv_naming().block_size == BS and e.kv_pool() is e.pool and e.saves_in_flight() == 0
        assert e.speculative is False
    # negative control: an object without the calls (and a core without the step API) has gaps
    closed = []
    partial = types.SimpleNamespace(spec=SPEC, max_model_len=8, core=types.SimpleNamespace(step=list),
                                    close=lambda: closed.append(True))
    gaps = interface_gaps(partial)
    assert "kv_naming" in gaps and "generate" in gaps and "core.add_request" in gaps and "close" not in gaps
    assert "core.step" not in gaps and set(gaps) >= {"core.has_work", "saves_in_flight", "__enter__"}
    register_target("partial", lambda spec, weights, **kw: partial)
    try:
        with pytest.raises(TypeError, match="without EngineInterface's"):
            open_engine(SPEC, ckpt, target="partial")
    finally:
        TARGETS.pop("partial")
    assert closed == [True]  # what it built is closed


def test_the_protocols_name_what_drivers_use():
    """The members a driver relies on (graphgen run, serve, P/D, generate) are declared."""
    members = set(interface_gaps(object()))
    assert {"generate", "core", "drain", "stats", "close", "max_model_len", "kv_naming", "kv_pool",
            "saves_in_flight", "observe"} <= members
    assert set(interface_gaps(object(), StepAPI)) == {"add_request", "abort", "step", "has_work", "stats",
                                                      "shutdown", "eos_token_ids"}
    assert EngineInterface is not StepAPI


def _capture(engine):
    """Every (plan, output) the runner returns."""
    seen, collect = [], engine.runner.collect

    def spy(fut):
        out = collect(fut)
        seen.append((fut.plan, out))
        return out
    engine.runner.collect = spy
    return seen


def test_collect_returns_the_step_output_with_every_save_it_made(ckpt):
    """write_through with decode-time saves: the prefill's output reports the blocks its save
    pinned, a decode step's the block its row filled (saved from the cache after the forward)."""
    pool = dataclasses.replace(SPEC.pool, write="sync", save_decode=True)
    p = prompts(1, seed=61, lo=2 * BS + 1, hi=2 * BS + 2)[0]
    with open_engine(dataclasses.replace(SPEC, pool=pool), ckpt, num_blocks=16) as e:
        seen = _capture(e)
        r = e.generate([p], BS + 2)[0]
        puts = e.stats["puts"]
    assert all(isinstance(out, StepOutput) for _, out in seen)
    plan, out = seen[0]
    assert len(out.logits) == len(plan.rows) and out.logits[0].shape[0] == len(plan.rows[0].logits_positions)
    assert out.saves.pinned == plan.save_block_ids and len(plan.save_block_ids) == len(p) // BS
    assert out.spans and out.spans[0][0] == "forward" and out.spans[0][1] <= out.spans[0][2]
    decode_saved = [(plan, out) for plan, out in seen if plan.phase == "decode" and out.saves.pinned]
    assert len(decode_saved) == 1  # the one block the decode rows fill (positions 2*BS+1 .. 3*BS-1)
    plan, out = decode_saved[0]
    assert out.saves.pinned == plan.rows[0].cache_save_block_ids == (plan.rows[0].block_table[2],)
    assert puts == len(p) // BS + 1 == r.saved_blocks


def test_a_write_back_rides_in_the_next_plan_held_until_it_lands(ckpt):
    pool = dataclasses.replace(SPEC.pool, write="sync", policy="write_back", device_cache=False)
    p = prompts(1, seed=62, lo=4 * BS + 1, hi=4 * BS + 2)[0]
    with open_engine(dataclasses.replace(SPEC, pool=pool), ckpt, num_blocks=16) as e:
        seen = _capture(e)
        core, alloc = e.core, e.alloc
        core.add_request("p", p, max_tokens=2)
        while not core.scheduler.blocks.write_backs_pending:
            core.step()                      # prefill, then the decode that finishes it
        held = list(core.scheduler.blocks._write_backs)
        assert len(held) == 4 and e.stats["puts"] == 0
        assert all(alloc.refcount(b) == 1 for b, _ in held)  # the scheduler's own reference: not free
        assert core.has_work()               # a step must run them
        core.step()
        plan, out = seen[-1]
        assert plan.rows == () and plan.write_back_ids == tuple(b for b, _ in held)   # no forward
        assert out.saves.pinned == plan.write_back_ids and out.logits == ()
        assert e.stats["puts"] == 4 and not core.has_work() and alloc.num_free == alloc.num_blocks
