"""W8A8 weights at load (issue 28 item 2): the streaming loader quantizes each slice it reads into the int8
weight and its per-output-channel scales (graphgen.runtime.checkpoint.stream), the dict path quantizes the
built recipe (graphgen.runtime.core.weights.build_quantized_weight); both give the same tensors, for one
process and for a rank's slices (a row-parallel slice: one scale per output channel of the rank's inputs),
from a bf16 and from an FP8 checkpoint."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from graphgen.ir.quant import SCALE_SUFFIX
from graphgen.lower.compile import compile_variant
from graphgen.modelspec import model as m
from graphgen.modelspec.loader import load_spec
from graphgen.runtime.checkpoint.hf import load_hf_weights, write_random_hf_checkpoint
from graphgen.runtime.checkpoint.plan import RankSlicing
from graphgen.runtime.checkpoint.stream import CheckpointWeights
from graphgen.runtime.core.cpu_runtime import load_module
from graphgen.runtime.core.weights import place_weights
from graphgen.runtime.parallel.ops import rank_weights
from support.fp8 import to_fp8_checkpoint
from support.paths import TINY_DSV3, TINY_QWEN3


def _modules(spec):
    return [load_module(compile_variant(spec, v, "cpu"), f"<{v}>", f"w8a8_load.{spec.name}.{v}") for v in spec.variants]


@pytest.mark.parametrize("path,fp8", [(TINY_QWEN3, False), (TINY_DSV3, True)], ids=["qwen3_bf16", "deepseek_fp8"])
def test_streamed_w8a8_weights_equal_the_dict_paths(tmp_path, path, fp8):
    base = load_spec(path)
    spec = dataclasses.replace(base, quantization=m.Quantization(method="w8a8_dynamic"),
                               kv_cache=dataclasses.replace(base.kv_cache, dtype="bfloat16"))
    ckpt = write_random_hf_checkpoint(str(tmp_path / "src"), spec.family, dataclasses.asdict(spec.dims), seed=3,
                                      dtype=torch.bfloat16, tokenizer=False)
    if fp8:
        ckpt = str(to_fp8_checkpoint(ckpt, tmp_path / "fp8", (32, 32)))
    mods = _modules(spec)
    kw = dict(family=spec.family, dtype=torch.bfloat16, progress=lambda done, total: None)
    streamed = place_weights(CheckpointWeights.whole(ckpt, spec), mods, **kw)
    built = place_weights(load_hf_weights(ckpt, dtype=torch.bfloat16), mods, **kw)
    assert streamed.keys() == built.keys()
    scales = [k for k in streamed if k.endswith(SCALE_SUFFIX)]
    assert scales and all(streamed[k[:-len(SCALE_SUFFIX)]].dtype == torch.int8 for k in scales)
    for k in streamed:
        assert streamed[k].dtype == built[k].dtype and torch.equal(streamed[k], built[k]), k


def test_a_ranks_w8a8_slices_equal_its_dict_slices(tmp_path):
    """tp 2 of tiny Qwen3: column-parallel q/k/v and gate/up (output rows split), row-parallel o_proj and down
    (input columns split: each rank's scales are over its own inputs)."""
    from graphgen.passes.manager import run_pipeline
    from graphgen.ir.weights import graph_weight_names

    base = load_spec(TINY_QWEN3)
    spec = dataclasses.replace(base, quantization=m.Quantization(method="w8a8_dynamic")).with_overrides(tp=2)
    ckpt = write_random_hf_checkpoint(str(tmp_path / "src"), spec.family, dataclasses.asdict(spec.dims), seed=4,
                                      tokenizer=False)
    mods = _modules(spec)
    names = graph_weight_names(run_pipeline(spec, v) for v in spec.variants)
    full = load_hf_weights(ckpt)
    kw = dict(family=spec.family, dtype=torch.float32, progress=lambda done, total: None)
    for rank in range(2):
        streamed = place_weights(CheckpointWeights(ckpt, frozenset(names), RankSlicing(rank, 2)), mods, **kw)
        built = place_weights(rank_weights(full, names, rank, 2), mods, **kw)
        assert streamed.keys() == built.keys()
        for k in streamed:
            assert torch.equal(streamed[k], built[k]), (rank, k)
    o_scale = next(k for k in streamed if "o_proj" in k and k.endswith(SCALE_SUFFIX))
    assert streamed[o_scale].shape == (spec.dims.hidden_size,)  # every output channel, over this rank's inputs
