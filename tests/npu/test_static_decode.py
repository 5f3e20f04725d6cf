"""Decode as a static GE graph (issue 15 item 5, docs/npu.md "Decode as a static graph"): the decided mode
is GE with the tiling sunk (tiling_schedule_optimize=True), which the FIA docs forbid for TND attention
(_op_plugin_docs.py:8113-8114, :8632-8633, :8737).  The stand-in refuses what that mode forbids: the
shipped decode modules (TND today) fail under it naming the row; without the sink they trace.  CPU
stand-in only: nothing here shows what GE does."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphgen.lower.compile import compile_variant
from graphgen.modelspec.loader import load_spec
from graphgen.npu.check.limits import KernelLimitError
from graphgen.npu.standin import fakes as standin

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


def _decode(tiling_sink, mode="max-autotune"):
    import torch

    from graphgen.npu.check.structure import NUM_BLOCKS, SAMPLE_SEQS
    from graphgen.npu.run.compile import compile_module, load_module
    from graphgen.npu.run.inputs import kv_buffers, random_weights, tiny_step

    spec = load_spec(ROOT / "specs" / "tiny_qwen3_npu.yaml")
    assert standin.install()
    try:
        mod = load_module(Path("<tiny_qwen3_npu>/npu/max_autotune/decode.py"), compile_variant(spec, "decode", "npu", mode=mode))
        target, _ = compile_module(mod, mode, use_standin=True, tiling_sink=tiling_sink)
        b = tiny_step(mod, spec, SAMPLE_SEQS[("decode", False)], NUM_BLOCKS)
        kv, staging = kv_buffers(mod, spec.dims.num_hidden_layers, NUM_BLOCKS, staging_rows=0)
        from graphgen.npu.run.weights import load_time_weights

        W = load_time_weights({k: t.to(torch.bfloat16) for k, t in random_weights(spec, rope=mod.ROPE).items()}, [mod])
        torch._dynamo.reset()
        with torch.no_grad():
            return target.forward(W, b, kv, staging)
    finally:
        torch._dynamo.reset()
        standin.uninstall()


def test_tnd_decode_is_refused_under_tiling_sink_and_traces_without():
    assert _decode(False).shape[0] == 2
    with pytest.raises(Exception) as e:
        _decode(True)
    cause = e.value
    while cause is not None and not isinstance(cause, KernelLimitError):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None and "[fia.tnd.tiling_sink]" in str(cause) and "8113-8114" in str(cause), e.value


def test_tiling_sink_is_a_ge_option():
    with pytest.raises(ValueError, match="max-autotune"):
        _decode(True, mode="reduce-overhead")
