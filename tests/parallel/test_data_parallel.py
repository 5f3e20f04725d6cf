"""DP attention + EP on CPU ranks (``tiny_deepseek_v3_dp2ep2``: dp 2, ep 2, tp 1 per group): each DP rank
has its own requests and scheduler, the MoE all-gathers both ranks' tokens, runs the rank's 4 of 8
experts and reduce-scatters; an idle rank runs dummy forwards. Numerics against transformers (fp32,
atol 1e-4) at every step of prefill, splitfuse and decode, with both ranks busy at once (different
token counts) and with one idle; tokens equal a tp=1 engine's and across write modes; a prefix saved
through one DP rank hits on the other; a repeated prompt hits on every rank; swapping the ranks'
expert ownership breaks the logits (negative control); a DP rank dying in its dummy forward is a
`RankFailure`, bounded. Few engine starts on purpose (each costs seconds on 2 loaded cores)."""

from __future__ import annotations

import time

import pytest
import torch

from graphgen.runtime import open_engine
from graphgen.runtime.parallel.launcher import RankFailure
from graphgen.runtime.engine.sampling import SamplingParams
from support.hf import ATOL, assert_steps_match_hf, hf_step_logits, rand_prompt
from support.paths import REPO
from support.tokens import assert_agree, assert_results_agree

SPEC = REPO / "specs/tiny_deepseek_v3_dp2ep2.yaml"
TIMEOUT = 60  # seconds a rank may take to answer one command


def _prompts():
    g = torch.Generator().manual_seed(11)
    a = rand_prompt(g, 10)            # two full blocks of 4 + a partial one
    b = a[:4] + rand_prompt(g, 5)     # shares the first block with a
    c, d = rand_prompt(g, 7), rand_prompt(g, 3)
    return a, b, c, d


@pytest.fixture(scope="module")
def tp1_results(tiny_dsv3):
    """A tp = dp = 1 engine's greedy results (tokens, step logits): a and b (3 new), c and d (5 new); every
    dp=2 run, at each write mode, is compared with them (EP reorders the experts' sums: support.tokens)."""
    a, b, c, d = _prompts()
    with open_engine(REPO / "specs/tiny_deepseek_v3.yaml", tiny_dsv3.dir, num_blocks=32, collect_logits=True) as one:
        return one.generate([a, b], 3) + one.generate([c, d], 5)


def _open(weights, **kw):
    return open_engine(SPEC, weights, collect_logits=True, num_blocks=32, timeout=TIMEOUT, **kw)


def _run(eng, a, b):
    """a on rank 0, then a on rank 1 (rank 0's blocks from the pool), a again on rank 0, b on rank 1."""
    out = []
    for p, r in ((a, 0), (a, 1), (a, 0), (b, 1)):
        out.append(eng.generate([p], 3, ranks=[r])[0])
        eng.drain()
    return out


def _swap_experts(rank_engine):  # on every rank (module-level: pickled by name)
    rt = rank_engine.runner.rt
    rt.expert_owner = rt.layout.ep - 1 - rt.expert_owner  # the weights stay this rank's: wrong experts


def _dummy_forwards(rank_engine):
    return rank_engine.runner.dummy_forwards


def test_dp2_ep2_matches_transformers_tp1_and_shares_prefixes_across_ranks(tiny_dsv3, tp1_results):
    model, w = tiny_dsv3.model, tiny_dsv3.dir
    a, b, c, d = _prompts()
    with _open(w) as eng:
        ra0, ra1, ra0_again, rb1 = _run(eng, a, b)
        # both ranks busy at once (7 and 3 + 10 tokens, then decodes), rank 0 idle once c is done
        rc, rd, ra = eng.generate([c, d, a], 5, batch=True, ranks=[0, 1, 1])
        dummies = eng.on_ranks(_dummy_forwards)
        # the step API (what graphgen serve drives): the router picks the rank, a tick steps every rank
        long = a + a  # 20 tokens: its first 4 blocks name its prefix; z shares them, so goes to the same rank
        eng.core.add_request("w", long, SamplingParams(max_tokens=1))
        eng.core.add_request("z", long[:16] + c, SamplingParams(max_tokens=1))
        eng.core.add_request("x", c, SamplingParams(max_tokens=2))
        eng.core.add_request("y", d, SamplingParams(max_tokens=2))
        owners = dict(eng.core.owner)
        outs = []
        while eng.core.has_work():
            outs += eng.core.step()
        stats = eng.rank_stats
        eng.on_ranks(_swap_experts)
        wrong = eng.generate([c], 2, ranks=[0])[0]
    assert [r.variant for r in (ra0, ra1, ra0_again, rb1)] == ["mempool_prefill", "splitfuse", "splitfuse",
                                                               "splitfuse"]
    assert (ra1.hit_tokens, ra0_again.hit_tokens, rb1.hit_tokens) == (8, 8, 4)  # rank 0's blocks hit on rank 1
    assert stats[0]["puts"] > 0 and stats[1]["hit_blocks"] >= 3  # keys carry no DP rank
    with torch.no_grad():
        for what, r in (("prefill", ra0), ("splitfuse on the other rank", ra1), ("splitfuse", ra0_again),
                        ("shared prefix", rb1), ("batch rank 0", rc), ("batch rank 1", rd), ("batch rank 1 hit", ra)):
            assert_steps_match_hf(model, r, f"dp=2 ep=2 {what}")
        ref = hf_step_logits(model, c, wrong.tokens)
    assert (wrong.step_logits[0] - ref[0]).abs().max().item() > 100 * ATOL  # negative control: swapped experts
    assert all(n > 0 for n in dummies)  # each rank idled while the other ran (its experts still worked)
    got = {o.req_id: [] for o in outs}
    for o in outs:
        got[o.req_id] += list(o.new_token_ids)
    assert {k: got[k] for k in "xy"} == {"x": rc.tokens[:2], "y": rd.tokens[:2]}
    assert owners["w"] == owners["z"] and not eng.core.owner  # prefix affinity; finished requests let go
    assert_results_agree(tp1_results, [ra0, rb1, rc, rd], ATOL, where="dp=2 ep=2 async vs tp=1")  # the spec's mode
    for what, r in (("on rank 1", ra1), ("again", ra0_again)):
        assert_agree(ra0.tokens, ra0.step_logits, r.tokens, r.step_logits, ATOL, where=f"prompt a {what}")
    assert_agree(ra0.tokens, ra0.step_logits, ra.tokens[:3], ra.step_logits[:3], ATOL, where="prompt a batched")


def _die_in_dummy(variant: str, source: str) -> str:
    """source_hook: a rank whose ``die_in_dummy`` is set exits in its next dummy forward (zero tokens),
    while the other rank waits in the MoE's all-gather."""
    return source.replace("    h_embed = ", "    import os\n    if getattr(rt, 'die_in_dummy', False) and "
                          "b.input_ids.numel() == 0:\n        os._exit(3)\n    h_embed = ", 1)


def _arm(rank_engine):  # on every rank: only DP rank 1 will die
    rank_engine.runner.rt.die_in_dummy = rank_engine.runner.rt.coords.dp_rank == 1


def test_dp2_ep2_write_modes_give_the_same_tokens_and_a_dead_rank_is_reported(tiny_dsv3, tp1_results):
    """off and sync (the test above: async), one engine each: they agree with tp=1 (support.tokens; so across all three modes)."""
    w = tiny_dsv3.dir
    a, b, _, _ = _prompts()
    runs = {}
    for write in ("off", "sync"):
        with _open(w, write=write, **({"source_hook": _die_in_dummy} if write == "off" else {})) as eng:
            runs[write] = _run(eng, a, b)
            if write == "off":
                eng.on_ranks(_arm)
                t0 = time.monotonic()
                with pytest.raises(RankFailure, match=r"rank 1 exited \(code 3\)"):
                    eng.generate([a], 2, ranks=[0])
                assert time.monotonic() - t0 < 30
    assert [r.hit_tokens for r in runs["off"]] == [0, 0, 0, 0]
    assert [r.hit_tokens for r in runs["sync"]] == [0, 8, 8, 4]  # a repeated prompt hits on every rank
    want = [tp1_results[0]] * 3 + [tp1_results[1]]   # a on rank 0, a on rank 1, a on rank 0, b on rank 1
    for write in ("off", "sync"):
        assert_results_agree(want, runs[write], ATOL, where=f"dp=2 ep=2 {write} vs tp=1")


# ---- tp inside each DP group (dp 2 × tp 2, ep 4) -----------------------------------------------------------
def _lockstep_probe(rank_engine):  # on every rank: (dp rank, tp rank, skipped puts, its plan check's group size)
    import torch.distributed as dist

    rt, runner = rank_engine.runner.rt, rank_engine.runner
    check = runner.feature("plan_check")
    return (rt.coords.dp_rank, rt.coords.tp_rank, getattr(rank_engine.connector.pool, "skipped_puts", 0),
            dist.get_world_size(check.group) if check is not None else None)


def _match_hf_per_group(model, results, where: str) -> None:
    """Every step of a tp-inside-DP run's results (`_run`'s four, then the batch over both groups) vs transformers."""
    whats = ("prefill", "splitfuse on the other group", "splitfuse", "shared prefix", "batch group 0",
             "batch group 1", "batch group 1 hit")
    for what, r in zip(whats, results, strict=True):
        assert_steps_match_hf(model, r, f"{where} {what}")


def test_dp2_tp2_ep4_matches_transformers_and_one_rank(tiny_dsv3, tp1_results):
    """tiny DeepSeek at dp 2 × tp 2 (ep 4, the spec's dp2ep2 layout overridden as --dp/--tp/--ep do): attention
    at tp 2 inside each DP group, the MoE over all 4 ranks, the ep reduce-scatter cutting each DP group's rows
    over its 2 TP ranks (a 1-token decode: one rank 1 row, the other 0) and the TP gather after it. Every step
    of prefill, splitfuse and decode against transformers (fp32, atol 1e-4), with both groups busy at once and
    one idle (both its TP ranks in dummy forwards); a prefix saved through one DP group hits on the other (keys
    per TP shard, the MLA latent put by TP rank 0 only); the plan check runs on each DP group's 2 ranks; the
    step API gives each DP group's outputs once. Negative control: swapped expert ownership breaks the logits."""
    model, w = tiny_dsv3.model, tiny_dsv3.dir
    a, b, c, d = _prompts()
    with open_engine(REPO / "specs/tiny_deepseek_v3.yaml", w, dp=2, tp=2, ep=4, collect_logits=True,
                     num_blocks=32, timeout=TIMEOUT) as eng:
        assert type(eng).__name__ == "DataParallelEngine" and eng.world == 4
        ra0, ra1, ra0_again, rb1 = _run(eng, a, b)
        rc, rd, ra = eng.generate([c, d, a], 5, batch=True, ranks=[0, 1, 1])
        dummies = eng.on_ranks(_dummy_forwards)
        eng.core.add_request("x", c, SamplingParams(max_tokens=2))
        eng.core.add_request("y", d, SamplingParams(max_tokens=2))
        outs = []
        while eng.core.has_work():
            outs += eng.core.step()
        per_group = eng.core.stats()["per_rank"]
        probes = eng.on_ranks(_lockstep_probe)
        eng.on_ranks(_swap_experts)
        wrong = eng.generate([c], 2, ranks=[0])[0]
    assert [r.variant for r in (ra0, ra1, ra0_again, rb1)] == ["mempool_prefill", "splitfuse", "splitfuse",
                                                               "splitfuse"]
    assert (ra1.hit_tokens, ra0_again.hit_tokens, rb1.hit_tokens) == (8, 8, 4)  # group 0's blocks hit on group 1
    with torch.no_grad():
        _match_hf_per_group(model, (ra0, ra1, ra0_again, rb1, rc, rd, ra), "dp=2 tp=2 ep=4")
        ref = hf_step_logits(model, c, wrong.tokens)
    assert (wrong.step_logits[0] - ref[0]).abs().max().item() > 100 * ATOL  # negative control: swapped experts
    assert_results_agree(tp1_results, [ra0, rb1, rc, rd], ATOL, where="dp=2 tp=2 ep=4 vs tp=1")  # one rank's tokens, margin-aware
    assert all(n > 0 for n in dummies), dummies  # each group's two ranks idled while the other group ran
    assert dummies[0] == dummies[1] and dummies[2] == dummies[3]  # a group's TP ranks in lockstep
    got = {}
    for o in outs:
        got.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert got == {"x": rc.tokens[:2], "y": rd.tokens[:2]}  # each group's outputs once, not once per TP rank
    assert len(per_group) == 2
    assert [p[:2] for p in probes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert probes[0][2] == probes[2][2] == 0 and probes[1][2] > 0 and probes[3][2] > 0  # latent put by TP rank 0
    assert {p[3] for p in probes} == {2}  # the plan check on each DP group's ranks, not the world


def test_dp2_tp2_ep4_with_sequence_parallel_matches_transformers_and_one_rank(tiny_dsv3, tp1_results):
    """sp inside each DP group (dp 2 × tp 2, ep 4, sp): the reductions over tp are reduce-scatters, the residual
    stream and norms on 1/tp of the group's tokens, and the MoE's ep reduce-scatter (each DP group's rows cut
    over its TP ranks) is that same shard, so no TP gather follows it. Every step vs transformers with both
    groups busy and one idle, a prefix saved through one group hitting on the other; tokens vs one rank; the TP
    ranks taking each other's rows breaks the logits (negative control: with sp off the probe changes nothing)."""
    from support.probes import swap_sp_rows

    model, w = tiny_dsv3.model, tiny_dsv3.dir
    a, b, c, d = _prompts()
    even = rand_prompt(torch.Generator().manual_seed(12), 8)   # 4 tokens per TP rank: the probe's even cut
    with open_engine(REPO / "specs/tiny_deepseek_v3.yaml", w, dp=2, tp=2, ep=4, sp=True, collect_logits=True,
                     num_blocks=32, timeout=TIMEOUT) as eng:
        ra0, ra1, ra0_again, rb1 = _run(eng, a, b)
        rc, rd, ra = eng.generate([c, d, a], 5, batch=True, ranks=[0, 1, 1])
        dummies = eng.on_ranks(_dummy_forwards)
        eng.on_ranks(swap_sp_rows)
        wrong = eng.generate([even], 1, ranks=[0])[0]
    assert (ra1.hit_tokens, ra0_again.hit_tokens, rb1.hit_tokens) == (8, 8, 4)  # group 0's blocks hit on group 1
    with torch.no_grad():
        _match_hf_per_group(model, (ra0, ra1, ra0_again, rb1, rc, rd, ra), "dp=2 tp=2 ep=4 sp")
        ref = hf_step_logits(model, even, wrong.tokens)
    assert_results_agree(tp1_results, [ra0, rb1, rc, rd], ATOL, where="dp=2 tp=2 ep=4 sp vs tp=1")
    assert all(n > 0 for n in dummies) and dummies[0] == dummies[1] and dummies[2] == dummies[3], dummies
    err = (wrong.step_logits[0] - ref[0]).abs().max().item()
    assert err > 100 * ATOL, f"TP ranks swapping their sequence-parallel rows must give wrong logits ({err:.3g})"
