"""Sequence parallel and context parallel on the NPU runner (``--target npu --standin``; issue 38 item 3).

Each runs the layout's NPU rank processes (the runtime's `DistributedEngine` with ``target="npu"``, gloo, the
stand-in's kernels) on the bf16 checkpoint of a hardware-shaped tiny spec and compares them with ONE CPU rank of
the same checkpoint (bf16 too): an implementation nobody here wrote for the layout (no SP, no CP) is the
reference. TOL is test_npu_ranks.py's (bf16 on both sides, a different reduction order: 0.15 on logits of
magnitude 2..4); greedy tokens equal unless the reference's top-2 margin is under 2 * TOL (support.tokens).

* **SP** (`--tp 2 --sp`): every graph call's token count is a multiple of tp (`Buckets.from_spec` keeps only those
  buckets; the stand-in's ``reduce_scatter_tensor`` cuts equal shards and fails otherwise), and the modules the
  ranks run are the SP graphs (their reduce-scatters counted).

A stand-in result is a wiring check of our reading of the kernels and of HCCL's collectives, never an NPU result.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from graphgen.npu.standin import fakes as standin
from support.cli import run_args
from support.inproc import cli_inproc
from support.paths import SPECS
from support.standin import STANDIN_TIMEOUT_S
from support.tokens import assert_agree

TOL = 0.15  # test_npu_ranks.py: bf16 on both sides
needs_standin = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


def _one_cpu_rank(spec, ckpt, prompts, n_new):
    from graphgen.runtime import open_engine

    with open_engine(spec, ckpt, collect_logits=True, num_blocks=8) as one:
        return one.generate(prompts, n_new)


def _calls(engine):  # run in each rank process (pickled by name): its graph calls, the collectives its modules call
    return engine.runner.graph_calls, {v: set(m.forward.__code__.co_names) & COLLECTIVES
                                       for v, m in engine.runner.modules.items()}


COLLECTIVES = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}


# ---- sequence parallel -------------------------------------------------------------------------------------
def test_sp_buckets_are_multiples_of_tp_and_a_spec_without_one_is_refused():
    """Sequence parallel cuts every call's tokens into tp equal shards: only buckets that tp divides run (the
    default decode buckets 1, 2, 4, 8 lose 1); none of one kind left is an error naming the fix."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.run.bucketing import Buckets

    spec = load_spec(SPECS / "tiny_qwen3_npu.yaml")
    plain = Buckets.from_spec(dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, tp=2)))
    sp = dataclasses.replace(spec, parallel=dataclasses.replace(spec.parallel, tp=2, sp=True))
    got = Buckets.from_spec(sp)
    assert 1 in plain.decode_batch and got.decode_batch == tuple(b for b in plain.decode_batch if b % 2 == 0)
    assert all(t % 2 == 0 for t in got.prefill_tokens)
    odd = dataclasses.replace(sp, targets=dataclasses.replace(
        sp.targets, npu=dataclasses.replace(sp.targets.npu, decode_batch_buckets=(1, 3))))
    with pytest.raises(ValueError, match=r"sequence parallel at tp 2 runs only buckets that are multiples of tp.*"
                                         r"fix: add a multiple of 2"):
        Buckets.from_spec(odd)


@needs_standin
def test_qwen3_npu_tp2_sp_matches_one_cpu_rank(npu_ckpts):
    """``open_engine(..., target="npu", standin=True, tp=2, sp=True)``: a prompt and its decode steps within TOL of
    one CPU rank at every step; every rank's graph calls at even token counts, through the SP modules."""
    from graphgen.runtime import open_engine
    import graphgen.npu.run  # noqa: F401  (registers the "npu" target)

    spec, W = SPECS / "tiny_qwen3_npu.yaml", npu_ckpts["tiny_qwen3_npu"]
    prompt = list(range(5, 40))
    ref = _one_cpu_rank(spec, W, [prompt], 3)[0]
    with open_engine(spec, W, target="npu", standin=True, tp=2, sp=True, collect_logits=True, num_blocks=8,
                     threads=1) as e:
        got = e.generate([prompt], 3)[0]
        calls = e.on_ranks(_calls)
    agreed = assert_agree(ref.tokens, ref.step_logits, got.tokens, got.step_logits, TOL, where="npu tp2 sp")
    assert agreed.steps >= 2
    for graph_calls, modules in calls:
        assert {v for v, _, _ in graph_calls} == {"mempool_prefill", "decode"}
        assert all(tokens % 2 == 0 for _, _, tokens in graph_calls), graph_calls
        assert all("reduce_scatter_tensor" in called for called in modules.values()), modules  # the SP graphs


@needs_standin
def test_deepseek_npu_tp2_sp_cli_matches_one_cpu_rank(npu_ckpts):
    """``graphgen run --target npu --standin --tp 2 --ep 2 --sp`` (MLA, the experts split over the TP ranks, the
    MoE's partial sums reduce-scattered): the first step's logits within TOL of one CPU rank, tokens equal up to a
    near tie."""
    spec, W = SPECS / "tiny_deepseek_v3_npu.yaml", npu_ckpts["tiny_deepseek_v3_npu"]
    prompt = list(range(5, 40))
    standin.uninstall()  # as in a fresh interpreter (test_npu_ranks.graphgen)
    res = cli_inproc(*run_args(spec, W, [prompt], 2, "--tp", "2", "--ep", "2", "--sp", "--logits", "--target", "npu",
                               "--standin"), timeout=STANDIN_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[0])
    ref = _one_cpu_rank(spec, W, [prompt], 2)[0]
    assert_agree(ref.tokens[:1], ref.step_logits[:1], got["tokens"][:1], [got["logits"]], TOL, where="npu tp2 sp")
    assert len(got["tokens"]) == 2
