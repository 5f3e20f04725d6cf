"""Mixed batches end to end (issue 17 item 2), both families: a long prompt arrives while two
requests decode; each following step carries their decode rows first, then a chunk of the prompt
in what is left of the budget, in one forward of the history variant. Every request's tokens equal
running it alone, in every write mode and with async scheduling; every step's logits are
transformers' (atol 1e-4); the trace shows one ``chunk`` span per prefill row and the engine counts
the mixed steps; without chunking the prompt's step stalls the decodes (counted, and traced)."""

from __future__ import annotations

import json

import pytest
import torch

import e2e_util as u

from graphgen.runtime import open_engine
from graphgen.trace import TRACK_PREFILL, StepObserver, TraceRecorder

BUDGET = 8
N_NEW = 12


def _model(request, family):
    return (u.TINY_QWEN3, request.getfixturevalue("qwen")) if family == "qwen3_dense" else \
        (u.TINY_DSV3, request.getfixturevalue("tiny_dsv3"))


def _arrive_while_decoding(eng, short, long):
    """Two short requests decode; the long prompt arrives after their first decode step."""
    llm = eng.core
    plans = []
    inner = eng.runner.submit
    eng.runner.submit = lambda plan, **kw: (plans.append(plan), inner(plan, **kw))[1]
    rs = [llm.add_request(f"s{i}", p, max_tokens=N_NEW) for i, p in enumerate(short)]
    for _ in range(3):
        llm.step()
    rs.append(llm.add_request("long", long, max_tokens=3))
    while llm.has_work():
        llm.step()
    return rs, plans


@pytest.mark.parametrize("family", ["qwen3_dense", "deepseek_v3"])
def test_a_mixed_steps_tokens_equal_its_requests_alone_in_every_write_mode(family, request, tmp_path):
    spec, hf = _model(request, family)
    g = torch.Generator().manual_seed(23)
    short = [u.rand_prompt(g, 5), u.rand_prompt(g, 3)]
    long = u.rand_prompt(g, 6 * BUDGET)
    with open_engine(spec, hf.dir, write="off") as alone:
        want = [alone.generate([p], n)[0].tokens for p, n in ((short[0], N_NEW), (short[1], N_NEW), (long, 3))]
    for write, async_sched in (("async", False), ("sync", False), ("off", False), ("async", True)):
        what = f"{family} write={write} async_scheduling={async_sched}"
        trace = TraceRecorder(str(tmp_path / f"{write}{async_sched}.json"))
        with open_engine(spec, hf.dir, write=write, max_num_batched_tokens=BUDGET, async_scheduling=async_sched,
                         collect_logits=True, num_blocks=64) as eng:
            eng.observe(StepObserver(trace))
            rs, plans = _arrive_while_decoding(eng, short, long)
            stats = eng.core.stats()
        assert [r.tokens for r in rs] == want, what
        mixed = [p for p in plans if p.mixed]
        assert len(mixed) >= 6 and all(p.variant.startswith("splitfuse") for p in mixed), what
        assert all(p.num_tokens <= BUDGET and p.decode_rows_stalled == 0 for p in plans), what
        assert stats["mixed_steps"] == len(mixed) and stats["decode_rows_stalled"] == 0, what
        if write == "async" and not async_sched:
            for r in rs:
                u.assert_steps_match_hf(hf.model, r.result, what)
        trace.close()
        events = json.load(open(tmp_path / f"{write}{async_sched}.json"))["traceEvents"]
        tid = next(e["tid"] for e in events if e.get("ph") == "M" and e["args"].get("name") == TRACK_PREFILL)
        chunks = [e["args"] for e in events if e.get("tid") == tid and e.get("name") == "chunk"]
        want_chunks = [(row.request.req_id, row.start, row.seq_len) for p in plans for row in p.rows if not row.decode]
        assert [(c["req"], *c["positions"]) for c in chunks] == [(str(a), b, c) for a, b, c in want_chunks]


def test_without_chunking_the_prompts_step_stalls_the_decodes_and_says_so(request, tmp_path):
    spec, hf = u.TINY_QWEN3, request.getfixturevalue("qwen")
    g = torch.Generator().manual_seed(24)
    short, long = [u.rand_prompt(g, 5), u.rand_prompt(g, 3)], u.rand_prompt(g, 6 * BUDGET)
    trace = TraceRecorder(str(tmp_path / "t.json"))
    observer = StepObserver(trace, keep_timings=True)
    with open_engine(spec, hf.dir, write="off", max_num_batched_tokens=BUDGET, chunked_prefill=False) as eng:
        eng.observe(observer)
        _, plans = _arrive_while_decoding(eng, short, long)
        stats = eng.core.stats()
    stalled = [p for p in plans if p.decode_rows_stalled]
    assert [(p.prefill_tokens, p.decode_rows_stalled) for p in stalled] == [(len(long), 2)]
    assert stats["mixed_steps"] == 0 and stats["decode_rows_stalled"] == 2
    samples = [v for name, v in observer.take_timings() if name in ("prefill_tokens", "decode_rows_stalled")]
    assert list(zip(samples[::2], samples[1::2])) == [(p.prefill_tokens, p.decode_rows_stalled)
                                                     for p in plans if p.prefill_tokens]
    trace.close()
    events = json.load(open(tmp_path / "t.json"))["traceEvents"]
    assert [e["args"]["rows"] for e in events if e.get("name") == "decode_stall"] == [2]
