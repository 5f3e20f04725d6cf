"""Decode as a static GE graph (issue 15 item 5, docs/npu.md "Decode as a static graph"): decode modules
declare TILING_SINK = True (compile_module sets tiling_schedule_optimize) and call
npu_fused_infer_attention_score_v2 in BSH (Qwen3, GQA) / BNSD (DeepSeek MLA, absorbed) with every shape static
per batch bucket; the FIA docs forbid TND under tiling sink (_op_plugin_docs.py:8113-8114, :8632-8633, :8737)
and the stand-in refuses it.  CPU stand-in only: the stand-in's v2 kernel was written from the same doc
reading as the emitters (wiring, not meaning), and nothing here shows what GE builds."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphgen.lower.compile import compile_variant
from graphgen.modelspec.loader import load_spec
from graphgen.npu.check.aotcheck import check_static_graph
from graphgen.npu.check.limits import KernelLimitError
from graphgen.npu.standin import fakes as standin

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")


def _run(spec_name, variant="decode", mode="max-autotune", **compile_kw):
    """Compile the variant through the stand-in, run one sample step; returns (module, backend, logits)."""
    import torch

    from graphgen.npu.run.structure import NUM_BLOCKS, SAMPLE_SEQS
    from graphgen.npu.run.compile import compile_module, load_module
    from graphgen.npu.run.inputs import kv_buffers, random_weights, tiny_step

    spec = load_spec(ROOT / "specs" / f"{spec_name}.yaml")
    assert standin.install()
    try:
        src = compile_variant(spec, variant, "npu", mode=mode)
        mod = load_module(Path(f"<{spec_name}>/npu/{mode}/{variant}.py"), src)
        target, backend = compile_module(mod, mode, use_standin=True, **compile_kw)
        phase = mod.META["phase"]
        b = tiny_step(mod, spec, SAMPLE_SEQS[(phase, bool(mod.META["history"]))], NUM_BLOCKS)
        kv, staging = kv_buffers(mod, spec.dims.num_hidden_layers, NUM_BLOCKS,
                                 staging_rows=8 if mod.META["saves"] else 0)
        from graphgen.npu.run.weights import load_time_weights

        W = load_time_weights({k: t.to(torch.bfloat16) for k, t in random_weights(spec, rope=mod.ROPE).items()},
                              [mod])
        torch._dynamo.reset()
        with torch.no_grad():
            mod.load(b, kv, ())
            return mod, backend, target.forward(W, b, kv, staging)
    finally:
        torch._dynamo.reset()
        standin.uninstall()


def _limit_error(e):
    cause = e
    while cause is not None and not isinstance(cause, KernelLimitError):
        cause = cause.__cause__ or cause.__context__
    return cause


@pytest.mark.parametrize("spec_name,layout", [("tiny_qwen3_npu", "BSH"), ("tiny_deepseek_v3_npu", "BNSD")])
def test_decode_compiles_as_one_static_tiling_sunk_graph(spec_name, layout):
    mod, backend, logits = _run(spec_name, buckets=4)  # tiling_sink=None: the module's TILING_SINK
    assert mod.TILING_SINK is True and backend.config.experimental_config.tiling_schedule_optimize is True
    assert logits.shape[0] == 2 and len(backend.graphs) == 1
    gm = backend.graphs[0].gm
    fia = [n for n in gm.graph.nodes if "fused_infer_attention_score" in str(n.target)]
    assert fia and {str(n.target) for n in fia} == {"npu.npu_fused_infer_attention_score_v2.default"}
    assert {n.kwargs.get("input_layout", "BSH") for n in fia} == {layout}  # AOT drops a default-valued kwarg
    assert check_static_graph(gm, "decode") == []


def test_static_graph_check_fails_on_symbolic_shapes():
    """Negative control: the same decode compiled dynamic without mark_static (no buckets) has symbolic
    tensor dimensions, which a static GE graph cannot have."""
    _, backend, _ = _run("tiny_qwen3_npu", dynamic=True)
    problems = check_static_graph(backend.graphs[0].gm, "decode")
    assert any("symbolic shape" in p for p in problems), problems


def test_tnd_attention_is_refused_under_tiling_sink():
    """What the chosen mode forbids: the TND prefill module (host tiling, path 3) forced under tiling sink."""
    mod, _, _ = _run("tiny_qwen3_npu", "mempool_prefill", tiling_sink=False)
    assert mod.TILING_SINK is False
    with pytest.raises(Exception) as e:
        _run("tiny_qwen3_npu", "mempool_prefill", tiling_sink=True)
    cause = _limit_error(e.value)
    assert cause is not None and "[fia.tnd.tiling_sink]" in str(cause) and "8113-8114" in str(cause), e.value


def test_tiling_sink_is_a_ge_option():
    with pytest.raises(ValueError, match="max-autotune"):
        _run("tiny_qwen3_npu", mode="reduce-overhead", tiling_sink=True)
