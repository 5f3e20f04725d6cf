"""The NPU grid of mixed batches (graphgen.npu.run.mixed_grid): decode rows and prefill chunks in one
splitfuse graph, padded to cells (tokens x decode rows x tokens per decode row). The cell arithmetic
and the static shapes of every padded step are checked here without compiling; the stand-in loop
(slow) shows that a varying mix compiles one graph per visited cell, and that padding each step to
its exact size instead (no grid) compiles one per distinct step. Graph counts are Dynamo/AOT graphs
on CPU: what GE compiles would cost on an NPU; nothing here ran on an NPU."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphgen.modelspec.loader import load_spec
from graphgen.npu.run.bucketing import PAD_BLOCK, Buckets, bucketed_step, run_standin_loop, stable_seed
from graphgen.npu.run.compile import load_module
from graphgen.npu.run.inputs import StepPadding
from graphgen.npu.run.mixed_grid import MixedCell, MixedGrid, MixedStep
from graphgen.npu.standin import fakes as standin

SPEC = load_spec(Path(__file__).parent / "data/hw_tiny_qwen3.yaml")
BS = SPEC.kv_cache.block_size


def test_the_grid_is_every_feasible_cell_and_a_step_gets_the_smallest_that_holds_it():
    bk = Buckets()  # decode (1, 2, 4, 8), tokens (64, 128, 256, 512), 2 chunk rows
    grid = MixedGrid.from_buckets(bk, tokens_per_row=(1, 3))
    want = [(t, d, k) for k in (1, 3) for d in bk.decode_batch for t in bk.prefill_tokens if t >= d * k + 3]
    assert [(c.tokens, c.decode_rows, c.tokens_per_row) for c in grid.cells()] == want and grid.count() == len(want)
    # 3 decode rows -> 4 slots; 3 + 40 + 20 tokens + 3 padding sequences (one decode slot, one chunk
    # slot, the trailing one) = 66 -> 128
    step = MixedStep(((10, 1), (11, 1), (12, 1)), ((0, 40), (5, 20)))
    assert grid.cell_for(step) == MixedCell(128, 4, 1)
    verify = MixedStep(((10, 3),), ((0, 55),))      # one verify row of 3 tokens: K = 3
    assert grid.cell_for(verify) == MixedCell(64, 1, 3)
    with pytest.raises(ValueError, match="exceed the grid"):
        grid.cell_for(MixedStep(tuple((1, 1) for _ in range(9)), ((0, 4),)))
    with pytest.raises(ValueError, match="largest token bucket"):
        grid.cell_for(MixedStep(((1, 1),), ((0, 510),)))


def test_warm_up_has_one_step_per_cell_padded_to_exactly_that_cell():
    # what NpuModelRunner.warm_up compiles for a history variant: every cell, each exactly once
    grid = MixedGrid.from_buckets(Buckets(), tokens_per_row=(1, 3))
    steps = grid.cell_steps(BS)
    assert [grid.cell_for(s) for s in steps] == grid.cells()
    cap = grid.max_blocks * BS
    assert all(h + q <= cap and h > 0 for s in steps for h, q in s.seqs)   # histories within the table
    assert all(len(s.chunks) == grid.prefill_seqs for s in steps)


@pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed")
def test_every_step_of_a_cell_has_the_same_static_shapes():
    """Different mixes in one cell give the same tensor shapes (only length values differ), logits
    rows included when verify rows bring K of them each."""
    from graphgen.lower.compile import compile_variant

    bk = Buckets.from_spec(SPEC)
    grid = MixedGrid.from_buckets(bk, tokens_per_row=(1, 2))
    assert standin.install()
    try:
        mod = load_module(Path("hw/splitfuse.py"), compile_variant(SPEC, "splitfuse", "npu", mode="max-autotune"))
    finally:
        standin.uninstall()
    steps = [MixedStep(((300, 2), (40, 2), (7, 2)), ((0, 30),)),
             MixedStep(((129, 2), (3, 2), (90, 2), (5, 2)), ((BS + 1, 50), (0, 9))),
             MixedStep(((200, 2), (9, 2), (33, 2)), ((2 * BS, 77), (0, 1)))]
    shapes = set()
    for s in steps:
        pad = grid.padding(s, PAD_BLOCK)
        assert grid.cell_for(s) == MixedCell(128, 4, 2)
        b, _ = bucketed_step(mod, SPEC, bk, s.seqs, pad=pad)
        shapes.add((tuple(b.input_ids.shape), tuple(b.block_tables.shape), len(b.actual_seq_lengths),
                    len(b.actual_seq_lengths_kv), tuple(b.logits_indices.shape), tuple(b.save_block_ids.shape),
                    tuple(b.kv_gather_rows.shape)))
    assert shapes == {((128,), (4 + 3, bk.max_blocks), 7, 7, (4 * 2 + 3,), (bk.save_rows,),
                       ((7 - 1) * bk.max_blocks * BS + 128,))}


def _count_graphs(buckets, steps, pad_of):
    """Graphs the stand-in compiles for splitfuse running ``steps`` padded by ``pad_of(step)``, on meta
    tensors (shapes only, as run_standin_loop runs; test_buckets.py shows a CPU run compiles the same graphs)."""
    import torch

    from graphgen.lower.compile import compile_variant
    from graphgen.npu.run.compile import compile_module
    from graphgen.npu.run.inputs import ROPE_CACHE_KEY, kv_buffers, load_buffers, random_weights, rope_cache

    torch._dynamo.reset()
    assert standin.install()
    try:
        with standin.fresh_tags():
            mod = load_module(Path("hw/splitfuse.py"), compile_variant(SPEC, "splitfuse", "npu", mode="max-autotune"))
            target, backend = compile_module(mod, "max-autotune", use_standin=True, buckets=len(steps) + 1)
        dtype = torch.bfloat16
        from graphgen.npu.run.weights import load_time_weights

        W = load_time_weights({k: t.to(device="meta", dtype=dtype) for k, t in random_weights(SPEC).items()}, [mod])
        W[ROPE_CACHE_KEY] = rope_cache(mod.ROPE, buckets.max_blocks * BS, dtype=dtype, device="meta")
        nb = 1 + (buckets.prefill_seqs + buckets.decode_batch[-1]) * buckets.max_blocks
        kv, staging = kv_buffers(mod, SPEC.dims.num_hidden_layers, nb, staging_rows=buckets.save_rows, device="meta")
        loads = load_buffers(mod, SPEC.dims.num_hidden_layers, buckets.save_rows, device="meta")
        with torch.no_grad(), standin.enforce_limits(True):
            for i, s in enumerate(steps):
                b, _ = bucketed_step(mod, SPEC, buckets, s.seqs, seed=i, pad=pad_of(s), device="meta")
                mod.load(b, kv, loads)
                target.forward(W, b, kv, staging)
        return len(backend.graphs)
    finally:
        standin.uninstall()


@pytest.mark.slow
@pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed")
def test_a_varying_mix_compiles_one_graph_per_visited_cell_and_exact_padding_one_per_shape():
    bk = Buckets(decode_batch=(2, 4), prefill_tokens=(128,), prefill_seqs=2, max_blocks=4, save_rows=4)
    grid = MixedGrid.from_buckets(bk)
    steps = grid.steps(5, BS, seed=stable_seed("test", "mixed"))
    cells = {grid.cell_for(s) for s in steps}
    assert len(cells) == 2                                  # both decode-row columns visited
    assert _count_graphs(bk, steps, lambda s: grid.padding(s, PAD_BLOCK)) == len(cells)
    # the negative control: each step padded only to its own size (one padding sequence, no grid); the first
    # two steps share a cell, which padded exactly is two graphs (the smallest run that shows it)
    exact = lambda s: StepPadding(len(s.seqs) + 1, sum(q for _, q in s.seqs) + 1, bk.max_blocks, PAD_BLOCK,   # noqa: E731
                                  bk.save_rows)
    assert grid.cell_for(steps[0]) == grid.cell_for(steps[1])
    assert _count_graphs(bk, steps[:2], exact) == 2


@pytest.mark.slow
@pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed")
def test_the_standin_loop_runs_mixed_batches_on_the_history_variant_only():
    bk = Buckets(decode_batch=(2,), prefill_tokens=(128,), prefill_seqs=2, max_blocks=4, save_rows=4)
    results = run_standin_loop(SPEC, ["decode", "splitfuse"], steps=2, buckets=bk, mixed_batches=3)
    by = {r.variant: r for r in results}
    assert (by["decode"].mixed, by["decode"].buckets) == (0, 1)
    assert (by["splitfuse"].mixed, by["splitfuse"].buckets) == (3, 1 + MixedGrid.from_buckets(bk).count())
    assert by["splitfuse"].compilations == 2 and all(r.ok for r in results)   # the plain bucket + one cell
