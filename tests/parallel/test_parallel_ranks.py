"""Parallel ranks end to end on CPU: rank processes on torch.distributed (gloo, loopback), numerics
against transformers (float32, atol 1e-4) at every step of prefill, splitfuse (history from the
pool) and decode, tokens equal to the tp=1 run and across write modes, pool hits agreed by every
rank, the MLA latent saved once, and a dying rank reported within a timeout. Every engine start
is bounded (``timeout``) and every test too (``TEST_TIMEOUT``)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import support.hf as hfm
from graphgen.runtime.parallel.launcher import RankFailure
from graphgen.runtime import open_engine
from support.cli import cli_inproc
from support.engines import counters_since
from support.hf import ATOL, assert_steps_match_hf, hf_logits, rand_prompt
from support.paths import REPO
from support.probes import async_on
from support.tokens import assert_results_agree

TIMEOUT = 60  # seconds a rank may take to answer one command


# the checkpoints are the session fixtures of tests/conftest.py: ``qwen`` (tiny_qwen3's dims) and
# ``tiny_dsv3`` (tiny_deepseek_v3's dims)


def _prompts(seed: int):
    g = torch.Generator().manual_seed(seed)
    a = rand_prompt(g, 10)            # two full blocks of 4 + a partial one
    b = a[:4] + rand_prompt(g, 5)     # shares the first block with a
    return a, b


def _steps(eng, a, b):
    """a, a again, b (each drained): results and each rank's counters of these requests."""
    before = eng.rank_stats
    ra = eng.generate([a], 3)[0]
    eng.drain()
    again = eng.generate([a], 3)[0]   # every block of a is in the pool: splitfuse on every rank
    eng.drain()
    rb = eng.generate([b], 3)[0]
    eng.drain()
    return (ra, again, rb), counters_since(before, eng.rank_stats)


def _run(spec, weights, a, b, saves=None, **kw):
    """`_steps` on an engine of its own (its pool too); ``saves``: a list the ranks' `save_report` is put in."""
    with open_engine(REPO / spec, weights, collect_logits=True, num_blocks=32, timeout=TIMEOUT, **kw) as eng:
        if kw.get("async_scheduling"):   # on every rank, else the test proves nothing about it
            assert eng.on_ranks(async_on) == [True] * len(eng.rank_stats)
        out, stats = _steps(eng, a, b)
        if saves is not None:
            saves.append(eng.save_report())
        return out, stats, eng.pool_stats()


def test_qwen3_tp2_matches_transformers_tp1_and_hits_on_every_rank(qwen, qwen_tp2):
    model, d = qwen.model, qwen.dir
    a, b = _prompts(1)
    (ra, again, rb), stats = _steps(qwen_tp2("specs/tiny_qwen3_tp2.yaml"), a, b)   # shared: reads its own requests
    assert (ra.variant, again.variant, again.hit_tokens, rb.hit_tokens) == ("mempool_prefill", "splitfuse", 8, 4)
    with torch.no_grad():
        for what, r in (("prefill", ra), ("splitfuse", again), ("shared prefix", rb)):
            assert_steps_match_hf(model, r, f"qwen3 tp=2 {what}")   # decode steps included
    assert [s["hit_blocks"] for s in stats] == [3, 3]  # 2 blocks of a, 1 of b, on each rank
    assert all(s["puts"] > 0 and s["skipped_puts"] == 0 for s in stats)  # each rank saves its own heads
    with open_engine(REPO / "specs/tiny_qwen3.yaml", d, num_blocks=32, collect_logits=True) as one:
        # one rank vs two reorders the reductions: tokens equal up to a near tie at ATOL (support.tokens)
        assert_results_agree(one.generate([a, b], 3), [ra, rb], ATOL, where="tp=1 vs tp=2")


def test_the_ranks_save_reports_aggregate_per_shard(qwen_tp2):
    """Issue 42 item 6: every rank's scheduler takes its steps' `SaveReport`s (rank > 0's were dropped as
    None), and the driver aggregates them per pool-key shard: Qwen3's KV heads differ per rank, so two
    shards, each put by its own rank, each pinning the blocks the request saved (the shared engine: deltas)."""
    eng = qwen_tp2("specs/tiny_qwen3_tp2.yaml")
    before = eng.save_report()
    r = eng.generate([rand_prompt(torch.Generator().manual_seed(4242), 13)], 2)[0]
    eng.drain()
    after = eng.save_report()
    assert set(after.shards) == {(0, 2), (1, 2)} and len(after.ranks) == 2
    for shard, ledger in after.shards.items():
        got = before.shards.get(shard)
        assert ledger.pinned - (got.pinned if got else 0) == r.saved_blocks == 3, shard  # 13 tokens: 3 full blocks
    assert after.ranks[1].steps > before.ranks[1].steps  # rank 1 reports, step by step, as rank 0 does


def test_qwen3_tp2_sequence_parallel_matches_transformers_and_tp1(qwen, qwen_tp2):
    """sp: reduce-scatter + norm on 1/tp of the tokens + all-gather (tiny_qwen3_tp2_sp); odd step sizes
    (prompt b: 9 tokens, decode: 1) leave rank 1 a short or empty shard."""
    model, d = qwen.model, qwen.dir
    a, b = _prompts(1)
    (ra, again, rb), stats = _steps(qwen_tp2("specs/tiny_qwen3_tp2_sp.yaml"), a, b)   # shared
    assert (ra.variant, again.variant, again.hit_tokens, rb.hit_tokens) == ("mempool_prefill", "splitfuse", 8, 4)
    with torch.no_grad():
        for what, r in (("prefill", ra), ("splitfuse", again), ("shared prefix", rb)):
            assert_steps_match_hf(model, r, f"qwen3 tp=2 sp {what}")   # decode steps included
    assert [s["hit_blocks"] for s in stats] == [3, 3]
    with open_engine(REPO / "specs/tiny_qwen3.yaml", d, num_blocks=32, collect_logits=True) as one:
        # one rank vs two reorders the reductions: tokens equal up to a near tie at ATOL (support.tokens)
        assert_results_agree(one.generate([a, b], 3), [ra, rb], ATOL, where="tp=1 vs tp=2")


@pytest.mark.parametrize("spec", ["specs/tiny_qwen3_tp2.yaml", "specs/tiny_qwen3_tp2_sp.yaml"], ids=["tp2", "tp2_sp"])
def test_qwen3_tp2_write_modes_give_the_same_tokens(qwen, qwen_tp2, spec):
    d = qwen.dir
    a, b = _prompts(2)
    (sync_a, sync_again, _), _, _ = _run(spec, d, a, b, write="sync")
    (off_a, off_again, _), stats, _ = _run(spec, d, a, b, write="off")
    (async_a, async_again, async_b), async_stats = _steps(qwen_tp2(spec), a, b)   # the specs' mode: shared
    assert sync_again.variant == "splitfuse" and off_again.hit_tokens == 0
    assert async_again.variant == "splitfuse" and async_again.hit_tokens == 8 and async_b.hit_tokens == 4
    assert sync_a.tokens == sync_again.tokens == off_a.tokens == off_again.tokens == async_a.tokens \
        == async_again.tokens
    assert all(s["puts"] == 0 for s in stats)
    assert all(s["puts"] > 0 for s in async_stats)  # async did save, on each rank


@pytest.mark.parametrize("ep", [2, 1], ids=["ep2_local_experts", "ep1_width_sliced_experts"])
def test_deepseek_tp2_matches_transformers_and_saves_the_latent_once(tiny_dsv3, ep):
    """ep=2: each rank holds half the experts whole; ep=1: every expert is split by width over the two
    ranks (the layout deepseek_v3_1 ships with, at tp=32). ep=2 runs with async scheduling (the step after a
    forward planned while it runs, its lookup agreed on the host-side group): the same tokens and logits."""
    model, d = tiny_dsv3.model, tiny_dsv3.dir
    a, b = _prompts(3)
    saves: list = []
    (ra, again, rb), stats, pool = _run("specs/tiny_deepseek_v3_tp2ep2.yaml", d, a, b, saves, tp=2, ep=ep,
                                        async_scheduling=ep == 2)
    assert (again.variant, again.hit_tokens, rb.hit_tokens) == ("splitfuse", 8, 4)
    with torch.no_grad():
        for what, r in (("prefill", ra), ("splitfuse", again), ("shared prefix", rb)):
            assert_steps_match_hf(model, r, f"deepseek tp=2 ep={ep} {what}")
    # rank 0 puts each latent block once; rank 1 computes the same bytes and leaves them to rank 0
    assert stats[0]["puts"] == stats[1]["skipped_puts"] > 0 and stats[1]["puts"] == 0
    assert pool["num_keys"] == stats[0]["puts"]  # not tp times as many
    # the ranks' SaveReports aggregated (issue 42 item 6): one latent shard, put by rank 0; rank 1 pinned the
    # same blocks in lockstep (its report is no longer dropped) but puts nothing of its own
    (rep,) = saves
    assert set(rep.shards) == {(0, 2)} and rep.shards[(0, 2)].pinned == ra.saved_blocks + again.saved_blocks \
        + rb.saved_blocks > 0
    assert rep.ranks[0].pinned == rep.ranks[1].pinned and rep.ranks[1].steps == rep.ranks[0].steps > 0
    assert [s["hit_blocks"] for s in stats] == [3, 3]  # both ranks load rank 0's blocks


def _kill_rank1(variant: str, source: str) -> str:
    """source_hook: rank 1 exits in the middle of its first forward (rank 0 waits in a collective)."""
    return source.replace("    h_embed = ", "    import os\n    if rt.rank == 1:\n        os._exit(3)\n"
                          "    h_embed = ", 1)


def test_a_dying_rank_is_reported_not_a_hang(qwen):
    # a private engine: its rank 1 is made to die
    d = qwen.dir
    t0 = time.monotonic()
    eng = open_engine(REPO / "specs/tiny_qwen3_tp2.yaml", d, num_blocks=32, timeout=30, source_hook=_kill_rank1)
    with pytest.raises(RankFailure, match=r"rank 1 exited \(code 3\)"):
        eng.generate([[1, 2, 3, 4, 5]], 2)
    assert time.monotonic() - t0 < 60


def test_a_rank_killed_between_commands_ends_the_engine_with_its_sentence(qwen):
    """A rank SIGKILLed while the engine is idle: the next command finds its pipe closed and ends the engine with
    ``rank N exited`` (a RankFailure, which serve answers and exits on), not a BrokenPipeError (before: serve's
    loop died on it and a P/D instance stayed up with its requests unanswered)."""
    import signal

    eng = open_engine(REPO / "specs/tiny_qwen3_tp2.yaml", qwen.dir, num_blocks=32, timeout=30)
    try:
        assert eng.generate([[1, 2, 3, 4, 5]], 1)[0].tokens
        victim = eng._procs[1]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        with pytest.raises(RankFailure, match=r"rank 1 exited \(code -9\).*\(found sending it\)"):
            eng.generate([[1, 2, 3, 4, 5]], 1)
    finally:
        eng.close()


def test_cli_run_tp2_json_logits_match_transformers(qwen):
    model, d = qwen.model, qwen.dir
    a, _ = _prompts(4)
    # the CLI's main in this interpreter (the `run` entry point as a subprocess: tests/e2e/test_e2e_cli.py)
    r = cli_inproc("run", "--spec", "specs/tiny_qwen3.yaml", "--weights", d, "--tp", "2", "--prompt-ids",
                   ",".join(map(str, a)), "--max-new-tokens", "2", "--json", "--logits", timeout=150)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[0])
    with torch.no_grad():
        ref = hf_logits(model, a)[-1]
    assert (torch.tensor(out["logits"]) - ref).abs().max().item() <= 1e-4
    assert out["tokens"][0] == int(ref.argmax())


def test_serve_counts_the_ranks_of_the_layout():
    """``graphgen serve`` starts rank processes when the overrides, else the spec's ``parallel:``, ask
    for more than one rank (the server itself at tp=2: tests/serve/test_serve_tp.py)."""
    from argparse import Namespace

    from graphgen.engine_args import rank_count
    from graphgen.modelspec.loader import load_spec

    def _ranks(args):
        return rank_count(args, load_spec(args.spec))

    tp2 = str(REPO / "specs/tiny_qwen3_tp2.yaml")
    assert _ranks(Namespace(spec=tp2, tp=1, ep=1)) == 1
    assert _ranks(Namespace(spec=tp2, tp=None, ep=None)) == 2
    assert _ranks(Namespace(spec=str(REPO / "specs/tiny_qwen3.yaml"), tp=None, ep=None)) == 1
    assert _ranks(Namespace(spec=str(REPO / "specs/tiny_deepseek_v3.yaml"), tp=2, ep=2)) == 2


def test_qwen3_tp4_replicates_kv_heads_and_matches_transformers(qwen):
    """tp=4 over 2 KV heads: each KV head is replicated on two ranks (each rank keeps one query head and
    its KV head); logits still match transformers at every step. Each distinct KV shard is saved once
    (audit 2 row 11): ranks 0 and 2 put head 0 and head 1, ranks 1 and 3 (same heads) put nothing and
    load the owners' blocks, so the pool holds 2 keys per block, not 4."""
    model, d = qwen.model, qwen.dir
    a, b = _prompts(4)
    (ra, again, rb), stats, pool = _run("specs/tiny_qwen3.yaml", d, a, b, tp=4)
    assert (again.variant, again.hit_tokens, rb.hit_tokens) == ("splitfuse", 8, 4)
    with torch.no_grad():
        for what, r in (("prefill", ra), ("splitfuse", again), ("shared prefix", rb)):
            assert_steps_match_hf(model, r, f"qwen3 tp=4 {what}")
    assert [s["hit_blocks"] for s in stats] == [3, 3, 3, 3]
    saved = stats[0]["puts"]
    assert saved > 0 and [s["puts"] for s in stats] == [saved, 0, saved, 0]
    assert [s["skipped_puts"] for s in stats] == [0, saved, 0, saved]
    assert pool["num_keys"] == 2 * saved  # one put per distinct shard and block


def test_qwen3_tp2_with_a_vocab_tp_does_not_divide_matches_transformers(tmp_path):
    """vocab 257 over 2 ranks: the embedding and LM head are zero-padded to 2 x 129 rows; the padded
    logits are dropped, so every step's logits still match transformers."""
    dims = dict(hfm.QWEN3_DIMS, vocab_size=257)
    model, d = hfm.build_hf_model("qwen3_dense", dims, str(tmp_path / "hf"), seed=7)
    spec = tmp_path / "q257.yaml"
    res = cli_inproc("import-hf", str(d), "--out", str(spec), "--name", "q257", "--block-size", "4")
    assert res.returncode == 0, res.stderr
    g = torch.Generator().manual_seed(9)
    a = rand_prompt(g, 10, vocab=257)
    with open_engine(spec, d, collect_logits=True, num_blocks=32, timeout=TIMEOUT, tp=2) as eng:
        r = eng.generate([a], 3)[0]
    assert all(row.shape[-1] == 257 for row in r.step_logits)  # the padding rows are not logits
    with torch.no_grad():
        assert_steps_match_hf(model, r, "qwen3 tp=2 vocab 257")


def _mixed_steps(rank_engine) -> int:  # on every rank (module-level: pickled by name)
    return rank_engine.core.stats()["mixed_steps"]


def test_qwen3_tp2_mixed_batches_match_transformers_on_every_rank(qwen):
    """Decode rows and prompt chunks in one forward on every rank (the plan fingerprint covers the
    row kinds, so a rank that mixed differently would raise): transformers' logits at every step."""
    g = torch.Generator().manual_seed(7)
    short, long = rand_prompt(g, 5), rand_prompt(g, 40)
    with open_engine(REPO / "specs/tiny_qwen3.yaml", qwen.dir, tp=2, collect_logits=True, num_blocks=64,
                     timeout=TIMEOUT, max_num_batched_tokens=8) as eng:
        rs = eng.generate([short, long], 6, batch=True)
        mixed = eng.on_ranks(_mixed_steps)
    assert mixed[0] == mixed[1] > 0, mixed
    for what, r in zip(("short", "long"), rs):
        assert_steps_match_hf(qwen.model, r, f"qwen3 tp=2 mixed batch {what}")


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_qwen3_tp2_forks_device_cache_write_back_and_decode_saves_agree_with_tp1(qwen, policy):
    """Every block-lifetime decision (n forks sharing blocks, decode-time saves, write-back when a
    block leaves the device, device prefix hits, LRU eviction) is made alike on every rank: the
    per-step plan check passes, and tokens and counters — pool puts included — equal the tp=1 run of
    the same spec. The ranks' asynchronous commits land at different times: the allocator reuses
    blocks in the order they were freed (a pinned one once saved, never skipped), so block tables
    and eviction never depend on when a commit landed (tests/runtime/test_kvcache.py pins the rule)."""
    import dataclasses

    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime import SamplingParams

    base = load_spec(REPO / "specs/tiny_qwen3.yaml")
    spec = dataclasses.replace(base, pool=dataclasses.replace(
        base.pool, write="async", save_decode=True, policy=policy, device_cache=True))
    a, b = _prompts(3)

    def go(**kw):
        with open_engine(spec, qwen.dir, num_blocks=12, spec_file="specs/tiny_qwen3.yaml", **kw) as eng:
            llm, got = eng.core, {}

            def drive():
                while llm.has_work():
                    for o in llm.step():
                        got.setdefault(o.req_id, []).extend(o.new_token_ids)
            llm.add_request("p", a, SamplingParams(max_tokens=6, temperature=1.0, seed=1))
            llm.add_request("c", a, SamplingParams(max_tokens=6, temperature=1.0, seed=2), fork_of="p")
            drive()
            llm.add_request("again", a, SamplingParams(max_tokens=3))   # a device hit
            drive()
            for i in range(4):                                          # evict (write-back) under pressure
                llm.add_request(f"b{i}", b, SamplingParams(max_tokens=8, temperature=1.0, seed=10 + i))
            drive()
            eng.drain()  # async commits still in flight would make "puts" a race between the runs
            s = llm.stats()
            return got, {k: s[k] for k in ("forks", "prefills", "device_hit_blocks", "hit_blocks", "puts")}

    tp2, tp1 = go(tp=2, timeout=TIMEOUT), go()
    assert tp2 == tp1
    assert tp2[1]["forks"] == 1 and tp2[1]["device_hit_blocks"] > 0
    assert tp2[1]["puts"] > 0  # saved when filled (write_through), or written back when evicted
