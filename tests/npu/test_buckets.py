"""Compile once per shape bucket (audit risk 1), on the CPU stand-in with the kernel limits ENFORCED.

Uses a hardware-shaped tiny Qwen3 (tests/npu/data/hw_tiny_qwen3.yaml: bf16, head_dim 128, block 128),
generated in memory.  Counts Dynamo/AOT graphs -- what each GE compile / aclgraph capture would cost on
an NPU; says nothing about GE itself.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import torch

from graphgen.modelspec.loader import load_spec  # noqa: E402
from graphgen.npu.standin import fakes as standin  # noqa: E402
from graphgen.npu.run.bucketing import Buckets, LoopResult, bucketed_step, report, run_standin_loop  # noqa: E402

pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
SPEC = load_spec(Path(__file__).parent / "data/hw_tiny_qwen3.yaml")


def _setup(variant, buckets):
    from graphgen.lower.compile import compile_variant
    from graphgen.npu.run.compile import compile_module, load_module
    from graphgen.npu.run.inputs import ROPE_CACHE_KEY, kv_buffers, random_weights, rope_cache

    assert standin.install()
    mod = load_module(Path(f"hw/{variant}.py"), compile_variant(SPEC, variant, "npu", mode="max-autotune"))
    from graphgen.npu.run.weights import load_time_weights

    W = load_time_weights({k: t.to(torch.bfloat16) for k, t in random_weights(SPEC).items()}, [mod])
    W[ROPE_CACHE_KEY] = rope_cache(mod.ROPE, 512, dtype=torch.bfloat16)
    kv, staging = kv_buffers(mod, SPEC.dims.num_hidden_layers, 9, staging_rows=buckets.save_rows if mod.META["saves"] else 0)
    return mod, W, kv, staging, compile_module, load_module


@pytest.mark.slow  # a decode loop compiled through the stand-in
def test_decode_loop_with_growing_lengths_compiles_once_per_bucket():
    """Appendix C of the audit, adapted: 12 decode steps, growing lengths, batch 2 -> one bucket, one graph;
    then batch 3 and 1 -> two more buckets, two more graphs.  No FailOnRecompileLimitHit."""
    bk = Buckets()
    mod, W, kv, staging, compile_module, _ = _setup("decode", bk)
    torch._dynamo.reset()
    target, backend = compile_module(mod, use_standin=True, buckets=bk.count("decode"))
    hist = [5, 130]
    with torch.no_grad():
        for step in range(12):
            b, _ = bucketed_step(mod, SPEC, bk, [(h, 1) for h in hist], seed=step)
            target.forward(W, b, kv, staging)
            hist = [h + 1 for h in hist]
        assert len(backend.graphs) == 1
        for seqs in ([(7, 1), (8, 1), (9, 1)], [(3, 1)]):
            target.forward(W, bucketed_step(mod, SPEC, bk, seqs)[0], kv, staging)
    assert len(backend.graphs) == 3


def test_negative_control_the_old_strategy_recompiles_every_step():
    """compile_module without buckets (dynamic=False, lists guarded by value): a new graph per decode step
    (two steps of one bucket, two graphs: the smallest loop that shows it)."""
    bk = Buckets()
    mod, W, kv, staging, compile_module, _ = _setup("decode", bk)
    torch._dynamo.reset()
    target, backend = compile_module(mod, use_standin=True)
    hist = [5, 130]
    with torch.no_grad():
        for step in range(2):
            target.forward(W, bucketed_step(mod, SPEC, bk, [(h, 1) for h in hist], seed=step)[0], kv, staging)
            hist = [h + 1 for h in hist]
    assert len(backend.graphs) == 2


def test_prefill_of_varying_lengths_in_one_bucket_compiles_once():
    bk = Buckets()
    mod, W, kv, staging, compile_module, _ = _setup("mempool_prefill", bk)
    torch._dynamo.reset()
    target, backend = compile_module(mod, use_standin=True, buckets=bk.count("prefill"))
    with torch.no_grad():
        for seqs in ([(0, 20)], [(0, 33), (0, 7)], [(0, 1), (0, 50)], [(0, 60)]):
            target.forward(W, bucketed_step(mod, SPEC, bk, seqs)[0], kv, staging)
    assert len(backend.graphs) == 1  # all <= 64 tokens with padding: bucket 64


@pytest.mark.slow  # the 24-step stand-in compile (`hw_steps`, shared with test_compile_steps_cli)
def test_mixed_loop_never_compiles_more_graphs_than_buckets(hw_steps):
    """The session's 24-step loop over every variant (tests/npu/conftest.py: the one graphgen compile
    --standin --steps 24 runs); 24 steps of a seeded mix start with the 10 steps this test once ran alone."""
    results = hw_steps.results
    assert {(r.variant, r.mode) for r in results} == {("decode", "max-autotune"), ("splitfuse", "max-autotune"),
                                                      ("mempool_prefill", "max-autotune")}
    assert all(1 <= r.compilations <= r.buckets for r in results), results
    lines = []
    assert report(results, lines.append) == 0 and "nothing ran on an NPU" in lines[-1]


@pytest.mark.slow  # ~10 s: six graphs, three computed on CPU
def test_a_meta_run_compiles_the_graphs_a_cpu_run_compiles():
    """run_standin_loop runs its steps on meta tensors by default (shapes only, nothing computed): the same
    graphs per bucket, with the same post-AOT op targets, as the same loop computing values on CPU."""
    from graphgen.npu.check.geops import captured_targets

    bk = Buckets(decode_batch=(1, 2), prefill_tokens=(128,), prefill_seqs=2, max_blocks=4, save_rows=4)
    runs = {d: run_standin_loop(SPEC, ["decode", "splitfuse"], steps=3, buckets=bk, every_bucket=True, device=d)
            for d in ("cpu", "meta")}
    assert [r.compilations for r in runs["meta"]] == [r.compilations for r in runs["cpu"]] == [2, 1]
    for cpu, meta in zip(runs["cpu"], runs["meta"]):
        assert [g["bucket"] for g in meta.graphs] == [g["bucket"] for g in cpu.graphs]
        assert [captured_targets(g["captured"]) for g in meta.graphs] == \
            [captured_targets(g["captured"]) for g in cpu.graphs]
        assert {p.device.type for g in meta.graphs for p in g["captured"].example_inputs
                if isinstance(p, torch.Tensor)} == {"meta"}


def test_report_exits_1_when_a_variant_compiled_more_graphs_than_buckets():
    assert report([LoopResult("decode", "max-autotune", 24, 5, 4)], lambda s: None) == 1


def test_the_causal_mask_is_built_once_per_device_and_shared_by_steps_and_buckets():
    """Audit 2 row 15a: the 2048^2 sparse_mode=3 mask was built and copied every prefill step."""
    from graphgen.npu.run.inputs import causal_mask, npu_step_inputs

    def step(n_tokens: int, bucket: int):
        from graphgen.npu.run.inputs import StepPadding

        pad = StepPadding(batch=2, tokens=bucket, max_blocks=1, pad_block=7, save_rows=1)
        return npu_step_inputs(input_ids=list(range(n_tokens)), positions=list(range(n_tokens)),
                               slot_mapping=list(range(n_tokens)), block_tables=[[0]], seq_lens=[n_tokens],
                               query_lens=[n_tokens], logits_indices=[n_tokens - 1], block_size=128, pad=pad)

    a, b, c = step(5, 16), step(9, 16), step(20, 32)  # two steps of one bucket, one of another
    assert a.atten_mask is b.atten_mask is c.atten_mask is causal_mask("cpu")
    assert torch.equal(a.atten_mask, torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
    assert step(5, 16).atten_mask is not None and npu_step_inputs(
        input_ids=[1], positions=[3], slot_mapping=[3], block_tables=[[0]], seq_lens=[4], query_lens=[1],
        logits_indices=[0], block_size=128, decode=True).atten_mask is None  # decode reads no mask


def test_dp_attention_at_tp_runs_only_buckets_that_are_multiples_of_tp():
    """Under dp > 1, tp > 1 the ep reduce_scatter_tensor cuts each call's rows into tp equal shards: the buckets
    kept are the multiples of tp (negative control: at tp 1, or dp 1, every bucket stays); none of a kind left is
    a sentence naming the fix."""
    import dataclasses

    spec = load_spec(Path(__file__).parents[2] / "specs/tiny_deepseek_v3_npu.yaml")
    npu = dataclasses.replace(spec.targets.npu, decode_batch_buckets=(1, 2, 3, 4), prefill_token_buckets=(63, 64, 128))
    at = lambda **p: dataclasses.replace(spec, targets=dataclasses.replace(spec.targets, npu=npu),  # noqa: E731
                                         parallel=dataclasses.replace(spec.parallel, **p))
    b = Buckets.from_spec(at(dp=2, tp=2, ep=4))
    assert (b.decode_batch, b.prefill_tokens) == ((2, 4), (64, 128))
    for p in ({"dp": 2, "tp": 1, "ep": 2}, {"dp": 1, "tp": 2, "ep": 2}):
        assert Buckets.from_spec(at(**p)).decode_batch == (1, 2, 3, 4)
    npu = dataclasses.replace(npu, decode_batch_buckets=(1, 3))
    with pytest.raises(ValueError, match="leave none of one kind.*add a multiple of 2"):
        Buckets.from_spec(at(dp=2, tp=2, ep=4))
