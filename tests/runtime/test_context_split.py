"""The context-parallel split of a prefill step (`graphgen.runtime.parallel.context_parallel`), in one process:
the head-tail pieces, each rank's step inputs, and what every rank must agree on (the gathered slot
order). The numerics at cp=2 (rank processes) are tests/parallel/test_context_parallel.py's."""

from __future__ import annotations

import pytest
import torch

from graphgen.runtime.core.kvcache import slot_mapping
from graphgen.runtime.engine.request import Request, RequestResult, RowPlan, StepPlan
from graphgen.runtime.parallel.context_parallel import cp_step_inputs, head_tail_pieces

BS = 4


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 8, 13, 64])
def test_head_tail_pieces_cover_every_token_once_with_balanced_causal_work(n, cp):
    pieces = [head_tail_pieces(n, cp, r) for r in range(cp)]
    covered = sorted(t for ps in pieces for lo, hi in ps for t in range(lo, hi))
    assert covered == list(range(n))
    sizes = [hi - lo for ps in pieces for lo, hi in ps]
    assert max(sizes) - min(sizes) <= 1
    for r, (head, tail) in enumerate(pieces):   # rank r: chunk r from the front, chunk r from the back
        assert head[0] <= tail[0] and (n < 2 * cp or (r == 0) == (head[0] == 0))
    if n % (2 * cp) == 0 and n:
        # causal work of a piece [lo, hi) ~ sum of its positions + 1: equal on every rank
        work = [sum(t + 1 for lo, hi in ps for t in range(lo, hi)) for ps in pieces]
        assert len(set(work)) == 1, work


def _row(tokens, start, table, logits=True):
    req = Request(RequestResult(prompt=list(range(start + len(tokens)))))
    n = len(tokens)
    return RowPlan(req, tuple(tokens), start, tuple(table), logits_positions=(n - 1,) if logits else ())


def test_each_rank_gets_its_pieces_and_every_rank_the_same_gathered_slots():
    # a 13-token chunk after 8 tokens of history, and a 1-token row (a decode row of a mixed batch)
    rows = (_row(list(range(100, 113)), 8, [5, 6, 7, 8, 9, 10]), _row([7], 6, [2, 3]))
    plan = StepPlan("splitfuse", "prefill", rows, saves=False)
    ins = [cp_step_inputs(plan, BS, r, 2) for r in range(2)]
    # the 13 tokens: chunks 4,3,3,3 -> rank 0 [0,4)+[10,13), rank 1 [4,7)+[7,10); the 1 token: rank 0
    assert ins[0].input_ids.tolist() == [100, 101, 102, 103, 110, 111, 112, 7]
    assert ins[1].input_ids.tolist() == [104, 105, 106, 107, 108, 109]
    assert ins[0].positions.tolist() == [8, 9, 10, 11, 18, 19, 20, 6]
    # one attention row per piece, causal up to the piece's end, over the request's block table
    assert (ins[0].seq_lens.tolist(), ins[0].query_lens.tolist()) == ([12, 21, 7], [4, 3, 1])
    assert (ins[1].seq_lens.tolist(), ins[1].query_lens.tolist()) == ([15, 18], [3, 3])
    assert ins[0].cp_counts == ins[1].cp_counts == (8, 6)
    # the gather's order (rank 0's tokens, then rank 1's): the same slots on both ranks
    assert torch.equal(ins[0].slot_mapping, ins[1].slot_mapping)
    pos = [p for i in ins for p in i.positions.tolist()]
    row_of = [0] * 7 + [1] + [0] * 6
    want = [int(slot_mapping(rows[r].block_table, p, p + 1, BS)[0]) for r, p in zip(row_of, pos)]
    assert ins[0].slot_mapping.tolist() == want
    # the logits: both rows' last tokens are rank 0's (chunk 2cp-1 and the single token)
    assert (ins[0].logits_rows.tolist(), ins[1].logits_rows.tolist()) == ([0, 1], [])
    assert ins[0].logits_indices.tolist() == [6, 7] and ins[0].num_logits == ins[1].num_logits == 2
