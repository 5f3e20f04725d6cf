"""Sequence parallel and context parallel on the NPU runner (``--target npu --standin``; issue 38 item 3).

Each runs the layout's NPU rank processes (the runtime's `DistributedEngine` with ``target="npu"``, gloo, the
stand-in's kernels) on the bf16 checkpoint of a hardware-shaped tiny spec and compares them with ONE CPU rank of
the same checkpoint (bf16 too): an implementation nobody here wrote for the layout (no SP, no CP) is the
reference. TOL is test_npu_ranks.py's (bf16 on both sides, a different reduction order: 0.15 on logits of
magnitude 2..4); greedy tokens equal unless the reference's top-2 margin is under 2 * TOL (support.tokens).

* **SP** (`--tp 2 --sp`: DeepSeek alone through `graphgen run`, Qwen3 under `--cp 2`): every graph call's token count is a multiple of tp (`Buckets.from_spec` keeps only those
  buckets; the stand-in's ``reduce_scatter_tensor`` cuts equal shards and fails otherwise), and the modules the
  ranks run are the SP graphs (their reduce-scatters counted).

* **CP** (`--cp 2`, with `--tp 2 --sp` as the seed ran it on Qwen3; alone on DeepSeek): each CP rank runs its head-tail pieces of a prefill step, every call at one bucket on
  every rank (the KV ``all_gather_into_tensor`` takes equal shards), the gathered rows' slots in ``kv_index``;
  a prompt, its decode steps (which read the KV the gathers wrote), and a repeat that hits the first's saved
  block (so CP rank 0's save reached the pool and every rank loaded it) and runs splitfuse under CP. The call
  planner itself (`graphgen.npu.run.context_parallel.cp_calls`) is checked without processes, with a negative
  control (a rank's own slots only, as a kv_index without the gather, misses the other rank's rows).

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


def _ge_graphs(engine):  # ... and the post-AOT op targets of every graph the rank compiled (`--ops-json` entries)
    from graphgen.npu.check.geops import captured_targets

    out = []
    for v, backend in engine.runner.backends.items():
        for i, captured in enumerate(backend.graphs):
            ops, calls = captured_targets(captured)
            out.append({"variant": v, "mode": engine.runner.mode, "bucket": {"graph": i}, "ops": ops,
                        "callables": calls})
    return out


def _check_ge(name, per_rank, collective):
    """Every rank's compiled graphs against the pinned wheel's GE converters (`geops.check_ops_report`, as
    tests/npu/test_ge_converters.py checks the cached op lists); the layout's collective among their ops."""
    from graphgen.npu.check import geops

    for rank, graphs in enumerate(per_rank):
        assert geops.check_ops_report({"spec": f"{name} rank {rank}", "graphs": graphs}) == []
        assert any(f"_c10d_functional.{collective}.default" in g["ops"] for g in graphs), (rank, collective)


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
def test_deepseek_npu_tp2_sp_cli_matches_one_cpu_rank(npu_ckpts):
    """``graphgen run --target npu --standin --tp 2 --ep 2 --sp`` (MLA, the experts split over the TP ranks, the
    MoE's partial sums reduce-scattered): the prompt's logits within TOL of one CPU rank, its token equal up to a
    near tie (one token: the decode graph is Qwen3's test's; one graph less to compile)."""
    spec, W = SPECS / "tiny_deepseek_v3_npu.yaml", npu_ckpts["tiny_deepseek_v3_npu"]
    prompt = list(range(5, 40))
    standin.uninstall()  # as in a fresh interpreter (test_npu_ranks.graphgen)
    res = cli_inproc(*run_args(spec, W, [prompt], 1, "--tp", "2", "--ep", "2", "--sp", "--logits", "--target", "npu",
                               "--standin"), timeout=STANDIN_TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[0])
    ref = _one_cpu_rank(spec, W, [prompt], 1)[0]
    assert_agree(ref.tokens, ref.step_logits, got["tokens"], [got["logits"]], TOL, where="npu tp2 sp")


# ---- context parallel --------------------------------------------------------------------------------------
def _plan(lengths, block_size=128, start=0):
    from graphgen.runtime.engine.request import RowPlan, StepPlan

    rows, nxt = [], 1
    for n in lengths:
        nb = -(-(start + n) // block_size)
        rows.append(RowPlan(None, tuple(range(100, 100 + n)), start, tuple(range(nxt, nxt + nb)),
                            logits_positions=(n - 1,)))
        nxt += nb
    return StepPlan("mempool_prefill", "prefill", tuple(rows), True)


def test_cp_calls_cover_every_row_once_at_one_bucket_per_call():
    """Rows of 1, 3, 17 and 40 tokens (a 1-token row: rank 0's alone; 3: rank 0 one token, rank 1 two) over cp 2: every call
    holds whole rows, at most prefill_seqs pieces per rank, one bucket for both ranks; the two ranks' pieces
    tile each row exactly once; the gathered kv_index is rank 0's padded slots then rank 1's, padding rows in
    the pad block. Negative control: one rank's own slots (a kv_index without the gather) miss the other's rows."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.npu.run.bucketing import Buckets
    from graphgen.npu.run.context_parallel import cp_calls
    from graphgen.npu.run.context_parallel import piece_sequence
    from graphgen.runtime.core.kvcache import slot_mapping

    buckets = Buckets.from_spec(load_spec(SPECS / "tiny_qwen3_npu.yaml"))
    plan = _plan([1, 3, 17, 40], start=5)
    calls = cp_calls(plan, 2, buckets, "prefill", 0)
    assert [c.rows for c in calls] == [(0, 1), (2,), (3,)]  # rows 0 and 1: rank 0 holds 2 pieces, rank 1 one
    bs = 128
    for c in calls:
        assert all(len(p) <= buckets.prefill_seqs for p in c.pieces) and c.pad.batch == buckets.prefill_seqs + 1
        for i in c.rows:
            cover = sorted((lo, hi) for mine in c.pieces for j, lo, hi in mine if j == i)
            assert [x for lo, hi in cover for x in range(lo, hi)] == list(range(plan.rows[i].num_tokens))

        def seqs(pieces):
            return [piece_sequence(plan.rows[i], bs, lo, hi) for i, lo, hi in pieces]

        got = c.gathered_kv_index(seqs, bs)
        assert got.shape == (2 * c.pad.tokens, 2)
        want = set()
        for i in c.rows:
            row = plan.rows[i]
            want |= set(slot_mapping(list(row.block_table), row.start, row.seq_len, bs).tolist())
        flat = (got[:, 0] * bs + got[:, 1]).tolist()
        assert want == {x for x in flat if x >= bs}  # every real slot once, the rest in the pad block (0)
        assert all(x < bs for x in flat[len(flat) // 2:][sum(h - lo for _, lo, h in c.pieces[1]):])
        own = {x for s in seqs(c.pieces[0]) for x in s["slots"]}
        assert own != want  # the negative control: rank 0's own slots alone are not the rows' KV
    assert calls[0].pieces == (((0, 0, 1), (1, 0, 1)), ((1, 1, 2), (1, 2, 3)))  # the 1-token row: rank 0's alone
    few = Buckets(buckets.decode_batch, buckets.prefill_tokens, 1, buckets.max_blocks, buckets.save_rows)
    with pytest.raises(ValueError, match="prefill_seqs must be at least 2"):
        cp_calls(plan, 2, few, "prefill", 0)


PREFIX = list(range(3, 140))  # > one 128-token block: the repeat hits it and runs splitfuse


@needs_standin
def test_qwen3_npu_cp2_tp2_sp_matches_one_cpu_rank(npu_ckpts):
    """``open_engine(..., target="npu", standin=True, cp=2, tp=2, sp=True)`` (the seed's CP/SP: four rank processes,
    two CP ranks of a TP group each, sequence parallel inside it): a 137-token prompt and its decode steps, then the
    same prompt + 2 tokens, which hits the 128-token block CP rank 0 saved and runs splitfuse split over the CP ranks:
    logits within TOL of one CPU rank at every step; every rank's graph calls at the same buckets, each a multiple
    of tp (SP's equal shards), through modules that gather the CP KV and reduce-scatter the TP sums."""
    from graphgen.runtime import open_engine
    import graphgen.npu.run  # noqa: F401  (registers the "npu" target)

    spec, W = SPECS / "tiny_qwen3_npu.yaml", npu_ckpts["tiny_qwen3_npu"]
    prompts = [PREFIX, PREFIX + [7, 8]]
    refs = [_one_cpu_rank(spec, W, [p], 2)[0] for p in prompts]
    with open_engine(spec, W, target="npu", standin=True, cp=2, tp=2, sp=True, collect_logits=True, num_blocks=8,
                     threads=1) as e:
        got = [e.generate([p], 2)[0] for p in prompts]
        calls, graphs = e.on_ranks(_calls), e.on_ranks(_ge_graphs)
    assert len(calls) == 4
    _check_ge("tiny_qwen3_npu cp2 tp2 sp", graphs, "all_gather_into_tensor")
    _check_ge("tiny_qwen3_npu cp2 tp2 sp", graphs, "reduce_scatter_tensor")
    for ref, g in zip(refs, got):
        assert_agree(ref.tokens, ref.step_logits, g.tokens, g.step_logits, TOL, where="npu cp2 tp2 sp")
    assert (got[1].hit_tokens, got[1].variant) == (128, "splitfuse")
    assert all(c[0] == calls[0][0] for c in calls) and \
        {v for v, _, _ in calls[0][0]} == {"mempool_prefill", "splitfuse", "decode"}
    assert all(tokens % 2 == 0 for _, _, tokens in calls[0][0]), calls[0][0]
    for _, modules in calls:
        assert all("all_gather_into_tensor" in modules[v] for v in ("mempool_prefill", "splitfuse"))
        assert all("reduce_scatter_tensor" in called for called in modules.values()), modules


@needs_standin
def test_deepseek_npu_cp2_matches_one_cpu_rank(npu_ckpts):
    """``open_engine(..., target="npu", standin=True, cp=2)`` on tiny DeepSeek (the MLA latent gathered; the prefill
    attends over the gathered latent through the host-packed rows, as splitfuse does): the prompt's logits within
    TOL of one CPU rank, its token equal up to a near tie (one token: the decode graph is Qwen3's test's), and
    every compiled graph through the GE converter check."""
    from graphgen.runtime import open_engine
    import graphgen.npu.run  # noqa: F401  (registers the "npu" target)

    spec, W = SPECS / "tiny_deepseek_v3_npu.yaml", npu_ckpts["tiny_deepseek_v3_npu"]
    prompt = list(range(5, 40))
    ref = _one_cpu_rank(spec, W, [prompt], 1)[0]
    with open_engine(spec, W, target="npu", standin=True, cp=2, collect_logits=True, num_blocks=8, threads=1) as e:
        got = e.generate([prompt], 1)[0]
        graphs = e.on_ranks(_ge_graphs)
    assert_agree(ref.tokens, ref.step_logits, got.tokens, got.step_logits, TOL, where="npu cp2")
    _check_ge("tiny_deepseek_v3_npu cp2", graphs, "all_gather_into_tensor")


def test_cp_with_dp_is_refused_on_the_npu_only_and_cp_sp_alone_are_not():
    """The one refusal table (`families.parallel.runtime_layout_gap`): cp with DP attention runs on the CPU ranks,
    not on the NPU runner (one sentence naming the missing piece); cp and sp alone run on both targets."""
    from graphgen.families.parallel import runtime_layout_gap
    from graphgen.modelspec.model import Parallel

    both = Parallel(dp=2, cp=2, ep=2)
    assert runtime_layout_gap(both, "cpu") is None
    assert "context parallel with DP attention does not run on the NPU runner yet" in runtime_layout_gap(both, "npu")
    for par in (Parallel(cp=2), Parallel(tp=2, sp=True), Parallel(cp=2, tp=2, sp=True)):
        assert runtime_layout_gap(par, "npu") is None, par
