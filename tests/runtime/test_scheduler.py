"""The scheduler on its own: what each step holds, and where every KV block goes.

The connector is a stand-in that serves a chosen number of leading pool hits (the scheduler only
sees its three calls), so every expected input below is derived from the prompt and the block
size, not copied from the scheduler."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime.kvcache import BlockAllocator, OutOfBlocks
from graphgen.runtime.scheduler import Request, RequestResult, Scheduler, StepOutput

SPEC = load_spec(Path(__file__).resolve().parents[2] / "specs" / "tiny_qwen3.yaml")
BS = SPEC.kv_cache.block_size


class FakePrefix:
    """Keys are ``p<first token>.b<block>``; ``hits[first token]`` leading blocks are 'pooled'."""

    def __init__(self, hits=None):
        self.hits = hits or {}
        self.loaded: list[tuple[list[str], list[int]]] = []

    def block_keys(self, prompt):
        return [f"p{prompt[0]}.b{i}" for i in range(len(prompt) // BS)]

    def lookup(self, keys):
        return min(self.hits.get(int(keys[0].split(".")[0][1:]), 0), len(keys)) if keys else 0

    def load(self, keys, block_ids):
        self.loaded.append((list(keys), list(block_ids)))
        return len(keys)


def req(first: int, n: int, max_new: int = 2) -> Request:
    return Request(RequestResult(prompt=[first] + list(range(100, 100 + n - 1))), max_new)


def sched(num_blocks=64, hits=None, reclaim=lambda: False):
    alloc = BlockAllocator(num_blocks)
    return Scheduler(SPEC, alloc, FakePrefix(hits), reclaim=reclaim), alloc


def answer(step, token=7):
    return StepOutput(tuple([token] * len(step.requests)))


def test_step_composition_prefill_by_history_then_decode_together():
    s, alloc = sched(hits={2: 2})
    a, b = req(1, 10), req(2, 13)          # a: cold; b: 2 leading blocks in the pool
    s.add(a)
    s.add(b)
    cold = s.schedule()
    assert (cold.variant, cold.phase, cold.requests) == ("mempool_prefill", "prefill", (a,))
    x = cold.inputs
    assert x.input_ids.tolist() == a.prompt and x.positions.tolist() == list(range(10))
    assert x.query_lens.tolist() == [10] and x.seq_lens.tolist() == [10] and x.logits_indices.tolist() == [9]
    assert cold.saves and cold.save_keys == ("p1.b0", "p1.b1")     # the full blocks: 10 // 4
    assert list(cold.save_block_ids) == a.table[:2]
    assert x.slot_mapping.tolist() == [a.table[p // BS] * BS + p % BS for p in range(10)]

    warm = s.schedule()                     # before cold's update: steps may be prepared ahead
    assert (warm.variant, warm.requests) == ("splitfuse", (b,))
    assert s.connector.loaded == [(["p2.b0", "p2.b1"], b.table[:2])]
    assert b.result.hit_tokens == 2 * BS
    y = warm.inputs
    assert y.input_ids.tolist() == b.prompt[2 * BS:] and y.positions.tolist() == list(range(8, 13))
    assert y.query_lens.tolist() == [5] and y.seq_lens.tolist() == [13]
    assert warm.save_keys == ("p2.b2",) and list(warm.save_block_ids) == [b.table[2]]   # only new blocks

    assert s.update(cold, answer(cold, 5)) == [] and s.update(warm, answer(warm, 6)) == []
    dec = s.schedule()
    assert (dec.variant, dec.phase, dec.requests, dec.saves) == ("decode", "decode", (a, b), False)
    assert dec.inputs.input_ids.tolist() == [5, 6] and dec.inputs.positions.tolist() == [10, 13]
    assert dec.inputs.query_lens.tolist() == [1, 1] and dec.inputs.logits_indices.tolist() == [0, 1]
    assert dec.inputs.block_tables.shape == (2, max(len(a.table), len(b.table)))
    assert s.update(dec, answer(dec)) == [a, b]
    assert s.schedule() is None and not s.has_work()
    assert a.result.tokens == [5, 7] and b.result.tokens == [6, 7] and a.result.variant == "mempool_prefill"


def test_a_request_added_between_steps_joins_at_the_next_step():
    s, _ = sched()
    a = req(1, 5, max_new=3)
    s.add(a)
    s.update(step := s.schedule(), answer(step))
    late = req(3, 6)
    s.add(late)                             # arrives while a is decoding
    nxt = s.schedule()
    assert nxt.phase == "prefill" and nxt.requests == (late,)
    s.update(nxt, answer(nxt))
    dec = s.schedule()
    assert dec.requests == (a, late)        # then both decode in one step


def test_block_accounting_tables_grow_with_tokens_and_come_back_on_finish():
    s, alloc = sched(num_blocks=8)
    r = req(1, 7, max_new=4)                # 7 tokens + 3 decoded inputs -> positions 0..9
    s.add(r)
    step = s.schedule()
    assert len(r.table) == math.ceil(7 / BS) and alloc.num_free == 8 - len(r.table)
    s.update(step, answer(step))
    for _ in range(3):
        step = s.schedule()
        assert len(r.table) == math.ceil(int(step.inputs.seq_lens[0]) / BS)
        assert len(set(r.table)) == len(r.table)          # no block twice
        s.update(step, answer(step))
    assert r.finished and r.table == [] and alloc.num_free == 8


def test_pinned_blocks_of_a_finished_request_are_not_handed_out():
    s, alloc = sched(num_blocks=4)
    a = req(1, 8, max_new=1)                # 2 blocks, done right after prefill
    s.add(a)
    step = s.schedule()
    alloc.pin(step.save_block_ids)          # what the connector does while the save is in flight
    held = list(a.table)
    s.update(step, answer(step))
    assert a.table == [] and alloc.num_free == 2
    b = req(2, 8, max_new=1)
    s.add(b)
    bstep = s.schedule()
    assert not set(b.table) & set(held)
    c = req(3, 4, max_new=1)
    s.add(c)
    assert s.schedule() is None             # b holds the free blocks, a's are pinned: c waits
    assert c in s.prefill and c.table == [] and not c.finished
    s.update(bstep, answer(bstep))          # b finishes: its blocks (not a's) come back
    cstep = s.schedule()
    assert cstep.requests == (c,) and not set(c.table) & set(held)
    s.abort_all()
    alloc.unpin(held)
    assert alloc.num_free == 4              # c's blocks came back with the abort, a's with the unpin


def test_out_of_blocks_asks_reclaim_before_failing():
    calls = []
    alloc = BlockAllocator(2)
    held = alloc.alloc(1)

    def reclaim():                          # e.g. the oldest commit lands and releases its pins
        calls.append(1)
        if len(calls) == 1:
            alloc.free(held)
            return True
        return False

    s = Scheduler(SPEC, alloc, FakePrefix(), reclaim=reclaim)
    r = req(1, 8, max_new=1)
    s.add(r)
    step = s.schedule()
    assert calls == [1] and len(r.table) == 2 and step.requests == (r,)


def test_no_lookup_without_prefix_cache_or_for_short_prompts():
    s, _ = sched(hits={1: 5, 2: 5})
    s.add(short := req(1, BS))              # (len-1)//BS == 0: the last token is always computed
    assert s.schedule().variant == "mempool_prefill" and short.hit_blocks == 0
    import dataclasses
    plain = dataclasses.replace(SPEC, features=[f for f in SPEC.features if f != "prefix_cache"])
    s2 = Scheduler(plain, BlockAllocator(16), FakePrefix({2: 5}))
    s2.add(r := req(2, 13))
    assert s2.schedule().variant == "mempool_prefill" and r.hit_blocks == 0


def test_collected_logits_rows_go_to_their_request():
    s, _ = sched()
    a, b = req(1, 5, max_new=1), req(2, 6, max_new=1)
    s.add(a)
    s.add(b)
    step = s.schedule()
    logits = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 3)
    s.update(step, StepOutput((2, 2), logits))
    assert a.result.step_logits[0].tolist() == [0, 1, 2] and b.result.step_logits[0].tolist() == [3, 4, 5]
