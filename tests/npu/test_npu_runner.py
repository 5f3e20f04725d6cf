"""The NPU model runner (graphgen/npu/run/runner.py) on the CPU stand-in, through the runtime's engine.

The hardware-shaped tiny Qwen3 (bf16, head_dim 128, block 128) runs through `npu_engine` (scheduler,
KV connector, `EngineCore`; steps padded to the spec's buckets, compiled once per bucket, commits via
the staging ring) and through the CPU target with the same weights in float32.

Tolerance: logits within TOL = 0.25 absolute (logits here are O(4)).  The NPU side runs in bfloat16
(8-bit mantissa: every weight and activation rounded to ~0.4 %, through 2 layers and a 128-wide lm_head;
observed <= 0.1), the CPU side in float32.  Greedy tokens must agree wherever the float32 top-2 margin
exceeds 2 * TOL (support.tokens.assert_agree); a near-tie (margin below that) may flip under bf16 rounding, and after a flip the two
runs feed different tokens, so the comparison stops there for that prompt.  The third prompt shares
its first block with the first: its KV comes back from the pool the NPU engine committed, so its
logits also check the committed bytes.  This is the stand-in's reading of the kernels, not an NPU result.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from graphgen.modelspec.loader import load_spec  # noqa: E402
from graphgen.npu.standin import fakes as standin  # noqa: E402
from support.inproc import cli_inproc
from support.paths import REPO
from support.standin import STANDIN_TIMEOUT_S
from support.tokens import assert_agree

pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
HW = Path(__file__).parent / "data/hw_tiny_qwen3.yaml"
TOL = 0.25
PROMPTS = [list(range(3, 200)), list(range(5, 40)), list(range(3, 200)) + [7, 8]]


@pytest.fixture(scope="module")
def runs():
    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.engine import npu_engine
    from graphgen.runtime import open_engine

    torch.set_num_threads(1)
    spec = load_spec(HW)
    W = random_weights(spec, seed=1, scale=0.1)
    cpu_spec = dataclasses.replace(spec, kv_cache=dataclasses.replace(spec.kv_cache, dtype="float32"))
    with open_engine(cpu_spec, dict(W), collect_logits=True, num_blocks=64) as e:
        cpu = e.generate(PROMPTS, 6)
        cpu_stats = dict(e.stats)
    with npu_engine(spec, dict(W), collect_logits=True, num_blocks=64, standin=True) as e:
        npu = e.generate(PROMPTS, 6)
        npu_stats = dict(e.stats)
        batched = e.generate([list(range(9, 150)), list(range(11, 60)), list(range(13, 30))], 3, batch=True)
        e.drain()
        ring_free = e.runner.commits.ring.in_flight == 0
        cache_save = _save_from_cache(e)
    return cpu, npu, cpu_stats, npu_stats, batched, ring_free, cache_save


def _save_from_cache(e):
    """A plan's save from the cache (a write-back; decode-time saves take the same path) on the NPU
    runner: a step with no forward, its one block through the ring (`CommitPath.save_filled`)."""
    from graphgen.runtime.core.kvcache import pack_block
    from graphgen.runtime.engine import StepPlan

    (blk,) = e.alloc.alloc(1)
    plan = dataclasses.replace(StepPlan.no_forward(), write_back_ids=(blk,), write_back_keys=("written-back",))
    before = e.runner.commits.filled_saves
    out = e.runner.collect(e.runner.submit(plan))
    e.drain()
    pooled = e.pool.get("written-back") == pack_block(e.cache, blk)
    e.alloc.free([blk])
    return out, blk, e.runner.commits.filled_saves - before, pooled


@pytest.mark.slow  # the NPU runner through the stand-in compile (`runs`)
def test_greedy_tokens_and_logits_match_the_cpu_target(runs):
    cpu, npu, *_ = runs
    compared = 0
    for c, n in zip(cpu, npu):
        assert c.hit_tokens == n.hit_tokens
        # logits within TOL, tokens equal up to a near tie (support.tokens: random weights tie)
        compared += assert_agree(c.tokens, c.step_logits, n.tokens, n.step_logits, TOL, where="npu vs cpu").steps
    assert compared >= 12, compared
    assert npu[2].hit_tokens == 128  # the shared first block came back from the NPU engine's commit


@pytest.mark.slow  # the same stand-in runs (`runs`)
def test_saves_commit_through_the_ring_and_the_connector(runs):
    _, _, cpu_stats, npu_stats, _, ring_free, _ = runs
    assert npu_stats["puts"] == cpu_stats["puts"] >= 1 and npu_stats["put_failures"] == 0
    assert npu_stats["save_failures"] == 0 and ring_free


def test_the_npu_runner_returns_the_step_output_and_saves_from_the_cache_through_the_ring(runs):
    """The StepOutput contract of the CPU runner: no rows, no logits; the block it pinned reported;
    the pool holds the cache's bytes of it, copied by the ring's copy stream, not the connector."""
    from graphgen.runtime.engine import StepOutput

    out, blk, through_ring, pooled = runs[-1]
    assert isinstance(out, StepOutput) and out.logits == () and out.saves.pinned == (blk,)
    assert through_ring == 1 and pooled


def test_a_batched_prefill_wider_than_prefill_seqs_runs_in_chunks(runs):
    """3 prompts in one scheduled prefill > prefill_seqs (2): split into two graph calls (else the bucket
    padding raises); each request gets its 3 tokens.  Wiring only: the values are not compared here."""
    *_, batched, _, _ = runs
    assert [len(r.tokens) for r in batched] == [3, 3, 3]
    assert all(torch.isfinite(r.step_logits[0]).all() for r in batched)


def _run_cli(*args):
    """``graphgen run`` in a fresh interpreter: the entry point, where torch_npu (or the stand-in's fake of it,
    which tests in this interpreter install) cannot be imported."""
    return subprocess.run([sys.executable, "-m", "graphgen.cli", "run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=STANDIN_TIMEOUT_S)


@pytest.mark.slow  # a graphgen process (the real entry point, no torch_npu)
@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_run_target_npu_without_torch_npu_exits_3_with_one_sentence(tmp_path):
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(HW)
    ck = write_random_hf_checkpoint(str(tmp_path / "ck"), spec.family, dataclasses.asdict(spec.dims))
    res = _run_cli("--spec", str(HW), "--weights", ck, "--prompt-ids", "1,2,3", "--target", "npu")
    assert res.returncode == 3, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Ascend machine with CANN installed" in lines[0]


@pytest.mark.slow  # graphgen run --target npu --standin: a stand-in compile per graph
def test_run_target_npu_standin_matches_the_cpu_run(tmp_path):
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(HW)
    ck = write_random_hf_checkpoint(str(tmp_path / "ck"), spec.family, dataclasses.asdict(spec.dims), seed=3)
    cpu_spec = tmp_path / "cpu.yaml"  # the same model in float32 on the CPU target
    cpu_spec.write_text(HW.read_text().replace("  dtype: bfloat16", "  dtype: float32"))
    args = ["--weights", ck, "--prompt-ids", "1,2,3,4,5,6,7,8", "--max-new-tokens", "4", "--json", "--logits"]
    # in this interpreter (support.inproc.cli_inproc): the entry point is the subprocess test above
    npu = cli_inproc("run", "--spec", HW, *args, "--target", "npu", "--standin", timeout=STANDIN_TIMEOUT_S)
    cpu = cli_inproc("run", "--spec", cpu_spec, *args, timeout=STANDIN_TIMEOUT_S)
    assert npu.returncode == 0 and cpu.returncode == 0, npu.stderr + cpu.stderr
    import json

    a, b = json.loads(cpu.stdout), json.loads(npu.stdout)
    x, y = torch.tensor(a["logits"]), torch.tensor(b["logits"])  # the first step's
    assert_agree(a["tokens"][:1], [x], b["tokens"][:1], [y], TOL, where="run --target npu vs cpu")
    assert len(b["tokens"]) == 4


def _arrive_while_decoding(eng, short, long, n_short):
    """``short`` decodes; ``long`` arrives after its second step (mixed batches from then on)."""
    llm, plans, inner = eng.core, [], eng.runner.submit
    eng.runner.submit = lambda plan, **kw: (plans.append(plan), inner(plan, **kw))[1]
    rs = [llm.add_request("short", short, max_tokens=n_short)]
    llm.step()
    llm.step()
    rs.append(llm.add_request("long", long, max_tokens=3))
    while llm.has_work():
        llm.step()
    return [r.result for r in rs], plans


def _mixed_step(plan):
    from graphgen.npu.run.mixed_grid import MixedStep

    rows = [(r.start, r.num_tokens) for r in plan.rows]
    n_d = plan.decode_rows
    return MixedStep(tuple(rows[:n_d]), tuple(rows[n_d:]))


@pytest.mark.slow
def test_mixed_batches_with_chunks_run_on_the_npu_runner_and_match_the_cpu_target():
    """A 150-token prompt arriving while a request decodes runs in chunks of a 64-token budget,
    each in one step with the decode row (a mixed batch on splitfuse; the chunks before the last ask
    for no logits); logits within TOL of the CPU target on the same schedule, as above.  Each mixed
    batch is one graph call on its cell of the static mixed grid, and the graphs compiled are the
    distinct cells/buckets run, fewer than the mixed steps."""
    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.engine import npu_engine
    from graphgen.runtime import open_engine

    torch.set_num_threads(1)
    torch._dynamo.reset()  # graphs compiled by earlier tests in this process count against the recompile limit
    spec = load_spec(HW)
    W = random_weights(spec, seed=1, scale=0.1)
    cpu_spec = dataclasses.replace(spec, kv_cache=dataclasses.replace(spec.kv_cache, dtype="float32"))
    short, long = list(range(3, 20)), list(range(30, 180))
    with open_engine(cpu_spec, dict(W), collect_logits=True, num_blocks=64, max_num_batched_tokens=64) as e:
        cpu, cpu_plans = _arrive_while_decoding(e, short, long, 8)
    with npu_engine(spec, dict(W), collect_logits=True, num_blocks=64, standin=True, max_num_batched_tokens=64) as e:
        npu, plans = _arrive_while_decoding(e, short, long, 8)
        runner = e.runner
        calls, graphs = list(runner.graph_calls), len(runner.backends["splitfuse"].graphs)
    mixed = [p for p in plans if p.mixed]
    assert len(mixed) >= 2 and any(not row.samples for p in mixed for row in p.rows), plans
    # each mixed batch is ONE graph call padded to its cell of the static grid (decode rows D, tokens T);
    # the history variant compiled one graph per distinct cell/bucket it ran, never one per step
    grid = runner.grid
    by_plan = iter(calls)
    cells = {runner.grid.cell_for(_mixed_step(p)) for p in mixed}
    for p in plans:
        variant, batch, tokens = next(by_plan)
        assert variant == p.variant
        if p.mixed:
            cell = grid.cell_for(_mixed_step(p))
            assert (batch, tokens) == (grid.batch(cell), cell.tokens)
    assert next(by_plan, None) is None  # one call per plan: no plan was split
    shapes = {(b, t) for v, b, t in calls if v == "splitfuse"}
    assert graphs == len(shapes) <= runner.buckets.count("prefill") + grid.count() and len(cells) <= len(shapes)
    assert len(mixed) > len(cells)  # more mixed steps than graphs: steps reuse their cell's graph
    assert [(p.variant, [r.chunk for r in p.rows]) for p in plans] == \
        [(p.variant, [r.chunk for r in p.rows]) for p in cpu_plans]     # the same schedule on both targets
    for c, n in zip(cpu, npu):
        assert_agree(c.tokens, c.step_logits, n.tokens, n.step_logits, TOL, where="mixed steps, npu vs cpu")
