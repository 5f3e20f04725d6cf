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
    from graphgen.npu.run.runner import npu_engine

    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    with npu_engine(spec, dict(random_weights(spec, seed=1, scale=0.1)), num_blocks=16, standin=True, **kw) as e:
        started = graphs["unique_graphs"]
        tokens = [r.tokens for r in e.generate(PROMPTS, 3)]
        later = graphs["unique_graphs"] - started
    return tokens, later, [line for line in capsys.readouterr().err.splitlines() if line.startswith("warm-up")]


def test_warmup_compiles_every_bucket_at_start_and_is_off_by_default_with_the_standin(capsys):
    spec = _few_buckets_spec()
    warm, later, lines = _generate(spec, capsys, warmup=True)
    assert [line.split(": ", 1)[1] for line in lines] == [
        "decode bucket batch=1 tokens=1 compiled", "decode bucket batch=2 tokens=2 compiled",
        "mempool_prefill bucket batch=3 tokens=128 compiled"]
    assert lines[0].startswith("warm-up 1/3") and later == 0  # serving compiled nothing more
    cold, later_cold, lines_cold = _generate(spec, capsys)  # default with standin: no warm-up
    assert lines_cold == [] and later_cold > 0
    assert warm == cold  # the warm-up writes only the pad block: the same tokens


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
