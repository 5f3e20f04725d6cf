"""Speculative decoding with the MTP layer on the CPU ranks (issue 38 item 1; docs/mtp.md, "With ranks").

Every rank runs the drafter's steps in lockstep with its own scheduler (the MTP graph sharded like a decoder
layer, its collectives in the graph), the rejection is computed by every rank from the same gathered logits
(the plan check of the next step would raise if two ranks decided differently), and the draft KV is saved and
loaded with the target's under the rank's shard keys (the MLA latent put once, by rank 0). Under DP attention
each DP group drafts for its own requests, and a group that does not draft in a tick runs dummy forwards of the
MTP graph (`dp_rank.CpuDPForward`: the forward's kind agreed), so the MTP layer's MoE gather pairs up.

Compared with one rank on the same checkpoint (float32): greedy tokens margin-aware (`support.tokens`), each
draft run's logits within ATOL, acceptance equal; after a pool hit the draft logits equal the cold run's and the
acceptance counts are equal; perfect drafts (the greedy continuation) are all accepted on the ranks; negative
control: a pool that loses the MTP layer's KV on every rank changes the drafts.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import SamplingParams, open_engine
from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint
from support.hf import ATOL, rand_prompt
from support.paths import TINY_DSV3_MTP
from support.tokens import assert_results_agree

SPEC = load_spec(TINY_DSV3_MTP)
K, NEW = 2, 6
OPTIONS = {"num_blocks": 48, "collect_logits": True, "num_speculative_tokens": K}
TIMEOUT = 60


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return write_random_hf_checkpoint(str(tmp_path_factory.mktemp("mtp_ranks") / "ckpt"), "deepseek_v3",
                                      dataclasses.asdict(SPEC.dims), seed=11, tokenizer=False, mtp_layers=1)


def _prompts():
    g = torch.Generator().manual_seed(38)
    return [rand_prompt(g, 11), rand_prompt(g, 5)]  # 11 tokens: (11 - 1) // 4 = 2 blocks looked up with MTP


# a P/D prefill's prompt (serve --role prefill runs it with max_tokens 1): 13 tokens, 3 full blocks, all handed off
HANDOFF = rand_prompt(torch.Generator().manual_seed(3813), 13)


@pytest.fixture(scope="module")
def one_rank(mtp_ckpt):
    """The references: one rank's plain greedy run and its speculative run (write sync)."""
    prompts = _prompts()
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="sync", num_blocks=48, collect_logits=True) as e:
        plain = e.generate(prompts, NEW)
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="sync", **OPTIONS) as e:
        spec = e.generate(prompts, NEW)
    return plain, spec


@pytest.fixture(scope="module")
def one_rank_handoff(mtp_ckpt):
    """One rank's cold speculative run of HANDOFF (write off: nothing in a pool)."""
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="off", **OPTIONS) as e:
        return e.generate([HANDOFF], NEW)[0]


# ---- probes run in every rank process (`DistributedEngine.on_ranks`) --------------------------------------
def _perfect(want: dict, r, logits, drafts, probs) -> None:
    """The greedy continuation after what is drafted so far (the drafter's ``_pick``)."""
    drafts[id(r)].append(want[tuple(r.prompt)][len(r.tokens) + len(drafts[id(r)])])


def _set_perfect_drafts(engine, want) -> None:
    if want is None:
        engine.core.drafter.__dict__.pop("_pick", None)
    else:
        engine.core.drafter._pick = functools.partial(_perfect, want)


def _drop_mtp_kv(engine, on: bool) -> None:
    """What a pool that stores only the target model's KV hands back (the MTP layer's part of every loaded
    block zeroed), on this rank; ``on=False`` undoes it."""
    loader = engine.loader
    if not on:
        loader.__dict__.pop("load", None)
        return
    real, L = loader.load, engine.spec.dims.num_hidden_layers

    def target_only(keys):
        blocks = real(keys)
        for blk in blocks:
            for part in blk[L]:
                part.zero_()
        return blocks

    loader.load = target_only


def _dummy_kinds(engine) -> dict:
    return dict(engine.runner.dp.dummy_kinds)


def _drafts_close(a, b, what: str) -> None:
    assert len(a.draft_logits) == len(b.draft_logits) > 0, what
    worst = max((x - y).abs().max().item() for x, y in zip(a.draft_logits, b.draft_logits))
    assert worst <= ATOL, f"{what}: draft logits differ by {worst}"


def _counts(r) -> tuple:
    return r.num_draft_tokens, r.num_accepted_tokens, tuple(r.accepted_per_pos)


def _agree_with_one_rank(plain, ref, got, what: str) -> None:
    """``got`` (the ranks' speculative results) vs the one-rank greedy run ``plain`` and speculative run ``ref``:
    ranks reorder the reductions, so tokens equal up to a near tie at ATOL; each draft run's logits the one
    rank's; the acceptance counts the same."""
    assert_results_agree(plain, got, ATOL, where=f"{what} speculative vs one-rank greedy")
    assert_results_agree(ref, got, ATOL, where=f"{what} vs one-rank speculative")
    for a, b in zip(ref, got):
        _drafts_close(a, b, f"{what} vs one rank")
        assert _counts(a) == _counts(b) and b.num_draft_tokens > 0


def test_tp2_speculative_equals_one_rank_and_keeps_the_drafts_after_a_hit(mtp_ckpt, one_rank, one_rank_handoff):
    plain, ref = one_rank
    prompts = _prompts()
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="sync", tp=2, timeout=TIMEOUT, **OPTIONS) as eng:
        cold = eng.generate(prompts, NEW)
        eng.drain()
        # tokens: the plain run's and the one-rank speculative run's (two ranks reorder the reductions:
        # equal up to a near tie at ATOL), each draft run's logits the one rank's, acceptance the same
        _agree_with_one_rank(plain, ref, cold, "tp=2")
        assert cold[0].saved_blocks == 2  # the long prompt's two full blocks, successor-keyed
        stats = eng.rank_stats
        assert stats[0]["puts"] >= 2 and stats[1]["puts"] == 0 and stats[1]["skipped_puts"] >= 2  # latent once

        warm = eng.generate(prompts[:1], NEW)[0]  # a full prefix hit from the pool on both ranks
        assert warm.hit_tokens == 8 and warm.tokens == cold[0].tokens
        _drafts_close(cold[0], warm, "tp=2 after a pool hit")
        assert _counts(warm) == _counts(cold[0])

        # a P/D prefill on these ranks (serve --role prefill: max_tokens 1). The handoff names the ranks'
        # successor-keyed blocks (the MLA latent one shard, put by rank 0); the request, finished on its first
        # token, keeps its blocks for the draft run after its step, which saves every handed-off block on every
        # rank, the MTP layer's KV included: a later request hits them all and drafts as a cold one rank does
        naming = eng.block_naming()
        assert naming.lookahead and naming.shards == ("r0of2",)
        (keys,) = naming.handoff_keys(HANDOFF)
        assert len(keys) == 3 and all("@la" in k for k in keys) and eng.pool.leading_run(keys) == 0
        pre = eng.generate([HANDOFF], 1)[0]
        eng.drain()
        assert pre.saved_blocks == 3 and pre.num_draft_tokens == 0 and eng.pool.leading_run(keys) == 3
        decoded = eng.generate([HANDOFF], NEW)[0]  # what D runs after the handoff (here on the same ranks)
        assert decoded.hit_tokens == 12
        assert_results_agree([one_rank_handoff], [decoded], ATOL, where="tp=2 after its own prefill's handoff")
        _drafts_close(one_rank_handoff, decoded, "tp=2 after the handoff vs a cold one rank")
        assert _counts(decoded) == _counts(one_rank_handoff)

        # perfect drafts: every verify position's logits used, and the ranks agree on every acceptance
        eng.on_ranks(_set_perfect_drafts, {tuple(p): r.tokens for p, r in zip(prompts, cold)})
        perfect = eng.generate(prompts, NEW)
        eng.drain()
        again = eng.generate(prompts[:1], NEW)[0]  # after a hit: the same acceptance
        eng.on_ranks(_set_perfect_drafts, None)
        for p, r in zip(cold, perfect):
            assert r.tokens == p.tokens and r.num_accepted_tokens == r.num_draft_tokens > 0
        assert again.hit_tokens == 8 and _counts(again) == _counts(perfect[0])

        # a sampled request: each rank's seeded generator draws the same drafts and the same rejections
        # (a rank deciding otherwise would plan another next step: the plan check raises)
        sampled = []
        for n, seed in enumerate((5, 5)):
            eng.core.add_request(f"s{n}", prompts[1], SamplingParams(max_tokens=NEW, temperature=0.8, seed=seed))
            toks = []
            while eng.core.has_work():
                toks += [t for o in eng.core.step() for t in o.new_token_ids]
            sampled.append(toks)
        assert sampled[0] == sampled[1] and len(sampled[0]) == NEW

        # negative control: the pool hands back the target's KV only: the drafts after the hit change (also
        # after the handoff: the MTP KV the held request's draft run saved is what the drafts read)
        eng.on_ranks(_drop_mtp_kv, True)
        lost = eng.generate([prompts[0], HANDOFF], NEW)
        eng.on_ranks(_drop_mtp_kv, False)
        for want, got, hit in ((cold[0], lost[0], 8), (decoded, lost[1], 12)):  # the same ranks' runs
            assert got.hit_tokens == hit and got.tokens == want.tokens  # the target verifies: output unchanged
            worst = max((a - b).abs().max().item() for a, b in zip(want.draft_logits, got.draft_logits))
            assert worst > 1e-3, "the ranks' drafts did not read the MTP layer's pooled KV"


def _unshifted_piece_ends(engine, on: bool) -> None:
    """What a CP split that shifts each piece on its own rank's tokens only would feed the MTP layer: every row of a
    draft run whose successor token lies in another rank's piece gets none (token 0), on this rank; the last row of
    each request keeps its token (a piece-local shift has it too). ``on=False`` undoes it."""
    split = engine.runner.split
    split.__dict__.pop("step_inputs", None)
    if not on:
        return
    real = split.step_inputs

    def unshifted(plan, block_size):
        share = real(plan, block_size)
        if plan.prev_hidden is not None and share.input_ids.numel():
            mine = share.mine(split.cp_rank).tolist()  # this rank's tokens' indices in the plan's order
            row_ends = {n - 1 for n in itertools.accumulate(r.num_tokens for r in plan.rows)}
            cut = [j for j, i in enumerate(mine) if i not in row_ends and (j + 1 == len(mine) or mine[j + 1] != i + 1)]
            share.input_ids = share.input_ids.clone()
            share.input_ids[cut] = 0
        return share

    split.step_inputs = unshifted


def test_cp2_tp2_speculative_equals_one_rank_and_keeps_the_drafts_after_a_hit(mtp_ckpt, one_rank):
    """``--cp 2 --tp 2`` with MTP (four ranks): each prefill split head-tail over the CP ranks, the target's hidden
    states gathered back into token order, every draft run split the same way (row t holds token t+1: the shift
    crosses the piece boundaries, every rank knowing the ids), the MTP layer's KV all-gathered over cp, its logits
    reduced; inside each CP rank the MTP layer sharded over tp as at tp alone; the prompt's successor-keyed blocks
    (the MLA latent) put by rank 0 only (CP rank 0, TP rank 0). Write async (the spec's mode)."""
    plain, ref = one_rank
    prompts = _prompts()
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="async", cp=2, tp=2, timeout=TIMEOUT, **OPTIONS) as eng:
        cold = eng.generate(prompts, NEW)   # 11 and 5 tokens: pieces of unequal sizes, one empty on a rank
        eng.drain()
        stats = eng.rank_stats
        warm = eng.generate(prompts[:1], NEW)[0]  # a full prefix hit on both CP ranks
        eng.on_ranks(_unshifted_piece_ends, True)
        wrong = eng.generate(prompts[:1], NEW)[0]  # the hit again: its first draft run's 3 rows split 1 + 2
        eng.on_ranks(_unshifted_piece_ends, False)
    _agree_with_one_rank(plain, ref, cold, "cp=2 tp=2")
    assert cold[0].saved_blocks == 2  # the long prompt's two full blocks, successor-keyed
    # the latent is the same on every rank: rank 0 (CP rank 0's TP rank 0) alone puts it
    assert stats[0]["puts"] >= 2 and all(s["puts"] == 0 and s["skipped_puts"] >= 2 for s in stats[1:]), stats
    assert warm.hit_tokens == 8 and warm.tokens == cold[0].tokens
    _drafts_close(cold[0], warm, "cp=2 tp=2 after a pool hit")
    assert _counts(warm) == _counts(cold[0])
    # negative control: rows whose successor is in the other rank's piece without it draft otherwise (the MTP KV
    # at those positions, which the last row reads; the target still verifies)
    assert wrong.hit_tokens == 8 and wrong.tokens == cold[0].tokens
    worst = max((a - b).abs().max().item() for a, b in zip(cold[0].draft_logits, wrong.draft_logits))
    assert worst > 1e-3, "the draft logits do not depend on the successor tokens across the piece boundaries"


def test_dp2_ep2_speculative_drafts_per_group_with_dummy_draft_runs(mtp_ckpt, one_rank):
    """Both DP groups busy at once with prompts of different lengths (their draft runs at different ticks and
    counts), then one group alone (the other serves its forwards with dummies of the agreed kind); a prefix saved
    through one group hits on the other with the same drafts."""
    plain, ref = one_rank
    prompts = _prompts()
    with open_engine(TINY_DSV3_MTP, mtp_ckpt, write="sync", dp=2, ep=2, timeout=TIMEOUT, **OPTIONS) as eng:
        both = eng.generate(prompts, NEW, batch=True, ranks=[0, 1])
        eng.drain()
        alone = eng.generate(prompts[1:], NEW, ranks=[1])[0]
        kinds = eng.on_ranks(_dummy_kinds)
        hit = eng.generate(prompts[:1], NEW, ranks=[1])[0]  # saved through DP rank 0
    for what, got in (("both groups busy", both), ("one group", [both[0], alone])):
        assert_results_agree(plain, got, ATOL, where=f"dp=2 {what} vs one-rank greedy")
        for a, b in zip(ref, got):
            _drafts_close(a, b, f"dp=2 {what} vs one rank")
            assert _counts(a) == _counts(b)
    # the idle group ran the MTP graph's dummies (the draft runs' MoE gather padded), and the target's
    assert kinds[0][2] > 0 and kinds[0][1] > 0, kinds
    assert hit.hit_tokens == 8 and hit.tokens == both[0].tokens
    _drafts_close(both[0], hit, "dp=2 hit through the other group")
    assert _counts(hit) == _counts(both[0])
