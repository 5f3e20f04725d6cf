"""``compile_module(cache_dir=..., buckets=N)``: one torchair compile-cache entry per shape bucket (audit 2,
row 9).  torchair's ``cache_compile`` keeps one compiled function per code object and drops the cache when that
code object compiles a second graph; the stand-in models that bookkeeping (``fakes.StandinCachedModel``, from
``air/inference/_cache_compiler.py``), not the serialised graph, so this shows the keying, not that GE
reloads a cache."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphgen.lower.compile import compile_variant
from graphgen.modelspec.loader import load_spec
from graphgen.npu.standin import fakes as standin

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


def _decode_steps(cache_dir, batches, per_bucket=True):
    """Run decode steps of the given batch sizes; returns the cache entries written under cache_dir."""
    import warnings

    import torch

    from graphgen.npu.run.bucketing import Buckets, bucketed_step
    from graphgen.npu.run.compile import StaticShapeForward, compile_module, load_module
    from graphgen.npu.run.inputs import ROPE_CACHE_KEY, kv_buffers, random_weights, rope_cache

    spec = load_spec(ROOT / "specs" / "tiny_qwen3_npu.yaml")
    buckets = Buckets.from_spec(spec)
    assert standin.install()
    try:
        torch._dynamo.reset()
        mod = load_module(Path("<tiny_qwen3_npu>/npu/max_autotune/decode.py"),
                          compile_variant(spec, "decode", "npu", mode="max-autotune"))
        if per_bucket:
            target, _ = compile_module(mod, use_standin=True, cache_dir=cache_dir, buckets=len(buckets.decode_batch))
        else:  # the old path: one cache_compile wrapper (one code object) for every bucket
            import torchair

            target = mod.Model()
            cfg = torchair.CompilerConfig()
            target.forward = StaticShapeForward(torchair.inference.cache_compile(
                target.forward, config=cfg, dynamic=True, cache_dir=str(cache_dir)))
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8)
        from graphgen.npu.run.weights import load_time_weights

        W = load_time_weights({k: t.to(torch.bfloat16) for k, t in random_weights(spec).items()}, [mod])
        W[ROPE_CACHE_KEY] = rope_cache(mod.ROPE, buckets.max_blocks * spec.kv_cache.block_size, dtype=torch.bfloat16)
        kv, staging = kv_buffers(mod, spec.dims.num_hidden_layers, 1 + 8 * buckets.max_blocks, staging_rows=0)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the modelled "Skip cache as ... recompiled"
            for i, n in enumerate(batches):
                b, _ = bucketed_step(mod, spec, buckets, [(5 + j, 1) for j in range(n)], seed=i)
                target.forward(W, b, kv, staging)
    finally:
        torch._dynamo.reset()
        standin.uninstall()
    return sorted(p.parent.name for p in Path(cache_dir).rglob("compiled_module"))


def test_two_buckets_get_two_cache_entries(tmp_path):
    entries = _decode_steps(tmp_path, [1, 3, 1])  # buckets 1, 4, 1 (decode buckets 1/2/4/8)
    assert entries == ["forward_bucket_b1_t1", "forward_bucket_b4_t4"]


def test_one_wrapper_for_every_bucket_loses_its_cache(tmp_path):
    """Negative control: the old single wrapper compiles a second graph from the same code object, and
    torchair's cache_compile (as modelled) drops the entry -- or, had a process seen one bucket only, a later
    process would load that one unguarded graph for every bucket."""
    assert _decode_steps(tmp_path, [1, 3], per_bucket=False) == []
