"""Chunked prefill in the scheduler alone (the fake connector of test_scheduler.py): how a prompt
longer than the step budget is cut, which variant each chunk runs, what each chunk loads, saves
and samples, the decode-first interleaving, the long-prompt threshold, and preemption / abort in
the middle of a prompt. Every expectation is derived from the prompt length, the budget and the
block size, not copied from the scheduler."""
from __future__ import annotations

import math

import pytest

from graphgen.runtime.core.kvcache import BlockAllocator
from graphgen.runtime.engine.scheduler import Scheduler

from test_scheduler import BS, SPEC, FakePrefix, answer, inp, req


def sched(budget, num_blocks=64, hits=None, **kw):
    alloc = BlockAllocator(num_blocks)
    return Scheduler(SPEC, alloc, FakePrefix(hits), max_num_batched_tokens=budget, **kw), alloc


def run_prefill(s):
    """Schedule and answer steps until the first decode step; returns the prefill plans."""
    plans = []
    while True:
        p = s.schedule()
        assert p is not None
        if p.phase == "decode":
            return plans, p
        plans.append(p)
        s.update(p, [7 if row.samples else None for row in p.rows])


def expected_chunks(start, n, budget):
    out = []
    while start < n:
        out.append((start, min(n, start + budget)))
        start = out[-1][1]
    return out


@pytest.mark.parametrize("budget", [8, 6, 5])  # 8: chunks end on block edges; 6, 5: blocks straddle chunks
def test_a_long_prompt_runs_in_chunks_each_saving_the_blocks_it_completes(budget):
    n = 30
    s, alloc = sched(budget)
    a = req(1, n)
    s.add(a)
    plans, decode = run_prefill(s)
    chunks = expected_chunks(0, n, budget)
    assert [p.rows[0].chunk for p in plans] == chunks
    assert [p.variant for p in plans] == ["mempool_prefill"] + ["splitfuse"] * (len(chunks) - 1)
    assert all(p.num_tokens <= budget for p in plans)
    assert [p.rows[0].samples for p in plans] == [False] * (len(chunks) - 1) + [True]
    assert [p.rows[0].logits_positions for p in plans] == [()] * (len(chunks) - 1) + [(n - chunks[-1][0] - 1,)]
    for p, (lo, hi) in zip(plans, chunks):
        row, x = p.rows[0], inp(p)
        done = range(lo // BS, hi // BS)                       # the blocks full once this chunk ran
        assert row.save_keys == tuple(f"p1.b{j}" for j in done), (lo, hi)
        assert row.save_block_ids == tuple(a.table[j] for j in done)
        assert row.load_block_ids == () and row.loaded == ()
        assert x.input_ids.tolist() == a.prompt[lo:hi] and x.positions.tolist() == list(range(lo, hi))
        assert x.query_lens.tolist() == [hi - lo] and x.seq_lens.tolist() == [hi]   # attends to the history
        assert x.slot_mapping.tolist() == [a.table[q // BS] * BS + q % BS for q in range(lo, hi)]
    saved = [k for p in plans for k in p.save_keys]
    assert saved == [f"p1.b{j}" for j in range(n // BS)]       # every full block once, in order
    assert a.result.saved_blocks == n // BS and a.result.tokens == [7]
    assert decode.rows[0].start == n and len(a.table) == math.ceil((n + 1) / BS)


def test_the_first_chunk_loads_the_pool_hit_and_the_saves_start_after_it():
    s, _ = sched(8, hits={2: 3})
    b = req(2, 30)
    s.add(b)
    plans, _ = run_prefill(s)
    hit = 3 * BS
    assert [p.rows[0].chunk for p in plans] == expected_chunks(hit, 30, 8)
    assert all(p.variant == "splitfuse" for p in plans)
    first, *rest = plans
    assert first.rows[0].load_block_ids == tuple(b.table[:3]) and len(first.rows[0].loaded) == 3
    assert all(p.rows[0].load_block_ids == () and p.rows[0].loaded == () for p in rest)
    assert [k for p in plans for k in p.save_keys] == [f"p2.b{j}" for j in range(3, 30 // BS)]


def test_without_chunking_a_long_prompt_is_one_oversized_step():
    s, _ = sched(8, chunked_prefill=False)
    a = req(1, 30)
    s.add(a)
    plans, _ = run_prefill(s)
    assert len(plans) == 1 and plans[0].rows[0].chunk == (0, 30) and plans[0].rows[0].samples
    assert plans[0].save_keys == tuple(f"p1.b{j}" for j in range(30 // BS))


def test_long_prefill_token_threshold_caps_long_prompts_only():
    s, _ = sched(64, long_prefill_token_threshold=8)
    long, short = req(1, 30), req(2, 7)
    s.add(long)
    s.add(short)
    p = s.schedule()                  # the long prompt's first 8, and the short one whole (not long)
    assert [(row.request, row.chunk) for row in p.rows] == [(long, (0, 8)), (short, (0, 7))]
    s.update(p, [None, 7])
    chunks = []
    while long.cached < 30:
        p = s.schedule()
        if p.phase == "prefill":
            chunks.append(p.rows[0].chunk)
        s.update(p, [7 if row.samples else None for row in p.rows])
    assert chunks == expected_chunks(8, 30, 8)


def test_decode_first_while_a_prompt_is_mid_way():
    """A running request decodes between every two chunks of a long prompt that arrived."""
    s, _ = sched(8)
    r0 = req(1, 5, max_new=20)
    s.add(r0)
    s.update(s.schedule(), [7])       # r0 prefilled: it decodes from now on
    long = req(2, 30)
    s.add(long)
    phases = []
    while long.cached < 30:
        p = s.schedule()
        phases.append((p.phase, p.requests))
        s.update(p, [7 if row.samples else None for row in p.rows])
    n_chunks = len(expected_chunks(0, 30, 8))
    # a new prompt's first chunk goes first (prefill first), then decode and chunk alternate
    want = [("prefill", (long,))] + [("decode", (r0,)), ("prefill", (long,))] * (n_chunks - 1)
    assert phases == want
    assert s.schedule().requests == (r0, long)   # both decode together once the prompt is in


def test_the_step_budget_is_shared_and_a_second_prompt_gets_the_rest():
    s, _ = sched(8, hits={2: 1})
    a, b = req(2, 6), req(2, 14)      # same first token: both hit 1 block (splitfuse group)
    s.add(a)
    s.add(b)
    p = s.schedule()
    assert [(row.request, row.chunk) for row in p.rows] == [(a, (BS, 6)), (b, (BS, BS + 6))]
    assert p.num_tokens == 8 and [row.samples for row in p.rows] == [True, False]


def test_abort_mid_prompt_gives_every_block_back():
    s, alloc = sched(8, num_blocks=16)
    a = req(1, 30)
    s.add(a)
    p = s.schedule()
    s.update(p, [None])
    assert alloc.num_free == 16 - 2 and a in s.prefill
    s.abort(a)
    assert a.finish_reason == "abort" and a.table == [] and alloc.num_free == 16
    assert s.schedule() is None and not s.has_work()


def test_abort_mid_prompt_while_its_chunk_is_in_flight_frees_after_that_step():
    s, alloc = sched(8, num_blocks=16)
    a = req(1, 30)
    s.add(a)
    p1 = s.schedule()
    p2 = s.schedule()                  # scheduled ahead (async scheduling): its next chunk
    assert p2.rows[0].chunk == (8, 16) and a.in_steps == 2
    s.abort(a)
    assert alloc.num_free < 16         # both steps may still write its blocks
    s.update(p1, [None])
    assert alloc.num_free < 16
    assert s.finalize(p2) is None      # the row is dropped; its blocks go back now
    assert alloc.num_free == 16


def step_all(s):
    p = s.schedule()              # None: nothing could run this time (e.g. a decode preempted itself)
    if p is not None:
        s.update(p, [7 if row.samples else None for row in p.rows])
    return p


def test_a_decode_short_of_blocks_preempts_a_prompt_mid_way_and_it_restarts():
    nb = 8                             # r0 needs 5 blocks at the end, long 6: not both at once
    s, alloc = sched(8, num_blocks=nb)
    r0 = req(1, 8, max_new=12)
    s.add(r0)
    step_all(s)                        # r0: 2 blocks, decoding
    long = req(2, 24, max_new=1)
    s.add(long)
    for _ in range(100):               # until a decode needs a block that only `long` holds
        step_all(s)
        if long.result.preemptions:
            break
    assert long.result.preemptions == 1 and not r0.finished
    assert long in s.waiting and long.table == [] and long.cached == 0
    assert s.num_preemptions == 1
    assert alloc.num_free + len(r0.table) == nb
    before = long.result.saved_blocks              # the chunks that ran before it was preempted
    assert 0 < before < 24 // BS
    for _ in range(200):               # r0 finishes, then long is recomputed from its first chunk
        if not s.has_work():
            break
        step_all(s)
    assert r0.finish_reason == "length" and long.finish_reason == "length" and alloc.num_free == nb
    assert long.result.saved_blocks == before + 24 // BS   # the recompute saves every block again
