"""Warm-up at engine start (issue 15 item 5, audit 2 row 15f): ``npu_engine(warmup=...)`` compiles every
bucket of every variant before the first request, one stderr line per bucket; on by default on an NPU, off by
default with the stand-in, ``--warmup/--no-warmup`` overriding.  Through the CPU stand-in: Dynamo graph counts,
never a GE compile time."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphgen.npu.standin import fakes as standin

pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
HW = Path(__file__).parent / "data" / "hw_tiny_qwen3.yaml"
PROMPTS = [list(range(3, 40)), list(range(5, 20))]


def _few_buckets_spec():
    """hw_tiny_qwen3 with two variants and three buckets: decode batch 1/2, prefill 128 tokens."""
    from graphgen.modelspec.loader import parse_spec_text

    text = HW.read_text().replace("  splitfuse:\n    phase: prefill\n    history: true\n", "")
    text = text.replace("    compile_modes: [max-autotune]\n", "    compile_modes: [max-autotune]\n"
                        "    decode_batch_buckets: [1, 2]\n    prefill_token_buckets: [128]\n")
    return parse_spec_text(text, "few_buckets.yaml")


def _generate(spec, capsys, **kw):
    import torch

    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.engine import npu_engine

    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    with npu_engine(spec, dict(random_weights(spec, seed=1, scale=0.1)), num_blocks=16, standin=True, **kw) as e:
        started = graphs["unique_graphs"]
        tokens = [r.tokens for r in e.generate(PROMPTS, 3)]
        later = graphs["unique_graphs"] - started
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warm-up")]
    return tokens, started - before, later, lines


@pytest.mark.slow  # a warm-up and a restart: a stand-in compile per bucket
def test_warmup_compiles_every_bucket_largest_first_and_a_restart_with_the_cache_compiles_nothing(capsys, tmp_path):
    """Run 1 warms up (largest bucket first, audit 3 N12) into a compile cache; run 2, a restart with the
    same cache and the stand-in's default (no warm-up), compiles no graph at all: every bucket's entry is
    loaded (issue 27 item 6); run 3, with one module's source changed, misses that module's stale entry
    and compiles it again, and only it (the negative control: the cache does not load blindly)."""
    spec = _few_buckets_spec()
    warm, compiled, later, lines = _generate(spec, capsys, warmup=True, cache_dir=tmp_path)
    assert [line.split(": ", 1)[1].split(" (eta")[0] for line in lines] == [
        "decode bucket batch=2 tokens=2 compiled", "decode bucket batch=1 tokens=1 compiled",
        "mempool_prefill bucket batch=3 tokens=128 compiled"]
    assert lines[0].startswith("warm-up 1/3") and compiled == 3 and later == 0  # serving compiled nothing more
    again, compiled, later, lines = _generate(spec, capsys, cache_dir=tmp_path)  # default with standin: no warm-up
    assert lines == [] and compiled == 0 and later == 0, (compiled, later)  # every graph loaded, none compiled
    assert again == warm  # the warm-up writes only the pad block: the same tokens
    from graphgen.lower.compile import compile_variant

    edited = {"mempool_prefill": compile_variant(spec, "mempool_prefill", "npu", mode="max-autotune") + "\n# edited\n"}
    changed, compiled, later, _ = _generate(spec, capsys, cache_dir=tmp_path, sources=edited)
    assert compiled == 0 and later == 1 and changed == warm  # the edited module's one bucket, nothing else


def test_warmup_flag_reaches_the_engine_options():
    import argparse

    from graphgen.engine_args import add_engine_arguments, check_engine_arguments, engine_options

    p = argparse.ArgumentParser()
    add_engine_arguments(p, max_num_seqs=8, async_scheduling=False)
    base = ["--spec", "s.yaml", "--weights", "w", "--target", "npu", "--standin"]
    assert engine_options(p.parse_args(base))["warmup"] is None
    assert engine_options(p.parse_args(base + ["--warmup"]))["warmup"] is True
    assert engine_options(p.parse_args(base + ["--no-warmup"]))["warmup"] is False
    assert "applies to --target npu only" in check_engine_arguments(
        p.parse_args(["--spec", "s.yaml", "--weights", "w", "--warmup"]))


def _few_buckets_with_history():
    """hw_tiny_qwen3 (splitfuse kept) with decode batch 1/2 and prefill 128 tokens: two mixed cells."""
    from graphgen.modelspec.loader import parse_spec_text

    text = HW.read_text().replace("    compile_modes: [max-autotune]\n", "    compile_modes: [max-autotune]\n"
                                  "    decode_batch_buckets: [1, 2]\n    prefill_token_buckets: [128]\n")
    return parse_spec_text(text, "few_buckets_history.yaml")


def _serve_mixed(spec, capsys, cells: bool):
    """Warm up (with or without the mixed cells), then a prompt arriving while another decodes: its
    chunks run as mixed batches. Returns (graphs compiled while serving, mixed steps, warm-up lines)."""
    import torch

    from graphgen.npu.run.inputs import random_weights
    from graphgen.npu.run.mixed_grid import MixedGrid
    from graphgen.npu.run.engine import npu_engine

    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    with pytest.MonkeyPatch.context() as mp:
        if not cells:   # the negative control: warm-up as before this change (buckets only)
            mp.setattr(MixedGrid, "cell_steps", lambda self, block_size: [])
        with npu_engine(spec, dict(random_weights(spec, seed=1, scale=0.1)), num_blocks=16, standin=True,
                        warmup=True, max_num_batched_tokens=64) as e:
            started, llm = graphs["unique_graphs"], e.core
            llm.add_request("short", list(range(3, 20)), max_tokens=6)
            llm.step()
            llm.add_request("long", list(range(30, 130)), max_tokens=2)
            while llm.has_work():
                llm.step()
            later, mixed = graphs["unique_graphs"] - started, llm.stats()["mixed_steps"]
            count = e.runner.grid.count()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warm-up")]
    return later, mixed, lines, count


@pytest.mark.slow
def test_warmup_compiles_every_mixed_cell_so_mixed_batches_compile_nothing_while_serving(capsys):
    # issue 17 item 2 (no recompile storm): the mixed grid's cells are known up front, so warm-up
    # compiles them; without them a mixed batch compiles its cell mid-serving
    spec = _few_buckets_with_history()
    later, mixed, lines, count = _serve_mixed(spec, capsys, cells=True)
    cell_lines = [line for line in lines if "mixed cell" in line]
    assert count == 2 and len(cell_lines) == count and all("splitfuse mixed cell" in x for x in cell_lines)
    assert mixed >= 1 and later == 0, (mixed, later)
    later, mixed, lines, _ = _serve_mixed(spec, capsys, cells=False)
    assert not any("mixed cell" in line for line in lines) and mixed >= 1 and later > 0


def test_warmup_skips_the_mixed_cells_a_dp_runner_never_runs():
    """Audit 4 M5: under DP attention every call is padded to an agreed bucket (``runner.call_padding``), never
    to a mixed cell, so warming the cells compiled graphs (12 of 23 on the 2-node spec) nothing runs."""
    from types import SimpleNamespace

    from graphgen.npu.run.bucketing import Buckets
    from graphgen.npu.run.mixed_grid import MixedGrid
    from graphgen.npu.run.warmup import warmup_plans

    spec = _few_buckets_with_history()
    buckets = Buckets.from_spec(spec)
    mods = {v: SimpleNamespace(META={"phase": getattr(var.phase, "value", var.phase), "history": var.history})
            for v, var in spec.variants.items()}
    runner = SimpleNamespace(modules=mods, buckets=buckets, grid=MixedGrid.from_buckets(buckets), pad_block=0,
                             block_size=spec.kv_cache.block_size, call_padding=None)
    alone = warmup_plans(runner)
    cells = [p for p in alone if p[2] is not None]
    buckets_only = [p for p in alone if p[2] is None]
    assert len(cells) == runner.grid.count() >= 1  # the control: a single runner warms every cell
    runner.groups = SimpleNamespace(layout=SimpleNamespace(dp=1))  # a TP rank: runs cells
    assert warmup_plans(runner) == alone
    runner.groups = SimpleNamespace(layout=SimpleNamespace(dp=2))  # a DP rank before its seam is plugged in
    assert warmup_plans(runner) == buckets_only
    runner.groups, runner.call_padding = None, lambda phase, n_seqs, n_tokens: None  # the seam itself
    assert warmup_plans(runner) == buckets_only
