"""Context parallel (cp=2) on the CPU ranks, end to end: every prefill step split head-tail over the
two CP ranks (`graphgen.runtime.parallel.context_parallel`), each layer's KV all-gathered before the cache
write, decode replicated, KV saved by CP rank 0 only. Numerics against transformers (float32, atol
1e-4) at every step; tokens equal to the cp=1 run and across write modes (each family at off, sync
and async: one full test at one mode, a short one at each of the other two); a repeated prompt hits
on every rank. Prompt lengths around the chunk size (``max_num_batched_tokens`` 8): 5 (shorter, and
odd: the ranks hold 3 and 2 tokens), 8 (equal), 13 (longer: chunks of 8 and 5, the second a
history step), the 13 again (12 tokens from the pool: a 1-token step, rank 1 computes nothing), and
5 + 13 batched (decode rows and prompt chunks in one forward). Negative control: the ranks computing
each other's token slices gives wrong logits.

Multi-process (slow, by folder); the unit tests of the split are in tests/runtime/test_context_split.py."""

from __future__ import annotations

import pytest
import torch

from graphgen.runtime import open_engine
from support.hf import ATOL, assert_steps_match_hf, hf_step_logits, rand_prompt
from support.paths import REPO
from support.probes import async_on, swap_sp_rows
from support.tokens import assert_agree

TIMEOUT = 60   # seconds a rank may take to answer one command
CHUNK = 8      # max_num_batched_tokens: longer prompts are chunked
SPECS = {"qwen3": "specs/tiny_qwen3.yaml", "deepseek": "specs/tiny_deepseek_v3.yaml"}
CHECKPOINTS = {"qwen3": "qwen", "deepseek": "tiny_dsv3"}   # tests/conftest.py's session fixtures
SEEDS = {"qwen3": 5, "deepseek": 6}


def _prompts(family: str) -> dict:
    g = torch.Generator().manual_seed(SEEDS[family])
    return {"shorter": rand_prompt(g, 5), "equal": rand_prompt(g, CHUNK), "longer": rand_prompt(g, 13),
            "fresh": rand_prompt(g, 13), "control": rand_prompt(g, CHUNK)}


def _swap_slices(rank_engine) -> None:
    """Probe (in each rank): this rank computes the other CP rank's head-tail pieces, while the gather
    order and slot mapping still say its own: every KV row lands in another position's slot."""
    from graphgen.runtime.parallel.context_parallel import cp_step_inputs

    runner = rank_engine.runner
    rt = runner.rt
    real = runner.step_inputs
    runner.step_inputs = lambda plan: (real(plan) if plan.phase == "decode" else
                                       cp_step_inputs(plan, runner.block_size, rt.layout.cp - 1 - rt.coords.cp_rank,
                                                                     rt.layout.cp))


def _mixed_steps(rank_engine) -> int:   # probe, in each rank
    return rank_engine.core.stats()["mixed_steps"]


def _run_cp2(spec: str, d, p: dict, *, write: str, control: bool = False):
    """Every prompt at cp=2 (one engine): results, each rank's counters, the pool's; with ``control``
    the control prompt last, after the ranks swapped their slices."""
    with open_engine(REPO / spec, d, cp=2, write=write, collect_logits=True, num_blocks=48, timeout=TIMEOUT,
                     max_num_batched_tokens=CHUNK) as eng:
        out = {k: eng.generate([p[k]], 3)[0] for k in ("shorter", "equal", "longer")}
        eng.drain()
        out["repeated"] = eng.generate([p["longer"]], 3)[0]
        out["batched"] = eng.generate([p["shorter"], p["fresh"]], 3, batch=True)
        eng.drain()
        stats, pool = eng.rank_stats, eng.pool_stats()
        mixed = eng.on_ranks(_mixed_steps)
        assert mixed[0] == mixed[1] > 0, mixed   # decode rows and prompt chunks shared forwards
        if control:
            eng.on_ranks(_swap_slices)
            out["control"] = eng.generate([p["control"]], 1)[0]
    return out, stats, pool


@pytest.fixture(scope="module")
def cp1_results(request):
    """``cp1_results(family)``: the cp=1 engine's greedy results (tokens, step logits) of the family's prompts,
    one engine per family for the whole module (every cp=2 test compares against it: `_agree_cp1`)."""
    done = {}

    def results(family: str) -> dict:
        if family not in done:
            d, p = request.getfixturevalue(CHECKPOINTS[family]).dir, _prompts(family)
            with open_engine(REPO / SPECS[family], d, num_blocks=48, max_num_batched_tokens=CHUNK,
                             collect_logits=True) as one:
                rs = one.generate([p[k] for k in ("shorter", "equal", "longer", "fresh")], 3)
            done[family] = dict(zip(("shorter", "equal", "longer", "fresh"), rs))
        return done[family]
    return results


def _agree_cp1(cp1: dict, pairs, what: str) -> None:
    """cp=2's results vs cp=1's (``pairs``: (cp=1 prompt key, cp=2 result)): splitting the tokens reorders
    the attention's reductions, so tokens equal up to a near tie at ATOL, logits within it (support.tokens)."""
    for key, r in pairs:
        assert_agree(cp1[key].tokens, cp1[key].step_logits, r.tokens, r.step_logits, ATOL, where=f"{what} {key}")


def _check(model, family: str, out: dict, stats: list, pool: dict, cp1: dict, write: str) -> None:
    assert out["longer"].variant == "mempool_prefill"   # first chunk; the second runs splitfuse
    assert (out["repeated"].variant, out["repeated"].hit_tokens) == ("splitfuse", 12)
    with torch.no_grad():
        for what in ("shorter", "equal", "longer", "repeated"):
            assert_steps_match_hf(model, out[what], f"{family} cp=2 {write} {what}")   # decode steps included
        for what, r in zip(("shorter", "fresh"), out["batched"]):
            assert_steps_match_hf(model, r, f"{family} cp=2 {write} batched {what}")
    _agree_cp1(cp1, [(k, out[k]) for k in ("shorter", "equal", "longer")] + [("fresh", out["batched"][1]),
               ("longer", out["repeated"]), ("shorter", out["batched"][0])], f"{family} cp=2 {write}")
    # 1 + 2 + 3 + 3 full blocks saved once, by CP rank 0; rank 1 computed the same bytes and left them
    assert stats[0]["puts"] == stats[1]["skipped_puts"] == pool["num_keys"] == 9 and stats[1]["puts"] == 0
    # the repeated prompt (3 blocks) and the batched short one (1) hit on every rank, every rank loads
    assert [s["hit_blocks"] for s in stats] == [4, 4] and [s["loaded_blocks"] for s in stats] == [4, 4]


def test_qwen3_cp2_matches_transformers_and_cp1_and_a_swapped_split_does_not(qwen, cp1_results):
    p = _prompts("qwen3")
    out, stats, pool = _run_cp2(SPECS["qwen3"], qwen.dir, p, write="async", control=True)
    _check(qwen.model, "qwen3", out, stats, pool, cp1_results("qwen3"), "async")
    with torch.no_grad():
        ref = hf_step_logits(qwen.model, p["control"], out["control"].tokens)
    err = (out["control"].step_logits[0] - ref[0]).abs().max().item()
    assert err > 100 * ATOL, f"swapped head-tail slices must give wrong logits (max |diff| {err:.3g})"


def test_deepseek_cp2_matches_transformers_and_cp1(tiny_dsv3, cp1_results):
    p = _prompts("deepseek")
    out, stats, pool = _run_cp2(SPECS["deepseek"], tiny_dsv3.dir, p, write="sync")
    _check(tiny_dsv3.model, "deepseek", out, stats, pool, cp1_results("deepseek"), "sync")


@pytest.mark.parametrize("family,write", [("qwen3", "off"), ("qwen3", "sync"),
                                          ("deepseek", "off"), ("deepseek", "async")])
def test_cp2_gives_the_tokens_of_cp1_at_the_other_write_modes(family, write, request, cp1_results):
    """The write modes the tests above do not run (they: async for Qwen3, sync for DeepSeek), one short
    engine each: prefill, a chunked prompt and its repeat (a 12-token hit unless writes are off), decode.
    Every mode agrees with cp=1 (`_agree_cp1`), so the modes agree with each other."""
    p = _prompts(family)
    with open_engine(REPO / SPECS[family], request.getfixturevalue(CHECKPOINTS[family]).dir, cp=2, write=write,
                     num_blocks=48, timeout=TIMEOUT, max_num_batched_tokens=CHUNK, collect_logits=True) as eng:
        rs = eng.generate([p["shorter"], p["equal"], p["longer"]], 3)
        eng.drain()
        rs.append(eng.generate([p["longer"]], 3)[0])
        stats, pool = eng.rank_stats, eng.pool_stats()
    cp1 = cp1_results(family)
    _agree_cp1(cp1, zip(("shorter", "equal", "longer", "longer"), rs), f"{family} cp=2 {write}")
    if write == "off":
        assert rs[3].hit_tokens == 0 and pool["num_keys"] == 0 and all(s["puts"] == 0 for s in stats)
    else:   # 1 + 2 + 3 full blocks, put once by CP rank 0; the repeat hits on both ranks
        assert (rs[3].variant, rs[3].hit_tokens) == ("splitfuse", 12)
        assert [s["puts"] for s in stats] == [6, 0] and pool["num_keys"] == 6
        assert [s["hit_blocks"] for s in stats] == [3, 3]


def test_qwen3_cp2_tp2_matches_transformers_and_cp1(qwen, cp1_results):
    """cp=2 × tp=2, four ranks (rank = cp_rank × 2 + tp_rank): each TP group splits the heads, each CP
    group the tokens; each TP rank's KV heads are saved by CP rank 0's rank of that TP rank only."""
    p = _prompts("qwen3")
    with open_engine(REPO / SPECS["qwen3"], qwen.dir, cp=2, tp=2, write="async", collect_logits=True,
                     num_blocks=48, timeout=TIMEOUT, max_num_batched_tokens=CHUNK) as eng:
        out = {k: eng.generate([p[k]], 3)[0] for k in ("shorter", "longer")}
        eng.drain()
        out["repeated"] = eng.generate([p["longer"]], 3)[0]
        stats, pool = eng.rank_stats, eng.pool_stats()
    assert (out["repeated"].variant, out["repeated"].hit_tokens) == ("splitfuse", 12)
    with torch.no_grad():
        for what, r in out.items():
            assert_steps_match_hf(qwen.model, r, f"qwen3 cp=2 tp=2 {what}")
    cp1 = cp1_results("qwen3")
    _agree_cp1(cp1, [("shorter", out["shorter"]), ("longer", out["longer"]), ("longer", out["repeated"])],
               "qwen3 cp=2 tp=2")
    # 1 + 3 blocks per TP rank's heads, put by ranks 0 and 1 (CP rank 0), left by ranks 2 and 3
    assert [s["puts"] for s in stats] == [4, 4, 0, 0] and [s["skipped_puts"] for s in stats] == [0, 0, 4, 4]
    assert pool["num_keys"] == 8 and [s["hit_blocks"] for s in stats] == [3, 3, 3, 3]


# each TP rank's KV heads put by CP rank 0's rank of it (Qwen3: ranks 0, 1); the MLA latent, the same on every
# rank, by rank 0 only; the other ranks computed the same bytes and left them
SP_PUTS = {"qwen3": ([4, 4, 0, 0], [0, 0, 4, 4], 8), "deepseek": ([4, 0, 0, 0], [0, 4, 4, 4], 4)}


@pytest.mark.parametrize("family", ["qwen3", "deepseek"])
def test_cp2_tp2_sp_matches_transformers_and_one_rank(family, request, cp1_results):
    """The seed's CP/SP layout (docs/parallel.md, "CP with SP"): cp=2 × tp=2 with sp, four ranks. Each CP
    rank's head-tail share of a prefill is split again over its TP group between the reductions (5 tokens:
    CP shares 3 and 2, TP shards 2+1 and 1+1; the 12-token hit's 1-token step: CP rank 0's, TP rank 0's),
    each layer's KV all-gathered over cp, KV saved by CP rank 0's TP group. Every step vs transformers,
    tokens vs one rank; the TP ranks taking each other's rows breaks the logits (negative control).

    With async scheduling on every rank (the seed's "CP/SP + async inference"; docs/parallel.md, "Async
    scheduling on ranks"): step N+1 is planned while step N's forward runs. The staggered pair (13 fresh tokens,
    then the hit prompt again) makes that plan admit a request -- its pool lookup's hit MIN on the host-side
    group -- while a prefill chunk's forward issues the TP and CP collectives on the forward thread."""
    fixture = request.getfixturevalue(CHECKPOINTS[family])
    p = _prompts(family)
    with open_engine(REPO / SPECS[family], fixture.dir, cp=2, tp=2, sp=True, write="async", collect_logits=True,
                     num_blocks=48, timeout=TIMEOUT, max_num_batched_tokens=CHUNK, async_scheduling=True) as eng:
        assert eng.on_ranks(async_on) == [True] * 4   # else this proves nothing about async scheduling
        out = {k: eng.generate([p[k]], 3)[0] for k in ("shorter", "longer")}
        eng.drain()
        out["repeated"] = eng.generate([p["longer"]], 3)[0]
        stats, pool = eng.rank_stats, eng.pool_stats()
        # chunk 1 of "fresh" fills the 8-token budget; the plan made while it runs takes chunk 2 (5) and the
        # hit prompt's 1-token step, its lookup agreed while that forward's collectives run
        out["staggered fresh"], out["staggered hit"] = eng.generate([p["fresh"], p["longer"]], 3, batch=True)
        eng.on_ranks(swap_sp_rows)
        control = eng.generate([p["control"]], 1)[0]   # 8 tokens: 4 per CP rank, 2 per TP rank
    assert (out["repeated"].variant, out["repeated"].hit_tokens) == ("splitfuse", 12)
    with torch.no_grad():
        for what, r in out.items():
            assert_steps_match_hf(fixture.model, r, f"{family} cp=2 tp=2 sp {what}")   # decode steps included
        ref = hf_step_logits(fixture.model, p["control"], control.tokens)
    assert (out["staggered hit"].variant, out["staggered hit"].hit_tokens) == ("splitfuse", 12)
    _agree_cp1(cp1_results(family), [("shorter", out["shorter"]), ("longer", out["longer"]),
                                     ("longer", out["repeated"]), ("fresh", out["staggered fresh"]),
                                     ("longer", out["staggered hit"])], f"{family} cp=2 tp=2 sp")
    puts, skipped, keys = SP_PUTS[family]
    assert [s["puts"] for s in stats] == puts and [s["skipped_puts"] for s in stats] == skipped
    assert pool["num_keys"] == keys and [s["hit_blocks"] for s in stats] == [3, 3, 3, 3]
    err = (control.step_logits[0] - ref[0]).abs().max().item()
    assert err > 100 * ATOL, f"TP ranks swapping their sequence-parallel rows must give wrong logits ({err:.3g})"


def test_deepseek_cp2_inside_dp2_matches_transformers_and_one_rank(tiny_dsv3, cp1_results):
    """cp inside DP groups (dp 2 × cp 2, ep 2; rank = dp_rank × 2 + cp_rank): each DP group's prefill split
    head-tail over its two CP ranks, the MoE's DP all-gather and EP reduce-scatter between the ranks of the same
    CP rank (each CP rank's share of one group meets the other group's same CP rank), an idle group's CP ranks in
    dummy forwards, the experts sliced by EP index (dp_rank, not the world rank). Every step vs transformers with
    one group idle and both busy, a prefix saved through one group hitting on the other, KV put by CP rank 0 of
    each group only; tokens vs one rank; swapped head-tail slices break the logits (negative control)."""
    p = _prompts("deepseek")
    with open_engine(REPO / SPECS["deepseek"], tiny_dsv3.dir, dp=2, cp=2, ep=2, write="async", collect_logits=True,
                     num_blocks=48, timeout=TIMEOUT, max_num_batched_tokens=CHUNK) as eng:
        out = {"shorter": eng.generate([p["shorter"]], 3, ranks=[0])[0],
               "longer": eng.generate([p["longer"]], 3, ranks=[1])[0]}   # chunked, on group 1, group 0 idle
        eng.drain()
        out["repeated"] = eng.generate([p["longer"]], 3, ranks=[0])[0]   # group 1's blocks, from the pool
        out["fresh"], out["batched"] = eng.generate([p["fresh"], p["shorter"]], 3, batch=True, ranks=[0, 1])
        stats = eng.rank_stats
        eng.on_ranks(_swap_slices)
        control = eng.generate([p["control"]], 1, ranks=[0])[0]
    assert (out["repeated"].variant, out["repeated"].hit_tokens, out["batched"].hit_tokens) == ("splitfuse", 12, 4)
    with torch.no_grad():
        for what, r in out.items():
            assert_steps_match_hf(tiny_dsv3.model, r, f"deepseek dp=2 cp=2 {what}")   # decode steps included
        ref = hf_step_logits(tiny_dsv3.model, p["control"], control.tokens)
    _agree_cp1(cp1_results("deepseek"), [(k, out[k]) for k in ("shorter", "longer", "fresh")] +
               [("longer", out["repeated"]), ("shorter", out["batched"])], "deepseek dp=2 cp=2")
    # ranks 0, 2: CP rank 0 of each group puts; ranks 1, 3 computed the same bytes and left them
    assert stats[1]["puts"] == stats[3]["puts"] == 0 and stats[0]["puts"] > 0 and stats[2]["puts"] > 0, stats
    assert [s["skipped_puts"] for s in stats] == [0, stats[0]["puts"], 0, stats[2]["puts"]], stats
    err = (control.step_logits[0] - ref[0]).abs().max().item()
    assert err > 100 * ATOL, f"swapped head-tail slices must give wrong logits (max |diff| {err:.3g})"
