"""The kernels' documented limits (graphgen.npu.check.limits) as the CPU stand-in enforces them.

Each row: a conforming call runs, the same call with ONE argument moved outside the row's limit raises
KernelLimitError naming that row and its source.  The calls go through torch.ops.npu (the registered
stand-in ops), so this proves the table is wired into the kernels, not just that the predicates work.
The limits are the docs' words as we read them; nothing here shows the real kernels enforce them.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import torch

from graphgen.npu.check import limits  # noqa: E402
from graphgen.npu.standin import oplib, fakes as standin

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(standin.torch_npu_available(), reason="real torch_npu installed; stand-in not used")
BF = torch.bfloat16
MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)


@pytest.fixture(scope="module", autouse=True)
def _installed():
    assert standin.install()


def fia_gqa(q_lens=(2, 1), bs=128, dtype=BF, d=128, mode=3):
    t = sum(q_lens)
    cum = [sum(q_lens[:i + 1]) for i in range(len(q_lens))]
    return ("npu_fused_infer_attention_score",
            (torch.randn(t, 4, d, dtype=dtype), torch.randn(4, bs, 2 * d, dtype=dtype), torch.randn(4, bs, 2 * d, dtype=dtype)),
            dict(atten_mask=MASK if mode == 3 else None, actual_seq_lengths=cum, actual_seq_lengths_kv=[q + 3 for q in q_lens],
                 block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)[:len(q_lens)], num_heads=4,
                 num_key_value_heads=2, scale=0.1, input_layout="TND", sparse_mode=mode, block_size=bs))


def fia_mla(q_lens=(1, 1), heads=32, d=512, rope=64, bs=128):
    t = sum(q_lens)
    cum = [sum(q_lens[:i + 1]) for i in range(len(q_lens))]
    ckv = torch.randn(4, bs, d, dtype=BF)
    multi = any(q > 1 for q in q_lens)
    return ("npu_fused_infer_attention_score", (torch.randn(t, heads, d, dtype=BF), ckv, ckv),
            dict(query_rope=torch.randn(t, heads, rope, dtype=BF), key_rope=torch.randn(4, bs, rope, dtype=BF),
                 atten_mask=MASK if multi else None, actual_seq_lengths=cum,
                 actual_seq_lengths_kv=[q + 2 for q in q_lens],
                 block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)[:len(q_lens)], num_heads=heads,
                 num_key_value_heads=1, scale=0.1, input_layout="TND", sparse_mode=3 if multi else 0, block_size=bs))


def fia2_gqa(b=2, heads=4, kv_heads=2, d=128, bs=128, dtype=BF, layout="BSH", cache4=False, cols=2, device="cpu"):
    """The static decode graph's v2 call: BSH (B, 1, N*D) query over a (blocknum, blocksize, KV_N*D) cache."""
    q = torch.randn(b, 1, heads * d, dtype=dtype, device=device) if layout == "BSH" else \
        torch.randn(b, heads, 1, d, dtype=dtype, device=device)
    kv = torch.randn(4, kv_heads, bs, d, dtype=dtype, device=device) if cache4 else \
        torch.randn(4, bs, kv_heads * d, dtype=dtype, device=device)
    return ("npu_fused_infer_attention_score_v2", (q, kv, kv),
            dict(actual_seq_kvlen=[3] * b, block_table=torch.zeros(b, cols, dtype=torch.int32, device=device),
                 num_query_heads=heads, num_key_value_heads=kv_heads, softmax_scale=0.1, input_layout=layout,
                 sparse_mode=0, block_size=bs))


def fia2_mla(heads=32, d=512, rope=64, bs=128, mask=None):
    """The absorbed MLA decode: BNSD (B, N, 1, 512) with query_rope over the latent cache (NB, 1, BS, 512)."""
    ckv = torch.randn(4, 1, bs, d, dtype=BF)
    return ("npu_fused_infer_attention_score_v2", (torch.randn(2, heads, 1, d, dtype=BF), ckv, ckv),
            dict(query_rope=torch.randn(2, heads, 1, rope, dtype=BF), key_rope=torch.randn(4, 1, bs, rope, dtype=BF),
                 atten_mask=mask, actual_seq_kvlen=[3, 5], block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                 num_query_heads=heads, num_key_value_heads=1, softmax_scale=0.1, input_layout="BNSD", sparse_mode=0,
                 block_size=bs))


def fia2_tnd():
    """A v2 TND call (the form vllm-ascend uses for multi-token decode): refused only under tiling sink."""
    t = fia2_gqa()
    return (t[0], (torch.randn(2, 4, 128, dtype=BF),) + t[1][1:], {**t[2], "input_layout": "TND"})


def fia_dense(dtype=BF, qk=192, v=128, kv_heads=None, heads=8, t=3, seqs=1, device="cpu"):
    """The non-paged TND form (DeepSeek prefill/splitfuse on up-projected K/V).  ``device="meta"`` for
    the calls too large to allocate (the limit check runs before the kernel, on meta tensors too)."""
    kv_heads = heads if kv_heads is None else kv_heads
    q_cum = [t] if seqs == 1 else list(range(1, seqs + 1))
    return ("npu_fused_infer_attention_score",
            (torch.randn(t, heads, qk, dtype=dtype, device=device),
             torch.randn(t + 2, kv_heads, qk, dtype=dtype, device=device),
             torch.randn(t + 2, kv_heads, v, dtype=dtype, device=device)),
            dict(atten_mask=MASK.to(device), actual_seq_lengths=q_cum,
                 actual_seq_lengths_kv=[x + 2 for x in q_cum] if seqs == 1 else q_cum[:-1] + [t + 2],
                 num_heads=heads, num_key_value_heads=kv_heads, scale=0.1, input_layout="TND", sparse_mode=3))


def rope(d=128, cos_dtype=BF):
    return ("npu_apply_rotary_pos_emb", (torch.randn(1, 3, 4, d, dtype=BF), torch.randn(1, 3, 2, d, dtype=BF),
                                         torch.randn(1, 3, 1, d, dtype=cos_dtype), torch.randn(1, 3, 1, d, dtype=cos_dtype)),
            dict(layout="BSND", rotary_mode="half"))


def irope(d=64, dtype=BF, cos_dtype=BF):
    return ("npu_interleave_rope", (torch.randn(3, 2, 1, d, dtype=dtype), torch.randn(3, 1, 1, d, dtype=cos_dtype),
                                    torch.randn(3, 1, 1, d, dtype=cos_dtype)), {})


def rms(gamma_dtype=BF):
    return ("npu_rms_norm", (torch.randn(3, 8, dtype=BF), torch.ones(8, dtype=gamma_dtype), 1e-6), {})


def scatter(idx_dtype=torch.int64, rows=3):
    return ("npu_scatter_nd_update", (torch.zeros(4, 8, 6, dtype=BF), torch.tensor([[0, 1], [2, 3], [3, 7]], dtype=idx_dtype),
                                      torch.randn(rows, 6, dtype=BF)), {})


def gating(bias_dtype=torch.float32, k=8, groups=8, k_group=4):
    return ("npu_moe_gating_top_k", (torch.randn(3, 256), k),
            dict(bias=torch.randn(256, dtype=bias_dtype), k_group=k_group, group_count=groups, group_select_mode=1,
                 renorm=0, norm_type=1, routed_scaling_factor=1.0, eps=1e-20))


def finalize(mode=0, idx_dtype=torch.int32, skip1=False):
    rows = torch.randn(6, 8)
    return ("npu_moe_finalize_routing", (rows, torch.randn(3, 8) if skip1 else None, None, None, torch.rand(3, 2),
                                         torch.arange(6, dtype=idx_dtype), torch.zeros(3, 2, dtype=torch.int32), mode), {})


def init_routing(ids_dtype=torch.int32):
    return ("npu_moe_init_routing", (torch.randn(3, 8, dtype=BF), torch.arange(6, dtype=torch.int32).view(2, 3).t(),
                                     torch.randint(0, 4, (3, 2), dtype=ids_dtype), 3), {})


def expert_tokens(num_expert=4):
    return ("npu_moe_compute_expert_tokens", (torch.tensor([0, 0, 1, 3, 3, 3], dtype=torch.int32), num_expert), {})


def dquant(dtype=BF, dims=2):
    return ("npu_dynamic_quant", (torch.randn(*([3] * (dims - 1)), 8, dtype=dtype),), {})


def qmm(x2_dtype=torch.int8, scale_dtype=BF, out=BF, k=8, n=4, tokens=2):
    """The W8A8 linear's call (graphgen/lower/npu_helpers.py _linear): int8 [m, k] x int8 [k, n], per-token."""
    return ("npu_quant_matmul", (torch.randint(-8, 8, (2, k), dtype=torch.int8),
                                 torch.randint(-8, 8, (k, n), dtype=torch.int8).to(x2_dtype),
                                 torch.rand(n).to(scale_dtype)),
            dict(pertoken_scale=torch.rand(tokens), output_dtype=out))


def gmm(scale_shape=(2, 4), group_list_dtype=torch.int64, k=8, device="cpu"):
    """The W8A8 experts' call (npu_helpers _grouped_linear): per-token quantized grouped matmul."""
    return ("npu_grouped_matmul", ([torch.randint(-8, 8, (3, k), dtype=torch.int8, device=device)],
                                   [torch.randint(-8, 8, (2, k, 4), dtype=torch.int8, device=device)]),
            dict(scale=[torch.rand(*scale_shape, device=device).to(BF)], per_token_scale=[torch.rand(3, device=device)],
                 group_list=torch.tensor([1, 3], device=device).to(group_list_dtype), group_list_type=0, group_type=0,
                 split_item=2, output_dtype=BF))


def unpermute(dtype=BF, idx_dtype=torch.int32, padded=False):
    return ("npu_moe_token_unpermute", (torch.randn(6, 8, dtype=dtype), torch.randperm(6).to(idx_dtype)),
            dict(probs=torch.rand(3, 2).to(dtype), padded_mode=padded))


def routing(lo=8, hi=16, experts=32):
    return ("npu_moe_init_routing_v2", (torch.randn(3, 8, dtype=BF), torch.randint(0, experts, (3, 2), dtype=torch.int32)),
            dict(active_num=6, expert_num=experts, expert_tokens_num_type=1, expert_tokens_num_flag=True,
                 active_expert_range=[lo, hi], quant_mode=-1))


def _call(c, mode=None):
    op, args, kw = c
    sink = mode == "tiling-sink"  # max-autotune with experimental_config.tiling_schedule_optimize=True
    with oplib.tracing_mode("max-autotune" if sink else mode, sink):
        return getattr(torch.ops.npu, op)(*args, **kw)


# row key -> (conforming call, violating call[, compile mode])
CASES = {
    "fia.dtype": (fia_gqa(), fia_gqa(dtype=torch.float32)),
    "fia.pa.block_size": (fia_gqa(), fia_gqa(bs=64)),
    "fia.sparse3.mask": (fia_gqa(), fia_gqa()[:2] + ({**fia_gqa()[2], "atten_mask": MASK[:1024, :1024]},)),
    "fia.mla.query_len": (fia_mla(q_lens=(16, 1)), fia_mla(q_lens=(17, 1))),
    "fia.mla.num_heads": (fia_mla(), fia_mla(heads=16)),
    "fia.mla.latent_dim": (fia_mla(), fia_mla(d=256)),
    "fia.mla.rope_dim": (fia_mla(), fia_mla(rope=32)),
    "fia.mla.block_size": (fia_mla(bs=16), fia_mla(bs=64)),
    "fia.tnd.reduce_overhead": ((fia_mla(), "reduce-overhead"), (fia_gqa(), "reduce-overhead")),
    "fia.dense.dtype": (fia_dense(), fia_dense(dtype=torch.float16)),
    "fia.dense.head_dims": (fia_dense(), fia_dense(qk=128)),
    "fia.dense.heads": (fia_dense(), fia_dense(kv_heads=2)),
    "fia.dense.head_count": (fia_dense(heads=8), fia_dense(heads=4)),  # DeepSeek-V3 at tp=32, unpadded
    "fia.dense.tokens": (fia_dense(), fia_dense(t=65537, device="meta")),
    "fia.tnd.sequences": (fia_dense(t=4096, seqs=4096, device="meta"), fia_dense(t=4097, seqs=4097, device="meta")),
    "fia.tnd.tiling_sink": (fia_gqa(), (fia_gqa(), "tiling-sink")),
    "fia2.dtype": (fia2_gqa(), fia2_gqa(dtype=torch.float32)),
    "fia2.tnd.tiling_sink": ((fia2_gqa(), "tiling-sink"), (fia2_tnd(), "tiling-sink")),
    "fia2.decode.dims": (fia2_gqa(), fia2_gqa(b=65537, heads=1, kv_heads=1, d=16, bs=16, cols=1, device="meta")),
    "fia2.gqa.ratio": (fia2_gqa(heads=64, kv_heads=1, d=16), fia2_gqa(heads=65, kv_heads=1, d=16)),
    "fia2.pa.bsh_cache": ((fia2_gqa(layout="BNSD", cache4=True)), fia2_gqa(cache4=True)),
    "fia2.mla.heads": (fia2_mla(heads=4), fia2_mla(heads=6)),
    "fia2.mla.block_size": (fia2_mla(bs=16), fia2_mla(bs=64)),
    "fia2.mla.sparse": (fia2_mla(), fia2_mla(mask=MASK)),
    "rope.head_dim": (rope(), rope(d=32)),
    "rope.same_dtype": (rope(), rope(cos_dtype=torch.float32)),
    "interleave_rope.dim": (irope(), irope(d=32)),
    "interleave_rope.dtype": (irope(), irope(cos_dtype=torch.float32)),
    "rms_norm.gamma_dtype": (rms(), rms(gamma_dtype=torch.float32)),
    "scatter_nd_update.indices": (scatter(), scatter(idx_dtype=torch.int16)),
    "scatter_nd_update.updates_shape": (scatter(), scatter(rows=2)),
    "moe_gating.bias_dtype": (gating(), gating(bias_dtype=BF)),
    "moe_gating.groups": (gating(), gating(groups=7)),
    "moe_gating.k_max": (gating(k=32, k_group=8), gating(k=33, k_group=8)),
    "moe_finalize.drop_pad_mode": (finalize(0), finalize(2)),
    "moe_finalize.shapes": (finalize(), finalize(idx_dtype=torch.int64)),
    "moe_init_routing.shapes": (init_routing(), init_routing(ids_dtype=torch.int64)),
    "moe_expert_tokens.input": (expert_tokens(2048), expert_tokens(2049)),
    "moe_routing.dropless": (routing(), routing(lo=16, hi=40)),  # an expert range past expert_num
    "moe_unpermute.dtype": (unpermute(), unpermute(dtype=torch.float16)),
    "moe_unpermute.shape": (unpermute(), unpermute(padded=True)),
    "quant.dynamic.input": (dquant(), dquant(dtype=torch.float32)),
    "quant.matmul.dtypes": (qmm(), qmm(scale_dtype=BF, out=torch.float16)),  # fp16 output takes a float32 scale
    "quant.matmul.shapes": (qmm(), qmm(tokens=3)),
    "gmm.per_token": (gmm(), gmm(scale_shape=(4,))),  # a 1-D scale for a stacked [E, K, N] weight
    "gmm.inner_limit": (gmm(device="meta"), gmm(k=65536, device="meta")),
    "gmm.group_list": (gmm(), gmm(group_list_dtype=torch.int32)),
}


def test_every_row_has_a_case():
    assert set(CASES) == {r.key for r in limits.LIMITS}


@pytest.mark.parametrize("key", sorted(CASES))
def test_row_rejects_the_violating_call_and_passes_the_conforming_one(key):
    good, bad = CASES[key]
    good, gmode = good if isinstance(good[1], str) else (good, None)
    bad, bmode = bad if isinstance(bad[1], str) else (bad, None)
    _call(good, gmode)
    row = limits.BY_KEY[key]
    with pytest.raises(limits.KernelLimitError) as e:
        _call(bad, bmode)
    assert f"[{key}]" in str(e.value) and row.source in str(e.value)


def test_limits_checked_on_meta_tensors_too():
    """The check runs while Dynamo/AOT trace (fake/meta tensors), not only when the CPU kernel runs."""
    op, args, kw = rope(d=32)
    with pytest.raises(limits.KernelLimitError, match="rope.head_dim"):
        torch.ops.npu.npu_apply_rotary_pos_emb(*(a.to("meta") for a in args), **kw)


def test_enforce_limits_off_is_explicit():
    with oplib.enforce_limits(False):
        _call(rope(d=32))
    with pytest.raises(limits.KernelLimitError):
        _call(rope(d=32))


def test_absorbed_mla_decode_helper_runs_inside_the_v2_limits_at_tp32_heads():
    """The absorbed MLA decode helper (v2, BNSD) with the hardware-shaped tiny DeepSeek's dims (latent 512,
    rope 64, block 128, bf16) and every limit row enforced: 32 heads, and 4 (DeepSeek-V3.1 at tp=32), which
    v2 takes unpadded (n 1/2/4/.../128, _op_plugin_docs.py:8699); 6 heads are padded to 8.  The old v1
    lowering padded 4 to 32 (v1's N 32/64/128).  A speculative verify row (S = K + 1 query tokens per
    sequence) runs with sparse_mode 3 and the mask up to S = 16; 17 is refused (fia2.mla.heads), and so is
    a verify row without the mask (fia2.mla.sparse)."""
    import importlib
    import sys

    sys.modules.pop("graphgen.lower.npu_helpers", None)  # its torch_npu import must bind the stand-in
    helpers = importlib.import_module("graphgen.lower.npu_helpers")
    try:
        nope, v, r, rope, bs = 128, 128, 512, 64, 128
        bf = torch.bfloat16
        cache = (torch.zeros(3, bs, r, dtype=bf), torch.zeros(3, bs, rope, dtype=bf))

        def run(n, s, mask):
            w_kv_b = torch.zeros(n * (nope + v), r, dtype=bf)
            with torch.no_grad(), oplib.enforce_limits(True):
                return helpers._mla_attention_absorbed(
                    torch.zeros(2 * s, n, nope, dtype=bf), torch.zeros(2 * s, n, rope, dtype=bf), cache, w_kv_b,
                    torch.tensor([[1], [2]], dtype=torch.int32), [20, 27], mask, num_heads=n, qk_nope_head_dim=nope,
                    v_head_dim=v, kv_lora_rank=r, scale=1.0, block_size=bs)

        for n, s in ((32, 1), (4, 1), (6, 1), (32, 4), (4, 16)):
            assert run(n, s, None if s == 1 else MASK).shape == (2 * s, n, v)
        with pytest.raises(limits.KernelLimitError, match="fia2.mla.heads"):
            run(32, 17, MASK)
        with pytest.raises(limits.KernelLimitError, match="fia2.mla.sparse"):
            run(32, 4, None)
    finally:
        sys.modules.pop("graphgen.lower.npu_helpers", None)


def test_unpermute_standin_reads_the_doc_example():
    """The stand-in kernel shares the doc's reading (wiring, not the kernel's meaning): the example of
    the docstring torch_npu attaches (_op_plugin_docs.py:16966-16971) comes out as its gather reading gives."""
    perm = torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4], [1, 1], [2, 2], [3, 3], [4, 4]], dtype=BF)
    out = torch.ops.npu.npu_moe_token_unpermute(perm, torch.tensor([0, 4, 5, 1, 2, 6, 7, 3], dtype=torch.int32),
                                               probs=torch.full((4, 2), 0.5, dtype=BF))
    assert torch.equal(out, torch.tensor([[1, 1], [2, 2], [3, 3], [4, 4]], dtype=BF))


def test_init_routing_expert_tokens_and_finalize_standins_follow_the_docs():
    """The MoE trio of graphgen.lower.npu_helpers._moe_residual on the docs' example: init_routing as op-plugin's
    numpy reference ("等价计算逻辑" of torch_npu-npu_moe_init_routing.md) computes it by hand (sort [1,2,0,1,0,2]
    stably: [2,4,0,3,1,5]; row_idx taken along: [1,2,0,4,3,5]), compute_expert_tokens as each expert's end
    row (:10537-10546), finalize as the docs' formula with its k-major index (:10604-10606).  They share the
    docs' reading (wiring); the helper's MoE against the CPU MoE (tests/lower/test_npu_helpers.py) pins meaning."""
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)  # i + k * NUM_ROWS, the docs' example
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    rows, src_to_dst, sorted_ids = torch.ops.npu.npu_moe_init_routing(x, row_idx, expert_idx, 3)
    assert src_to_dst.tolist() == [2, 0, 1, 4, 3, 5] and sorted_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(rows, x[[1, 2, 0, 1, 0, 2]])
    assert torch.ops.npu.npu_moe_compute_expert_tokens(sorted_ids, 4).tolist() == [2, 4, 6, 6]
    scales = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    out = torch.ops.npu.npu_moe_finalize_routing(rows * torch.arange(1, 7).view(6, 1), None, None, None, scales,
                                                 src_to_dst, expert_idx, 0)
    # row i's k-th pair is source row i + 3k, sorted to src_to_dst[i + 3k]: a copy of x[i] times (its sorted position + 1)
    want = torch.stack([sum(scales[i, k] * x[i] * (src_to_dst[i + 3 * k] + 1) for k in range(2)) for i in range(3)])
    torch.testing.assert_close(out, want)
    # not vacuous: the row-major reading (i * K + k) of the same index gives other sums
    row_major = torch.stack([sum(scales[i, k] * rows[src_to_dst[i * 2 + k]] * (src_to_dst[i * 2 + k] + 1)
                                 for k in range(2)) for i in range(3)])
    assert not torch.allclose(out, row_major)