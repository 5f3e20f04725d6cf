"""The NPU helpers (graphgen/lower/npu_helpers.py) as a real module, and how they are inlined.

Numerics: each helper runs on CPU through graphgen's NPU stand-in kernels (written from the torch-npu
docs, independently of graphgen.runtime.core.ops) and is compared with the CPU reference ops. This proves
the helpers wire the kernels the way the reference computes, under the stand-in's reading of the
kernels -- not NPU behaviour.
"""

import ast
import py_compile

import pytest

from graphgen.lower import npu
from graphgen.lower.compile import npu_options, render_graph
from graphgen.modelspec.loader import load_spec
from graphgen.passes.manager import run_pipeline

from support.paths import REPO


def test_helpers_file_compiles_and_uses_only_names_a_generated_module_has():
    import builtins

    py_compile.compile(str(npu.HELPERS_FILE), doraise=True)
    tree = ast.parse(npu.HELPERS_FILE.read_text())
    helpers = {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}
    module_names = {"torch", "F", "torch_npu", "torchair"} | helpers
    for f in tree.body:
        if not isinstance(f, ast.FunctionDef):
            continue
        local = {a.arg for a in ast.walk(f) if isinstance(a, ast.arg)}
        local |= {t.id for t in ast.walk(f) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
        free = {x.id for x in ast.walk(f) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Load)}
        assert free - local - module_names - set(dir(builtins)) == set(), f.name


@pytest.mark.parametrize("name", ["tiny_qwen3_npu", "tiny_deepseek_v3_npu"])
def test_generated_module_inlines_exactly_the_helpers_it_calls_verbatim(name):
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    src = render_graph(run_pipeline(spec, "mempool_prefill"), "npu", npu_options(spec.targets.npu, "max-autotune"))
    sources = npu.helper_sources()
    defined = {f.name for f in ast.parse(src).body if isinstance(f, ast.FunctionDef) and f.name in sources}
    for h in defined:
        assert sources[h][0] in src  # verbatim
    called = {c.func.id for c in ast.walk(ast.parse(src)) if isinstance(c, ast.Call) and
              isinstance(c.func, ast.Name) and c.func.id in sources}
    assert defined == called  # nothing unused, nothing missing
    # mempool_prefill: MLA un-absorbed (no _mla_attention_absorbed, no history gather _paged_rows)
    want = {"tiny_qwen3_npu": {"_qwen3_attn_prolog", "_swiglu_mlp", "_linear"},
            "tiny_deepseek_v3_npu": {"_swiglu_mlp", "_interleaved_rope", "_mla_prolog", "_mla_prefill",
                                     "_mla_unabsorbed", "_moe_residual", "_linear", "_grouped_linear"}}[name]
    assert defined == want


import torch


@pytest.fixture(scope="module")
def helpers():
    import importlib
    import sys

    from graphgen.npu.standin import fakes as standin

    if standin.torch_npu_available():
        pytest.skip("real torch_npu installed; stand-in not used")
    standin.install()
    sys.modules.pop("graphgen.lower.npu_helpers", None)
    # These tests compare the helpers' algebra with the runtime ops at small float32 shapes, which the
    # documented kernel limits reject (head dim 16, fp32); the limits have their own tests (tests/npu).
    with standin.enforce_limits(False):
        yield importlib.import_module("graphgen.lower.npu_helpers")
    sys.modules.pop("graphgen.lower.npu_helpers", None)
    standin.uninstall()


def _cos_sin(t, r, interleave=False):
    from graphgen.runtime.core import ops
    return ops.rope_cos_sin(torch.arange(t), rot_dim=r, theta=10000.0, scaling=None)


def test_qwen3_attn_prolog_matches_reference(helpers):
    from graphgen.runtime.core import ops
    torch.manual_seed(0)
    t, h, kvh, d = 5, 4, 2, 16
    x = torch.randn(t, 32)
    ws = [torch.randn(h * d, 32), torch.randn(kvh * d, 32), torch.randn(kvh * d, 32), torch.rand(d) + .5,
          torch.rand(d) + .5]
    cos, sin = _cos_sin(t, d)
    kw = dict(num_heads=h, num_kv_heads=kvh, head_dim=d, eps=1e-6)
    from graphgen.npu.run.weights import build_load_time_weight

    qkv = build_load_time_weight(ws[:3], dim=0, transpose12=False)  # merged at load, as the runner does
    got = helpers._qwen3_attn_prolog(x, qkv, *ws[3:], cos, sin, **kw)
    qkv_t = build_load_time_weight(ws[:3], dim=0, transpose12=False, transpose01=True)  # the CPU layout
    want = ops.qwen3_attn_prolog(x, qkv_t, *ws[3:], cos, sin, **kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q_lora", [True, False])
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_prolog_matches_reference_with_and_without_q_lora(helpers, q_lora, interleave):
    from graphgen.runtime.core import ops
    torch.manual_seed(1)
    t, h, n, r, rank, qrank, hid = 3, 2, 16, 8, 12, 10, 24
    x = torch.randn(t, hid)
    w_q_a = torch.randn(qrank, hid) if q_lora else None
    w_q_a_norm = torch.rand(qrank) + .5 if q_lora else None
    w_q_b = torch.randn(h * (n + r), qrank if q_lora else hid)
    w_kv_a, w_kv_a_norm = torch.randn(rank + r, hid), torch.rand(rank) + .5
    cos, sin = _cos_sin(t, r)
    kw = dict(num_heads=h, qk_nope_head_dim=n, qk_rope_head_dim=r, kv_lora_rank=rank, eps=1e-6,
              interleave=interleave)
    got = helpers._mla_prolog(x, w_q_a, w_q_a_norm, w_q_b, w_kv_a, w_kv_a_norm, cos, sin, **kw)
    want = ops.mla_prolog(x, w_q_a, w_q_a_norm, w_q_b, w_kv_a, w_kv_a_norm, cos, sin, **kw)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_swiglu_mlp_matches_reference(helpers):
    from graphgen.runtime.core import ops
    torch.manual_seed(2)
    x, wg, wu, wd = torch.randn(4, 8), torch.randn(12, 8), torch.randn(12, 8), torch.randn(8, 12)
    res = torch.randn(4, 8)
    from graphgen.npu.run.weights import build_load_time_weight

    gate_up = build_load_time_weight([wg, wu], dim=0, transpose12=False)
    cpu = ops.swiglu_mlp_residual(x, build_load_time_weight([wg, wu], dim=0, transpose12=False, transpose01=True),
                                  wd.t().contiguous(), res)  # the CPU layout: [in, out]
    torch.testing.assert_close(res + helpers._swiglu_mlp(x, gate_up, wd), cpu, rtol=1e-4, atol=1e-4)


def test_moe_residual_with_load_time_expert_layouts_matches_reference(helpers):
    """Experts merged and pre-transposed at load ([E, H, 2I], [E, I, H]), shared gate/up merged; router
    and bias float32: the stand-in's MoE kernels (our reading of the docs) against the CPU MoE."""
    from graphgen.npu.run.weights import build_load_time_weight
    from graphgen.runtime.core import ops

    torch.manual_seed(3)
    t, hid, inter, e = 5, 16, 8, 8
    x, res = torch.randn(t, hid), torch.randn(t, hid)
    router, bias = torch.randn(e, hid), torch.randn(e) * 0.1
    eg, eu, ed = torch.randn(e, inter, hid), torch.randn(e, inter, hid), torch.randn(e, hid, inter)
    sg, su, sd = torch.randn(inter, hid), torch.randn(inter, hid), torch.randn(hid, inter)
    kw = dict(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    gate_up_t = build_load_time_weight([eg, eu], dim=1, transpose12=True)
    down_t = build_load_time_weight([ed], dim=0, transpose12=True)
    assert gate_up_t.shape == (e, hid, 2 * inter) and gate_up_t.is_contiguous() and down_t.shape == (e, inter, hid)
    got = helpers._moe_residual(x, router, bias, gate_up_t, down_t, build_load_time_weight([sg, su], dim=0,
                                transpose12=False), sd, res, num_experts=e, **kw)
    want = ops.moe_residual(x, router, bias, eg, eu, ed, sg, su, sd, res, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_expert_parallel_moe_partials_sum_to_the_reference_moe(helpers):
    """ep=4: each rank's _moe_residual(ep=4, ep_rank=r) over its 2 of 8 experts and its width slice of the
    shared expert (a partial sum, zero residual), summed over the ranks (what the MoE's reduce-scatter
    sums), equals the CPU MoE on the whole weights. The stand-in leaves the rows routed to other ranks'
    experts NaN (undefined, _op_plugin_docs.py:11107), so an unmasked read would show here."""
    from graphgen.npu.run.weights import build_load_time_weight
    from graphgen.runtime.core import ops

    torch.manual_seed(4)
    t, hid, inter, e, ep = 6, 16, 8, 8, 4
    x, res = torch.randn(t, hid), torch.randn(t, hid)
    router, bias = torch.randn(e, hid), torch.randn(e) * 0.1
    eg, eu, ed = torch.randn(e, inter, hid), torch.randn(e, inter, hid), torch.randn(e, hid, inter)
    sg, su, sd = torch.randn(inter, hid), torch.randn(inter, hid), torch.randn(hid, inter)
    kw = dict(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    local, width = e // ep, inter // ep
    total = res.clone()
    for r in range(ep):
        ex = slice(r * local, (r + 1) * local)
        sw = slice(r * width, (r + 1) * width)
        gate_up_t = build_load_time_weight([eg[ex], eu[ex]], dim=1, transpose12=True)
        down_t = build_load_time_weight([ed[ex]], dim=0, transpose12=True)
        shared_gate_up = build_load_time_weight([sg[sw], su[sw]], dim=0, transpose12=False)
        part = helpers._moe_residual(x, router, bias, gate_up_t, down_t, shared_gate_up, sd[:, sw],
                                     torch.zeros_like(x), num_experts=e, ep=ep, ep_rank=r, **kw)
        assert torch.isfinite(part).all()
        total = total + part
    want = ops.moe_residual(x, router, bias, eg, eu, ed, sg, su, sd, res, **kw)
    torch.testing.assert_close(total, want, rtol=1e-4, atol=1e-4)
    # not vacuous: the grouped matmul's rows past this rank's pairs are NaN in the stand-in
    ids = torch.randint(0, e, (t, 2), dtype=torch.int32)
    mine = ids < local
    sorted_ids = torch.sort(torch.where(mine, ids, torch.full_like(ids, local)).reshape(-1)).values.int()
    ends = torch.ops.npu.npu_moe_compute_expert_tokens(sorted_ids, local + 1)[:local].long()
    out = torch.ops.npu.npu_grouped_matmul([torch.randn(2 * t, hid)], [torch.randn(local, hid, 4)], group_list=ends,
                                           group_list_type=0, group_type=0, split_item=2)[0]
    assert int(ends[-1]) == int(mine.sum()) < 2 * t and torch.isnan(out[int(ends[-1]):]).all()
