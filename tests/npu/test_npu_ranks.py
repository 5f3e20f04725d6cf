"""NPU ranks (graphgen/npu/run/ranks.py) through the CPU stand-in, and bf16 on the CPU target.

Both tiny NPU specs at ``--tp 2``: the NPU rank processes (the runtime's `DistributedEngine` with
``target="npu"``, gloo, the stand-in's kernels) against the CPU target's rank processes at tp=2, on
the same bfloat16 checkpoint. Both sides compute in bfloat16 (the CPU target runs a bf16 spec in its
dtype, docs/runtime.md), so the tolerance is bf16's, not bf16-vs-float32's: TOL = 0.15 absolute on
logits of magnitude 2..4, where one bf16 ulp is 2**-6 = 0.016; the two sides round after different
ops (fused stand-in kernels vs the reference ops, a different reduction order in the all_reduce'd
partial sums), observed <= 0.08 (5 ulps). Greedy tokens must be equal unless the top-2 margin is
below 2 * TOL (support.tokens.assert_agree). A stand-in result is a wiring check of our reading of the kernels, never an NPU result.
"""
from __future__ import annotations

import dataclasses
import json

import os

import pytest

import torch

from graphgen.npu.standin import fakes as standin
from support.cli import run_args
from support.inproc import cli_inproc
from support.paths import SPECS
from support.standin import STANDIN_TIMEOUT_S
from support.tokens import assert_agree

TOL = 0.15
PREFIX = list(range(3, 140))  # > one 128-token block: the repeat below hits it and runs splitfuse
PROMPTS = [PREFIX, list(range(5, 40)), PREFIX + [7, 8]]
needs_standin = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


def graphgen(*args, timeout=STANDIN_TIMEOUT_S):
    """``graphgen ARGS`` in this interpreter (`support.inproc.cli_inproc`; ``graphgen run``'s entry point is a
    subprocess in test_npu_runner.py), with the stand-in's fake torch_npu/torchair out of ``sys.modules`` as
    in a fresh interpreter (rank processes start fresh anyway)."""
    standin.uninstall()
    return cli_inproc(*args, timeout=timeout)


# ---- device mapping (cannot run here: no NPU) -------------------------------------------------
@pytest.mark.parametrize("local, world, visible, count, want", [
    (0, 2, None, 8, (0, 0)), (1, 2, None, 8, (1, 1)), (7, 8, "", 8, (7, 7)),
    (0, 2, "4,5", 2, (0, 4)), (1, 2, "4,5", 2, (1, 5)), (1, 4, "6,2,3,0", 4, (1, 2)),
])
def test_rank_device_from_local_rank_and_visible_devices(local, world, visible, count, want):
    from graphgen.npu.run.ranks import rank_device

    assert rank_device(local, world, visible=visible, device_count=count) == want


@pytest.mark.parametrize("world, visible, count, message", [
    (32, None, 8, "this node's 32 ranks need 32 NPUs but this node has 8; a layout wider than one node runs on several"),
    (4, "0,1", 2, "ASCEND_RT_VISIBLE_DEVICES lists 2"),
    (2, "0,x", 8, "expected comma-separated device ids"),
    (2, "1,1", 8, "must be distinct"),
])
def test_rank_device_refuses_what_one_node_cannot_hold(world, visible, count, message):
    from graphgen.npu.run.ranks import rank_device

    with pytest.raises(ValueError, match=message):
        rank_device(0, world, visible=visible, device_count=count)


# ---- fp32 keys ------------------------------------------------------------------------------
@needs_standin
def test_router_weight_and_bias_stay_fp32_in_the_runners():
    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.engine import npu_engine
    from graphgen.runtime import open_engine

    spec = load_spec(SPECS / "tiny_deepseek_v3_npu.yaml")
    W = {k: v.float() for k, v in random_weights(spec, seed=0).items()}  # as load_hf_weights gives them
    fp32 = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    with npu_engine(spec, dict(W), num_blocks=4, standin=True) as npu, open_engine(spec, dict(W), num_blocks=4) as cpu:
        for name, runner_w in (("npu", npu.runner.W), ("cpu", cpu.runner.W)):
            assert {k for k in fp32 if runner_w[k].dtype == torch.float32} == fp32, name
            others = {v.dtype for k, v in runner_w.items() if k in W and k not in fp32}
            assert others == {torch.bfloat16}, (name, others)  # the control: everything else is cast


# ---- bf16 on the CPU target -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny_qwen3_npu", "tiny_deepseek_v3_npu"])
def test_cpu_target_runs_a_bf16_checkpoint_in_bf16(name, npu_ckpts):
    """``graphgen run`` on a bf16 checkpoint (used to raise ``float != BFloat16``); its logits are
    bf16's: within TOL of the same weights run in float32, and not equal to them (it is not upcast)."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime import load_hf_weights, open_engine

    res = graphgen(*run_args(SPECS / f"{name}.yaml", npu_ckpts[name], [PROMPTS[1]], 2, "--logits"))
    assert res.returncode == 0, res.stderr[-3000:]
    got = torch.tensor(json.loads(res.stdout.splitlines()[0])["logits"])
    spec = load_spec(SPECS / f"{name}.yaml")
    f32 = dataclasses.replace(spec, kv_cache=dataclasses.replace(spec.kv_cache, dtype="float32"))
    with open_engine(f32, load_hf_weights(str(npu_ckpts[name])), collect_logits=True, num_blocks=4) as e:
        ref = e.generate([PROMPTS[1]], 1)[0].step_logits[0]
    diff = float((got - ref).abs().max())
    assert 0 < diff <= TOL, diff


def _startup_env(engine):  # run in each rank (pickled by name), given its engine
    return os.environ.get("HCCL_CONNECT_TIMEOUT"), os.environ.get("ENABLE_DYNAMIC_SHAPE_MULTI_STREAM")


def _async_on(engine):  # run in each rank: does its core plan step N+1 while step N runs?
    return engine.core.async_scheduling


# ---- ranks ------------------------------------------------------------------------------------
def _compare(cpu_tokens, npu_tokens, cpu_logits, npu_logits):
    """Logits within TOL, tokens equal up to a near tie (support.tokens); True when equal to the end."""
    return assert_agree(cpu_tokens, cpu_logits, npu_tokens, npu_logits, TOL, where="npu ranks vs cpu").tie_at is None


@needs_standin
def test_qwen3_npu_ranks_match_the_cpu_ranks(npu_ckpts):
    from graphgen.runtime import open_engine
    import graphgen.npu.run  # noqa: F401  (registers the "npu" target)

    spec, W = SPECS / "tiny_qwen3_npu.yaml", npu_ckpts["tiny_qwen3_npu"]
    runs, envs = {}, {}
    assert not {"HCCL_CONNECT_TIMEOUT", "ENABLE_DYNAMIC_SHAPE_MULTI_STREAM"} & set(os.environ)  # else: proves nothing
    # the NPU ranks with async scheduling (the seed's "async inference" on ranks), the CPU ranks without: one
    # launch each covers both the target and the scheduling mode (the prompts one after another, settled: each
    # decode step's input is fed back PENDING while the step before it is in flight; the third prompt is a pool
    # hit). The rank cores must really run async (else: proves nothing)
    for target, opts in (("cpu", {}), ("npu", {"standin": True, "async_scheduling": True})):
        with open_engine(spec, W, target=target, tp=2, collect_logits=True, num_blocks=8, threads=1, **opts) as e:
            runs[target] = e.generate(PROMPTS, 3)
            assert e.tp == 2 and type(e).__name__ == "DistributedEngine"
            envs[target] = e.on_ranks(_startup_env)
            assert e.on_ranks(_async_on) == [target == "npu"] * 2
    # the NPU ranks start with HCCL's connect timeout (the warm-up deadline, clamped to CANN's 120-7200 s) and the
    # multi-stream variable (audit 4 M2/M9: the launcher's child environment); the CPU ranks (no env hook) without
    assert envs["npu"] == [("7200", "1")] * 2 and envs["cpu"] == [(None, None)] * 2
    for c, n in zip(runs["cpu"], runs["npu"]):
        assert c.hit_tokens == n.hit_tokens and c.variant == n.variant
        _compare(c.tokens, n.tokens, c.step_logits, n.step_logits)
    assert runs["npu"][2].hit_tokens == 128 and runs["npu"][2].variant == "splitfuse"  # the ranks' commits


@needs_standin
def test_deepseek_npu_ranks_cli_match_the_cpu_ranks(npu_ckpts):
    """``graphgen run --target npu --standin --tp 2 --ep 2`` (MLA latent replicated: saved once by rank 0; each
    rank runs its half of the experts whole, ``npu_moe_init_routing_v2``'s ``active_expert_range``)."""
    spec, W = SPECS / "tiny_deepseek_v3_npu.yaml", npu_ckpts["tiny_deepseek_v3_npu"]
    out = {}
    for target, extra in (("cpu", ()), ("npu", ("--target", "npu", "--standin"))):
        res = graphgen(*run_args(spec, W, [PROMPTS[1]], 2, "--tp", "2", "--ep", "2", "--logits", *extra))
        assert res.returncode == 0, res.stderr[-3000:]
        out[target] = json.loads(res.stdout.splitlines()[0])
    assert "not an NPU result" in res.stderr  # the one line on what is verified
    _compare(out["cpu"]["tokens"][:1], out["npu"]["tokens"][:1], [out["cpu"]["logits"]], [out["npu"]["logits"]])
    # `run --logits` prints the first step's logits only: a later token is not compared (it may sit at a near tie)
    assert len(out["cpu"]["tokens"]) == len(out["npu"]["tokens"]) == 2


def _dummy_forwards(engine) -> int:  # a probe run in every rank process (module-level: pickled by name)
    return engine.runner.dummy_forwards


@needs_standin
def test_deepseek_npu_dp2_ep2_matches_the_cpu_dp_ranks(npu_ckpts):
    """DP attention + EP on the NPU runner (graphgen/npu/run/data_parallel.py) against the CPU DP ranks. First
    rank 0 runs two prompts and rank 1 one: their decode calls (2 rows, 1 row) run at one agreed bucket (rank
    1's padded to 2); then rank 0 alone: rank 1 runs a dummy call for each of rank 0's (its experts still
    process rank 0's tokens). Every step's logits within TOL (a flip only at a near-tie), tokens equal up to it."""
    from graphgen.runtime import open_engine
    import graphgen.npu.run  # noqa: F401  (registers the "npu" target)

    spec, W = SPECS / "tiny_deepseek_v3_npu.yaml", npu_ckpts["tiny_deepseek_v3_npu"]
    first = [list(range(3, 60)), list(range(70, 90)), [40, 41, 42]]
    then = [list(range(100, 140)), list(range(7, 30))]
    runs, dummies = {}, None
    for target, opts in (("cpu", {}), ("npu", {"standin": True})):
        with open_engine(spec, W, target=target, dp=2, ep=2, collect_logits=True, num_blocks=8, threads=1,
                         **opts) as e:
            assert type(e).__name__ == "DataParallelEngine"
            runs[target] = (e.generate(first, 3, batch=True, ranks=[0, 0, 1])
                            + e.generate(then, 3, batch=True, ranks=[0, 0]))
            if target == "npu":
                dummies = e.on_ranks(_dummy_forwards)
    for c, n in zip(runs["cpu"], runs["npu"]):
        _compare(c.tokens, n.tokens, c.step_logits, n.step_logits)
    assert dummies[0] == 0 and dummies[1] == 3, dummies  # then's prefill and two decodes, on rank 1


@needs_standin
def test_deepseek_npu_dp2_tp2_ep4_cli_matches_one_rank(npu_ckpts):
    """``graphgen run --target npu --standin --dp 2 --tp 2 --ep 4``: tp 2 inside each DP group on the NPU runner
    (every call at a bucket that is a multiple of tp, so the ep ``reduce_scatter_tensor`` cuts each group's rows
    into equal shards, the TP ``all_gather_into_tensor`` after it) against the CPU target's one rank on the same
    bf16 checkpoint: logits within TOL at every step, tokens equal up to a near tie (support.tokens)."""
    from graphgen.runtime import open_engine
    from support.tokens import assert_agree

    spec, W = SPECS / "tiny_deepseek_v3_npu.yaml", npu_ckpts["tiny_deepseek_v3_npu"]
    prompt = PROMPTS[1]
    res = graphgen(*run_args(spec, W, [prompt], 3, "--dp", "2", "--tp", "2", "--ep", "4", "--logits",
                             "--target", "npu", "--standin"))
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[0])
    with open_engine(spec, W, collect_logits=True, num_blocks=8) as one:
        ref = one.generate([prompt], 3)[0]
    assert_agree(ref.tokens[:1], ref.step_logits[:1], got["tokens"][:1], [got["logits"]], TOL, where="npu dp2 tp2")
    if got["tokens"][0] == ref.tokens[0]:
        assert len(got["tokens"]) == 3 and got["finish_reason"] == "length"
