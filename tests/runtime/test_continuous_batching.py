"""Continuous batching, preemption, abort and async scheduling, end to end on the generated CPU
graphs of specs/tiny_qwen3.yaml with random weights.

The reference for every token list is the same engine run one request at a time with no pressure
on blocks (`single`): batching, preemption and async scheduling change which steps run together
and when they are prepared, never what a request computes. (Numerics against transformers are
tests/e2e's job; this file does not repeat them.)"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from graphgen.modelspec.loader import load_spec
from graphgen.runtime import Engine, open_engine
from graphgen.runtime.core.faults import Faults
from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

SPEC_PATH = Path(__file__).resolve().parents[2] / "specs" / "tiny_qwen3.yaml"
SPEC = load_spec(SPEC_PATH)
BS = SPEC.kv_cache.block_size


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_ckpt")
    write_random_hf_checkpoint(d, SPEC.family, dataclasses.asdict(SPEC.dims), seed=0)
    return str(d)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine(ckpt, **kw) -> Engine:
    kw.setdefault("write", "off")
    return open_engine(SPEC_PATH, ckpt, **kw)


def single(ckpt, ps, n, **kw) -> list[list[int]]:
    """One request at a time, a cache far larger than any of them: the reference tokens."""
    with engine(ckpt, **kw) as e:
        return [r.tokens for r in e.generate(ps, n)]


def drive(llm, max_steps=2000) -> dict:
    """Step until idle; req_id -> (tokens, finish_reason, num_cached_tokens) from the outputs."""
    got: dict = {}
    for _ in range(max_steps):
        if not llm.has_work():
            return got
        for o in llm.step():
            toks, _, _ = got.get(o.req_id, ([], None, 0))
            got[o.req_id] = (toks + list(o.new_token_ids), o.finish_reason, o.num_cached_tokens)
    raise AssertionError("engine still busy after max_steps")


def record_steps(eng) -> list:
    """Wrap the runner: every submitted step plan's (variant, tokens, rows, prefill tokens)."""
    seen, inner = [], eng.runner.submit

    def submit(plan, **kw):
        seen.append((plan.variant, plan.num_tokens, len(plan.rows), plan.prefill_tokens))
        return inner(plan, **kw)
    eng.runner.submit = submit
    return seen


# ---- batching ------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_16_concurrent_requests_equal_single_runs_and_logits_agree(ckpt, async_scheduling):
    ps = prompts(16)
    with engine(ckpt, collect_logits=True) as e:
        ref = e.generate(ps, 8)
    with engine(ckpt, collect_logits=True, async_scheduling=async_scheduling) as e:
        seen = record_steps(e)
        got = e.generate(ps, 8, batch=True)
    assert max(rows for _, _, rows, _ in seen) == 16          # they really ran together
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    worst = max((a - b).abs().max().item() for x, y in zip(got, ref) for a, b in zip(x.step_logits, y.step_logits))
    assert worst <= 1e-4, f"batch composition moved logits by {worst}"


def test_requests_join_and_leave_between_steps(ckpt):
    a, b = prompts(2, seed=1)
    want = single(ckpt, [a, b], 6)
    with engine(ckpt) as e:
        seen = record_steps(e)
        llm = e.core
        llm.add_request("a", a, max_tokens=3)
        toks = {"a": [], "b": []}

        def step():
            outs = llm.step()
            for o in outs:
                toks[o.req_id] += o.new_token_ids
            return outs
        step()
        step()                                      # a: prefill, then one decode alone
        llm.add_request("b", b, max_tokens=6)       # joins while a decodes
        outs = step()                               # a mixed batch: a's decode and b's prompt; a leaves
        assert {o.req_id: o.finished for o in outs} == {"a": True, "b": False}
        assert seen[-1][0] == "splitfuse" and seen[-1][2:] == (2, len(b)) and outs[0].finish_reason == "length"
        rest = drive(llm)
        toks["b"] += rest["b"][0]
        assert seen[-1][2] == 1 and rest["b"][1] == "length"   # b goes on alone
        assert llm.stats()["running"] == 0 and e.alloc.num_free == e.alloc.num_blocks
    assert toks == {"a": want[0][:3], "b": want[1]}


def test_token_budget_and_max_num_seqs_are_respected(ckpt):
    ps = prompts(12, seed=2, lo=5, hi=15)
    want = single(ckpt, ps, 5)
    with engine(ckpt, max_num_batched_tokens=24, max_num_seqs=5) as e:
        seen = record_steps(e)
        got = [r.tokens for r in e.generate(ps, 5, batch=True)]
    assert got == want
    assert all(tokens <= 24 for _, tokens, _, _ in seen), seen
    assert all(rows <= 5 for _, _, rows, _ in seen), seen
    assert sum(1 for v, _, _, _ in seen if v != "decode") >= 12 * 10 // 24  # prefills were split up


@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_over_the_budget_runs_in_chunks_or_as_one_oversized_step(ckpt, chunked):
    ps = prompts(3, seed=9, lo=20, hi=30)
    want = single(ckpt, ps, 4)
    with engine(ckpt, max_num_batched_tokens=8, chunked_prefill=chunked, write="async") as e:
        seen = record_steps(e)
        got = [r.tokens for r in e.generate(ps, 4, batch=True)]
        assert e.max_model_len > 8             # the step budget is no limit on a request's length
    assert got == want
    prefill_tokens = [t for v, _, _, t in seen if v != "decode"]
    assert sum(prefill_tokens) == sum(map(len, ps))
    if chunked:
        assert max(t for _, t, _, _ in seen) <= 8 and any(v == "splitfuse" for v, _, _, _ in seen)
    else:
        assert sorted(prefill_tokens) == sorted(map(len, ps))   # each prompt whole, in one step


# ---- preemption ----------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_under_a_tiny_block_pool_completes_every_request_with_the_same_tokens(ckpt, async_scheduling):
    ps = prompts(10, seed=3, lo=6, hi=14)
    want = single(ckpt, ps, 10)
    need = max(-(-(len(p) + 10) // BS) for p in ps)
    with engine(ckpt, num_blocks=need + 2, async_scheduling=async_scheduling) as e:
        got = e.generate(ps, 10, batch=True)
        assert e.core.stats()["preemptions"] > 0 and sum(r.preemptions for r in got) > 0
        assert e.alloc.num_free == e.alloc.num_blocks
    assert [r.tokens for r in got] == want


def test_preempted_request_resumes_from_the_pool(ckpt):
    """With saves on, a preempted request's prefix is in the pool: its recompute loads it."""
    ps = prompts(6, seed=4, lo=10, hi=14)
    want = single(ckpt, ps, 12)
    with engine(ckpt, write="sync", num_blocks=14) as e:
        got = e.generate(ps, 12, batch=True)
        assert e.core.stats()["preemptions"] > 0
        assert e.stats["loaded_blocks"] > 0          # the resumes hit what the first prefills saved
    assert [r.tokens for r in got] == want


# ---- stop conditions, abort ----------------------------------------------------------------------
def test_finish_reasons_stop_token_length_and_error(ckpt):
    p = prompts(1, seed=5)[0]
    ref = single(ckpt, [p], 8)[0]
    stop = ref[3]
    cut = ref.index(stop) + 1
    with engine(ckpt, num_blocks=8) as e:
        e.core.add_request("s", p, max_tokens=8).stop_token_ids = frozenset({stop})
        e.core.add_request("n", p, max_tokens=8)
        e.core.eos_token_ids = (ref[0],)
        e.core.add_request("eos", p, max_tokens=8)
        e.core.add_request("big", [1] * (8 * BS + 1), max_tokens=1)   # more than the whole cache
        got = drive(e.core)
        assert e.alloc.num_free == 8
    assert got["s"][:2] == (ref[:cut], "stop") and got["n"][:2] == (ref, "length")
    assert got["eos"][:2] == (ref[:1], "stop")
    assert got["big"][:2] == ([], "error")


def test_abort_frees_blocks_and_a_block_with_a_save_in_flight_only_after_its_commit(ckpt):
    p = prompts(1, seed=6, lo=13, hi=14)[0]        # 13 tokens: 3 full blocks saved
    with engine(ckpt, write="async", faults=Faults(save_delay_s=0.3)) as e:
        llm, alloc = e.core, e.alloc
        r = llm.add_request("x", p, max_tokens=50)
        llm.add_request("y", p[:5], max_tokens=3)
        llm.step()                                  # x's prefill: its save sleeps on the save stream
        table = list(r.table)
        saved = [b for b in table[:3]]
        assert all(alloc.is_pinned(b) for b in saved) and e.connector.pending == 1
        llm.abort("x")
        assert r.finish_reason == "abort" and r.table == []
        assert all(alloc.refcount(b) == 0 and alloc.is_pinned(b) for b in saved)   # freed, still pinned
        y = llm.scheduler.running[0]
        assert alloc.num_free == alloc.num_blocks - len(saved) - len(y.table)       # the rest is free
        got = drive(llm)
        assert "x" not in got and got["y"][1] == "length"   # an aborted request reports nothing more
        e.drain()
        assert not any(alloc.is_pinned(b) for b in saved) and alloc.num_free == alloc.num_blocks
        llm.abort("x")                              # unknown / finished ids are ignored
        llm.abort("nope")


def test_abort_of_a_request_in_the_step_in_flight(ckpt):
    """Async scheduling: a request aborted while its step runs gives its blocks back when that step
    lands, not before (the forward still writes them)."""
    a, b = prompts(2, seed=7)
    with engine(ckpt, async_scheduling=True, faults=Faults(forward_delay_s=0.01)) as e:
        llm = e.core
        ra = llm.add_request("a", a, max_tokens=6)
        llm.add_request("b", b, max_tokens=6)
        llm.step()
        assert llm._inflight is not None and ra in llm._inflight[0].plan.requests
        held = list(ra.table)
        llm.abort("a")
        assert ra.table == held and all(e.alloc.refcount(x) == 1 for x in held)  # still written
        got = drive(llm)
        assert ra.table == [] and "a" not in got and got["b"][1] == "length"
        assert e.alloc.num_free == e.alloc.num_blocks


# ---- async scheduling ----------------------------------------------------------------------------
@pytest.mark.parametrize("write", ["off", "sync", "async"])
def test_async_scheduling_on_off_and_write_modes_give_identical_tokens(ckpt, write):
    ps = prompts(8, seed=8)
    want = single(ckpt, ps, 6)
    for async_scheduling in (False, True):
        with engine(ckpt, write=write, async_scheduling=async_scheduling, num_blocks=20) as e:
            assert [r.tokens for r in e.generate(ps, 6, batch=True)] == want, (write, async_scheduling)


def _prepared_during_previous(timeline):
    """Steps k whose schedule() started after step k-1 was handed to the forward (its launch, or
    its forward's start) and ended before step k-1's forward ended."""
    span = {(what, sid): (t0, t1) for what, sid, t0, t1 in timeline}
    sch = sorted(sid for what, sid in span if what == "schedule")
    inside = []
    for k in sch:
        if ("forward", k - 1) not in span:
            continue
        began = span.get(("launch", k - 1), span[("forward", k - 1)])[0]
        if began <= span[("schedule", k)][0] and span[("schedule", k)][1] <= span[("forward", k - 1)][1]:
            inside.append(k)
    return inside, sch


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_n_plus_1_is_prepared_while_step_n_runs(ckpt, async_scheduling):
    """Timestamps, not speed: with async scheduling every schedule() of step k+1 starts once step k
    is queued on the forward thread and ends before step k's forward does (the forward is slowed
    by an injected delay so the windows are wide); without it none does (the negative control:
    the check can fail)."""
    ps = prompts(4, seed=9)
    timeline: list = []
    with engine(ckpt, async_scheduling=async_scheduling, faults=Faults(forward_delay_s=0.005)) as e:
        e.core.timeline = timeline
        got = [r.tokens for r in e.generate(ps, 5, batch=True)]
    assert got == single(ckpt, ps, 5)
    inside, sch = _prepared_during_previous(timeline)
    assert len(sch) >= 5
    if async_scheduling:
        assert inside == sch[1:]
    else:
        assert inside == []


# ---- the pool with batching ----------------------------------------------------------------------
@pytest.mark.parametrize("write", ["sync", "async"])
def test_a_repeated_prompt_arriving_later_hits_the_pool_while_others_run(ckpt, write):
    p, other = prompts(2, seed=10, lo=14, hi=18)
    want = single(ckpt, [p], 6)[0]
    with engine(ckpt, write=write, async_scheduling=True) as e:
        llm = e.core
        llm.add_request("first", p, max_tokens=6)
        llm.add_request("other", other, max_tokens=30)
        got = {}
        while "first" not in got or not got["first"][1]:
            for o in llm.step():
                got[o.req_id] = (got.get(o.req_id, ([],))[0] + list(o.new_token_ids), o.finished, o.num_cached_tokens)
        e.drain()                                   # first's saves are in the pool
        llm.add_request("again", p, max_tokens=6)   # while "other" still decodes
        assert llm.scheduler.running
        rest = drive(llm)
    assert got["first"][0] == want and got["first"][2] == 0
    assert rest["again"][0] == want and rest["again"][2] == ((len(p) - 1) // BS) * BS


def test_each_row_samples_with_its_own_params_in_a_batch(ckpt):
    """Sampling is the engine's, per request: a batch of a greedy and two seeded sampled requests
    gives each the tokens (and the length) it gets alone."""
    from graphgen.runtime import SamplingParams

    ps = prompts(3, seed=11)
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=3, temperature=1.0, seed=1),
              SamplingParams(max_tokens=4, temperature=0.8, top_k=20, seed=2)]
    alone = {}
    for i, (p, sp) in enumerate(zip(ps, params)):
        with engine(ckpt) as e:
            e.core.add_request(i, p, sp)
            alone.update(drive(e.core))
    with engine(ckpt) as e:
        seen = record_steps(e)
        for i, (p, sp) in enumerate(zip(ps, params)):
            e.core.add_request(i, p, sp)
        together = drive(e.core)
    assert max(rows for _, _, rows, _ in seen) == 3                # they shared steps
    assert {k: len(v[0]) for k, v in together.items()} == {0: 2, 1: 3, 2: 4}
    assert {k: v[0] for k, v in together.items()} == {k: v[0] for k, v in alone.items()}
    with engine(ckpt) as e:                                     # negative control: another seed differs
        e.core.add_request(1, ps[1], SamplingParams(max_tokens=3, temperature=1.0, seed=99))
        assert drive(e.core)[1][0] != together[1][0]
