"""The scheduler on its own: what each step holds, and where every KV block goes.

The connector is a stand-in that serves a chosen number of leading pool hits (the scheduler only
sees its three calls), so every expected input below is derived from the prompt and the block
size, not copied from the scheduler."""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime.core.kvcache import BlockAllocator, OutOfBlocks
from graphgen.runtime.engine.request import Request, RequestResult
from graphgen.runtime.engine.runner import build_inputs
from graphgen.runtime.engine.sampling import SamplingParams
from graphgen.runtime.engine.scheduler import Scheduler
from graphgen.runtime.engine.step_output import StepOutput

SPEC = load_spec(Path(__file__).resolve().parents[2] / "specs" / "tiny_qwen3.yaml")
BS = SPEC.kv_cache.block_size


class FakePrefix:
    """Keys are ``p<first token>.b<block>``; ``hits[first token]`` leading blocks are 'pooled'."""

    def __init__(self, hits=None):
        self.hits = hits or {}
        self.loaded: list[list[str]] = []

    def block_keys(self, prompt, salt=""):
        return [f"p{prompt[0]}.b{i}{salt}" for i in range(len(prompt) // BS)]

    def lookup(self, keys):
        return min(self.hits.get(int(keys[0].split(".")[0][1:]), 0), len(keys)) if keys else 0

    def load(self, keys):
        self.loaded.append(list(keys))
        return [f"staged {k}" for k in keys]  # what the plan must carry to the runner, block by block


def req(first: int, n: int, max_new: int = 2) -> Request:
    return Request(RequestResult(prompt=[first] + list(range(100, 100 + n - 1))), SamplingParams(max_tokens=max_new))


def sched(num_blocks=64, hits=None, **kw):
    alloc = BlockAllocator(num_blocks)
    return Scheduler(SPEC, alloc, FakePrefix(hits), **kw), alloc


def answer(step, token=7):
    return tuple([token] * len(step.requests))


def out(tokens, logits=None) -> StepOutput:
    """What the engine hands ``update`` for a step: the sampled tokens (and the kept logits)."""
    return StepOutput(tokens=tuple(tokens), kept_logits=logits)


def inp(plan):
    """The CPU runner's tensors for a plan (what the module would read)."""
    return build_inputs(plan, BS)


def test_step_composition_prefill_by_history_then_decode_together():
    s, alloc = sched(hits={2: 2}, chunked_prefill=False)   # one variant per step: no mixed batches
    a, b = req(1, 10), req(2, 13)          # a: cold; b: 2 leading blocks in the pool
    s.add(a)
    s.add(b)
    cold = s.schedule()
    assert (cold.variant, cold.phase, cold.requests) == ("mempool_prefill", "prefill", (a,))
    x = inp(cold)
    assert x.input_ids.tolist() == a.prompt and x.positions.tolist() == list(range(10))
    assert x.query_lens.tolist() == [10] and x.seq_lens.tolist() == [10] and x.logits_indices.tolist() == [9]
    assert cold.saves and cold.save_keys == ("p1.b0", "p1.b1")     # the full blocks: 10 // 4
    assert list(cold.save_block_ids) == a.table[:2]
    assert x.slot_mapping.tolist() == [a.table[p // BS] * BS + p % BS for p in range(10)]

    warm = s.schedule()                     # before cold's update: steps may be prepared ahead
    assert (warm.variant, warm.requests) == ("splitfuse", (b,))
    assert s.loader.loaded == [["p2.b0", "p2.b1"]]
    assert warm.rows[0].loaded == ("staged p2.b0", "staged p2.b1")   # the plan carries the loads
    assert b.result.hit_tokens == 2 * BS
    y = inp(warm)
    assert y.load_block_ids.tolist() == b.table[:2] and x.load_block_ids.tolist() == []  # the step's kv_load
    assert y.input_ids.tolist() == b.prompt[2 * BS:] and y.positions.tolist() == list(range(8, 13))
    assert y.query_lens.tolist() == [5] and y.seq_lens.tolist() == [13]
    assert warm.save_keys == ("p2.b2",) and list(warm.save_block_ids) == [b.table[2]]   # only new blocks

    s.update(cold, out(answer(cold, 5)))
    s.update(warm, out(answer(warm, 6)))
    assert not a.finished and not b.finished
    dec = s.schedule()
    assert (dec.variant, dec.phase, dec.requests, dec.saves) == ("decode", "decode", (a, b), False)
    assert inp(dec).input_ids.tolist() == [5, 6] and inp(dec).positions.tolist() == [10, 13]
    assert inp(dec).query_lens.tolist() == [1, 1] and inp(dec).logits_indices.tolist() == [0, 1]
    assert inp(dec).block_tables.shape == (2, max(len(a.table), len(b.table)))
    assert s.update(dec, out(answer(dec))) == [7, 7] and a.finished and b.finished   # the tokens each took
    assert s.schedule() is None and not s.has_work()
    assert a.result.tokens == [5, 7] and b.result.tokens == [6, 7] and a.result.variant == "mempool_prefill"


def test_a_request_added_between_steps_joins_at_the_next_step():
    s, _ = sched(chunked_prefill=False)     # one variant per step (mixed: test_chunked_prefill.py)
    a = req(1, 5, max_new=3)
    s.add(a)
    s.update(step := s.schedule(), out(answer(step)))
    late = req(3, 6)
    s.add(late)                             # arrives while a is decoding
    nxt = s.schedule()
    assert nxt.phase == "prefill" and nxt.requests == (late,)
    s.update(nxt, out(answer(nxt)))
    dec = s.schedule()
    assert dec.requests == (a, late)        # then both decode in one step


def test_block_accounting_tables_grow_with_tokens_and_come_back_on_finish():
    s, alloc = sched(num_blocks=8)
    r = req(1, 7, max_new=4)                # 7 tokens + 3 decoded inputs -> positions 0..9
    s.add(r)
    step = s.schedule()
    assert len(r.table) == math.ceil(7 / BS) and alloc.num_free == 8 - len(r.table)
    s.update(step, out(answer(step)))
    for _ in range(3):
        step = s.schedule()
        assert len(r.table) == math.ceil(int(inp(step).seq_lens[0]) / BS)
        assert len(set(r.table)) == len(r.table)          # no block twice
        s.update(step, out(answer(step)))
    assert r.finished and r.table == [] and alloc.num_free == 8


def test_pinned_blocks_of_a_finished_request_are_not_handed_out():
    s, alloc = sched(num_blocks=4)
    a = req(1, 8, max_new=1)                # 2 blocks, done right after prefill
    s.add(a)
    step = s.schedule()
    alloc.pin(step.save_block_ids)          # what the connector does while the save is in flight
    held = list(a.table)
    s.update(step, out(answer(step)))
    assert a.table == [] and alloc.num_free == 2
    b = req(2, 8, max_new=1)
    s.add(b)
    bstep = s.schedule()
    assert not set(b.table) & set(held)
    c = req(3, 4, max_new=1)
    s.add(c)
    s.wait_for_commits = False              # the control: the allocation may not wait for a's commit
    assert s.schedule() is None             # b holds the free blocks, a's are pinned: c waits
    assert c in s.prefill and c.table == [] and not c.finished
    s.update(bstep, out(answer(bstep)))     # b finishes: its blocks come back, after a's in reuse order
    s.wait_for_commits = True
    landed = threading.Timer(0.1, alloc.unpin, [held])   # a's commit lands, on the commit thread
    landed.start()
    cstep = s.schedule()                    # a's, freed first, are next: c waits for their commit
    landed.join()
    assert cstep.requests == (c,) and c.table == held[:1] and not alloc.is_pinned(held[0])
    s.abort_all()
    assert alloc.num_free == 4              # c's blocks came back with the abort


def test_an_allocation_waits_for_the_commits_pinning_the_next_free_blocks_only():
    """Blocks free but pinned (their commit in flight): the allocation waits for the unpin, so the
    ids a request gets never depend on when a commit landed; one block short, no commit can help:
    no wait (the request that can never fit fails at once)."""
    alloc = BlockAllocator(2)
    ids = alloc.alloc(2)
    alloc.pin(ids)
    alloc.free(ids)
    s = Scheduler(SPEC, alloc, FakePrefix())
    s.add(r := req(1, 8, max_new=1))        # two blocks
    landed = threading.Timer(0.1, alloc.unpin, [ids])
    landed.start()
    t = time.perf_counter()
    step = s.schedule()
    assert step.requests == (r,) and r.table == ids and time.perf_counter() - t >= 0.05
    landed.join()
    short = Scheduler(SPEC, BlockAllocator(1), FakePrefix())
    short.add(r := req(1, 8, max_new=1))
    assert short.schedule() is None and r.finish_reason == "error" and isinstance(r.error, OutOfBlocks)


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
    s.update(step, out((2, 2), logits))
    assert a.result.step_logits[0].tolist() == [0, 1, 2] and b.result.step_logits[0].tolist() == [3, 4, 5]


def test_prefill_takes_the_oldest_variant_within_the_token_budget():
    alloc = BlockAllocator(64)
    s = Scheduler(SPEC, alloc, FakePrefix({2: 1}), max_num_batched_tokens=12, chunked_prefill=False)
    a, warm, b, c = req(1, 5), req(2, 9), req(3, 6), req(4, 6)
    for r in (a, warm, b, c):
        s.add(r)
    first = s.schedule()                    # a (5) + b (6) fit 12; c would make 17; warm is splitfuse
    assert (first.variant, first.requests) == ("mempool_prefill", (a, b))
    second = s.schedule()                   # the oldest admitted left is warm: its variant next
    assert (second.variant, second.requests) == ("splitfuse", (warm,))
    third = s.schedule()
    assert third.requests == (c,) and third.num_tokens == 6


def test_max_num_seqs_bounds_admission():
    s = Scheduler(SPEC, BlockAllocator(64), FakePrefix(), max_num_seqs=2)
    rs = [req(i, 5) for i in range(1, 5)]
    for r in rs:
        s.add(r)
    assert s.schedule().requests == tuple(rs[:2]) and list(s.waiting) == rs[2:]


def test_decode_out_of_blocks_preempts_the_newest_and_it_resumes_with_its_tokens():
    s, alloc = sched(num_blocks=4)
    old, new = req(1, 4, max_new=6), req(2, 4, max_new=6)   # one full block each
    s.add(old)
    s.add(new)
    s.update(p := s.schedule(), out((11, 22)))
    assert alloc.num_free == 2
    s.update(d := s.schedule(), out((12, 23)))       # position 4: a 2nd block each
    assert d.requests == (old, new) and alloc.num_free == 0
    s.update(d := s.schedule(), out((13, 24)))
    s.update(d := s.schedule(), out((14, 25)))
    s.update(d := s.schedule(), out((15, 26)))       # positions 5..7: still the 2nd block
    d = s.schedule()                                        # position 8: a 3rd block for old
    assert d.requests == (old,) and list(s.waiting) == [new] and new.table == []
    assert new.result.preemptions == 1 and new.tokens == [22, 23, 24, 25, 26] and new.cached == 0
    s.update(d, out((16,)))
    assert old.finished and old.finish_reason == "length" and old.tokens == [11, 12, 13, 14, 15, 16]
    resume = s.schedule()                                   # prompt + generated tokens, recomputed
    assert resume.phase == "prefill" and resume.requests == (new,)
    assert inp(resume).input_ids.tolist() == new.prompt + [22, 23, 24, 25, 26]
    s.update(resume, out((27,)))
    assert new.finished and new.tokens == [22, 23, 24, 25, 26, 27] and alloc.num_free == 4


def test_a_step_scheduled_ahead_gets_its_tokens_and_loses_finished_rows_in_finalize():
    s, alloc = sched()
    a, b = req(1, 5, max_new=4), req(2, 6, max_new=4)
    s.add(a)
    s.add(b)
    pre = s.schedule()
    ahead = s.schedule()                    # decode prepared before the prefill's tokens exist
    assert ahead.phase == "decode" and tuple(i for i, r in enumerate(ahead.rows) if r.pending) == (0, 1)
    assert inp(ahead).input_ids.tolist() == [-1, -1] and inp(ahead).positions.tolist() == [5, 6]
    assert s.schedule() is None             # nothing more can be prepared: tokens are pending
    s.update(pre, out((7, 8)))
    s.abort(a)                              # a's blocks are still written by `ahead`: kept
    assert a.table and a in s.deferred
    ready = s.finalize(ahead)
    assert ready.requests == (b,) and inp(ready).input_ids.tolist() == [8]
    assert inp(ready).positions.tolist() == [6] and inp(ready).logits_indices.tolist() == [0]
    assert inp(ready).block_tables.tolist() == [b.table + [0] * (inp(ready).block_tables.shape[1] - len(b.table))]
    assert a.table == [] and not s.deferred
