"""Chunked prefill in the scheduler alone (the fake connector of test_scheduler.py): how a prompt
longer than the step budget is cut, which variant each chunk runs, what each chunk loads, saves
and samples, the mixed batches (decode rows first, then chunks), the long-prompt threshold, and preemption / abort in
the middle of a prompt. Every expectation is derived from the prompt length, the budget and the
block size, not copied from the scheduler."""
from __future__ import annotations

import math

import pytest

from graphgen.runtime.core.kvcache import BlockAllocator
from graphgen.runtime.engine.scheduler import Scheduler

from test_scheduler import BS, SPEC, FakePrefix, answer, inp, out, req


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
        s.update(p, out([7 if row.samples else None for row in p.rows]))


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
    s.update(p, out([None, 7]))
    chunks = []
    while long.cached < 30:
        p = s.schedule()
        chunks += [row.chunk for row in p.rows if row.request is long]
        assert p.prefill_tokens <= 8                  # what a running decode waits for, at most
        s.update(p, out([7 if row.samples else None for row in p.rows]))
    assert chunks == expected_chunks(8, 30, 8)


def test_mixed_batches_decode_first_then_a_chunk_in_the_same_step():
    """A running request decodes in every step while a long prompt arrives: each step carries its
    decode row first, then a chunk of the prompt in what is left of the budget, on the history
    variant (a mixed batch: a decode row is a row with history and one query token)."""
    budget = 8
    s, _ = sched(budget)
    r0 = req(1, 5, max_new=20)
    s.add(r0)
    s.update(s.schedule(), out([7]))       # r0 prefilled: it decodes from now on
    long = req(2, 30)
    s.add(long)
    plans = []
    while long.cached < 30:
        p = s.schedule()
        plans.append(p)
        s.update(p, out([7 if row.samples else None for row in p.rows]))
    chunks = expected_chunks(0, 30, budget - 1)   # the decode row takes one token of each step
    assert len(plans) == len(chunks)
    for k, (p, (lo, hi)) in enumerate(zip(plans, chunks)):
        dec, chunk = p.rows
        assert (p.variant, p.phase, p.mixed, p.decode_rows, p.decode_rows_stalled) == ("splitfuse", "prefill", True, 1, 0)
        assert dec.request is r0 and dec.decode and dec.start == 5 + k and dec.save_block_ids == ()
        assert chunk.request is long and not chunk.decode and chunk.chunk == (lo, hi)
        assert p.num_tokens == 1 + hi - lo <= budget and p.prefill_tokens == hi - lo
        x = inp(p)
        assert x.query_lens.tolist() == [1, hi - lo] and x.seq_lens.tolist() == [6 + k, hi]
        assert x.positions.tolist() == [5 + k, *range(lo, hi)]
        assert x.logits_indices.tolist() == ([0, hi - lo] if hi == 30 else [0])
        assert chunk.save_keys == tuple(f"p2.b{j}" for j in range(lo // BS, hi // BS))
    assert [k for p in plans for k in p.save_keys] == [f"p2.b{j}" for j in range(30 // BS)]
    after = s.schedule()
    assert after.requests == (r0, long) and after.variant == "decode" and after.decode_rows == 2


def test_without_chunking_a_prompt_step_stalls_the_running_decodes():
    """The comparison: one variant per step, so a prompt's step holds no decode row."""
    s, _ = sched(8, chunked_prefill=False)
    r0 = req(1, 5, max_new=20)
    s.add(r0)
    s.update(s.schedule(), out([7]))
    s.add(long := req(2, 30))
    p = s.schedule()
    assert p.requests == (long,) and p.num_tokens == 30 and p.decode_rows_stalled == 1 and not p.mixed


def test_decode_rows_that_fill_the_budget_leave_the_prompt_waiting():
    s, _ = sched(2)
    a, b = req(1, 1, max_new=9), req(2, 1, max_new=9)
    s.add(a)
    s.add(b)
    s.update(p := s.schedule(), out([7] * len(p.rows)))   # both prompts in one step
    s.add(late := req(3, 6))
    p = s.schedule()
    assert p.variant == "decode" and p.requests == (a, b) and late in s.prefill and late.cached == 0


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
    s.update(p, out([None]))
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
    s.update(p1, out([None]))
    assert alloc.num_free < 16
    assert s.finalize(p2) is None      # the row is dropped; its blocks go back now
    assert alloc.num_free == 16


def step_all(s):
    p = s.schedule()              # None: nothing could run this time (e.g. a decode preempted itself)
    if p is not None:
        s.update(p, out([7 if row.samples else None for row in p.rows]))
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
