"""Python helpers that generated NPU modules call for the multi-kernel ops.

This is a real module (linted, unit-tested under graphgen's NPU stand-in), and :mod:`graphgen.lower.npu`
copies each helper a graph needs *verbatim* (its exact source, found with ``ast``, never imported on the
build path) into the generated module, which stays standalone. So every helper must use only the
module-level names a generated module has (``torch``, ``F``, ``torch_npu``) and the other helpers here.
Keep two blank lines between helpers: generated modules separate them the same way.
"""
import torch
import torch.nn.functional as F
import torch_npu


def _linear(x, w):
    """x @ W^T of a linear layer: W [out, in] in the compute dtype, or a W8A8 weight as the pair (int8 W^T
    [in, out], scales [out]; graphgen.ir.quant): x quantized per token (npu_dynamic_quant: int8 and one
    float32 scale per row, _op_plugin_docs.py:4654-4676), then npu_quant_matmul of int8 x1 [m, k] and x2
    [k, n] with pertoken_scale [m] float32 and scale [n] (bfloat16 for a bfloat16 output, float32 for
    float16), output in x's dtype (the A2/A3 rows of :5020-5027; vllm-ascend's W8A8_DYNAMIC linear).
    A LoRA-adapted weight (a dict, graphgen.lower.npu_calls.lora_weight; docs/lora.md, "NPU"): the base
    product, then each adapted projection's batched delta added to its output columns, static-shaped and in
    ops with a real GE converter: sel [T, S] each token's one-hot adapter slot (base-model and padding
    tokens: an all-zero row), lora_a [S, R, in] and lora_b [S, out, R] the slot stacks. Every slot's shrink at
    once (x against the S*R stacked rows of lora_a: S*R is small next to in), masked to each token's slot, then
    one expand against lora_b laid out [out, S*R]: token t gets x[t] A[s]^T B[s]^T, the masked slots adding exact
    zeros. No per-slot loop, no nonzero/unique (the CPU target's sgmv): GE converts neither."""
    if isinstance(w, dict):
        y, t, sel = _linear(x, w["base"]), x.shape[0], w["sel"]
        for off, (lora_a, lora_b) in w["segs"]:  # (never "b.": the step inputs' name in a generated module)
            s, r, k = lora_a.shape
            n = lora_b.shape[1]
            h = F.linear(x, lora_a.reshape(s * r, k)).view(t, s, r) * sel.unsqueeze(-1)
            y[:, off:off + n] += F.linear(h.view(t, s * r), lora_b.permute(1, 0, 2).reshape(n, s * r))
        return y
    if not isinstance(w, tuple):
        return F.linear(x, w)
    xq, x_scale = torch_npu.npu_dynamic_quant(x.reshape(-1, x.shape[-1]))
    y = torch_npu.npu_quant_matmul(xq, w[0], w[1], pertoken_scale=x_scale, output_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _grouped_linear(rows, w, ends):
    """Each expert's rows (rows [M, K] sorted by expert, ends: cumulative row counts) times its weight: w
    [E, K, N] in the compute dtype, or a W8A8 pair (int8 [E, K, N], scales [E, N]): the rows quantized per
    token, then npu_grouped_matmul in its per-token mode (int8 x and weight, scale [E, N] bfloat16 or
    float32, per_token_scale [M] float32; _op_plugin_docs.py:5808-5812, 5960-5969), as vllm-ascend's
    W8A8_DYNAMIC MoE passes them (scale=[w13_scale] of shape [E, 2I], output_dtype the activations')."""
    if not isinstance(w, tuple):
        return torch_npu.npu_grouped_matmul([rows], [w], group_list=ends, group_list_type=0, group_type=0,
                                            split_item=2)[0]
    xq, x_scale = torch_npu.npu_dynamic_quant(rows)
    return torch_npu.npu_grouped_matmul([xq], [w[0]], scale=[w[1]], per_token_scale=[x_scale], group_list=ends,
                                        group_list_type=0, group_type=0, split_item=2, output_dtype=rows.dtype)[0]


def _qwen3_attn_prolog(x, w_qkv, w_q_norm, w_k_norm, cos, sin, *, num_heads, num_kv_heads, head_dim, eps):
    """q/k/v in one matmul (w_qkv: [q; k; v] merged at load), split; per-head RMSNorm of q and k, then
    half-rotation RoPE (layout BSND, B=1, S=T)."""
    t = x.shape[0]
    q, k, v = _linear(x, w_qkv).split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = torch_npu.npu_rms_norm(q.reshape(t, num_heads, head_dim), w_q_norm, eps)[0]
    k = torch_npu.npu_rms_norm(k.reshape(t, num_kv_heads, head_dim), w_k_norm, eps)[0]
    v = v.reshape(t, num_kv_heads, head_dim)
    q, k = torch_npu.npu_apply_rotary_pos_emb(q.unsqueeze(0), k.unsqueeze(0), cos.view(1, t, 1, head_dim),
                                              sin.view(1, t, 1, head_dim), layout="BSND", rotary_mode="half")
    return q.squeeze(0), k.squeeze(0), v


def _swiglu_mlp(x, w_gate_up, w_down):
    """down(silu(gate(x)) * up(x)) with gate/up merged at load (w_gate_up = [gate; up]): one matmul whose
    output is the [gate | up] npu_swiglu takes on the last dim."""
    return _linear(torch_npu.npu_swiglu(_linear(x, w_gate_up), dim=-1), w_down)


def _interleaved_rope(x, cos, sin):
    """DeepSeek's interleaved RoPE on x [T, N, r]: npu_interleave_rope takes [B, N, S, D], cos/sin [B, 1, S, D]."""
    t, n, r = x.shape
    # The kernel rejects non-contiguous inputs (torch-npu docs); x, cos and sin arrive as split/chunk views.
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    return torch_npu.npu_interleave_rope(x.view(t, n, 1, r), cos.view(t, 1, 1, r), sin.view(t, 1, 1, r)).view(t, n, r)


def _mla_prolog(x, w_q_a, w_q_a_norm, w_q_b, w_kv_a, w_kv_a_norm, cos, sin, *, num_heads, qk_nope_head_dim,
                qk_rope_head_dim, kv_lora_rank, eps, interleave):
    """MLA projections -> q_nope [T,H,n], q_pe [T,H,r] (roped), c_kv [T,R] (normed latent), k_pe [T,r] (roped)."""
    t = x.shape[0]
    # w_q_a None: uncompressed queries (q_lora_rank null), w_q_b is then the plain q projection.
    q = _linear(x if w_q_a is None else torch_npu.npu_rms_norm(_linear(x, w_q_a), w_q_a_norm, eps)[0], w_q_b)
    q_nope, q_pe = q.view(t, num_heads, qk_nope_head_dim + qk_rope_head_dim).split(
        [qk_nope_head_dim, qk_rope_head_dim], dim=-1)
    c_kv, k_pe = _linear(x, w_kv_a).split([kv_lora_rank, qk_rope_head_dim], dim=-1)
    c_kv = torch_npu.npu_rms_norm(c_kv, w_kv_a_norm, eps)[0]
    if interleave:
        q_pe = _interleaved_rope(q_pe, cos, sin)
        k_pe = _interleaved_rope(k_pe.reshape(t, 1, qk_rope_head_dim), cos, sin).view(t, qk_rope_head_dim)
    else:
        q_pe, k_pe = torch_npu.npu_apply_rotary_pos_emb(
            q_pe.unsqueeze(0), k_pe.reshape(1, t, 1, qk_rope_head_dim), cos.view(1, t, 1, qk_rope_head_dim),
            sin.view(1, t, 1, qk_rope_head_dim), layout="BSND", rotary_mode="half")
        q_pe, k_pe = q_pe.squeeze(0), k_pe.view(t, qk_rope_head_dim)
    return q_nope.contiguous(), q_pe.contiguous(), c_kv.contiguous(), k_pe.contiguous()


def _gqa_decode_attention(q, cache, block_table, seq_lens, *, num_heads, num_kv_heads, head_dim, scale, block_size):
    """DECODE ONLY (one query token per sequence, T = B). Paged GQA attention in layout BSH for the static
    decode graph: TND is not supported with tiling sink (tiling_schedule_optimize=True; torch-npu 2.14.0
    _op_plugin_docs.py:8632-8633), BSH is (:8631 BSH = (B, Q_S, H)).  The v2 API:
    q [T, N, D] -> [B, 1, N*D]; cache = (k, v), each (blocknum, blocksize, KV_N*D), the one cache layout
    BSH page attention takes (:8822); actual_seq_kvlen = per-sequence KV lengths (page attention needs
    it, :8780-8821); actual_seq_qlen left out (ignored for Q_S = 1, :8609); no mask, sparse_mode 0.
    Every tensor shape is static per batch bucket (B, block_table [B, max_blocks]); only the KV length
    values vary, which tiling sink computes on the device (torchair's path 4)."""
    t = q.shape[0]
    return torch_npu.npu_fused_infer_attention_score_v2(
        q.reshape(t, 1, num_heads * head_dim), cache[0], cache[1], atten_mask=None, actual_seq_kvlen=seq_lens,
        block_table=block_table, num_query_heads=num_heads, num_key_value_heads=num_kv_heads, softmax_scale=scale,
        input_layout="BSH", sparse_mode=0, block_size=block_size)[0].view(t, num_heads, head_dim)


def _mla_attention_absorbed(q_nope, q_pe, cache, w_kv_b, block_table, seq_lens, atten_mask,
                            *, num_heads, qk_nope_head_dim, v_head_dim, kv_lora_rank, scale, block_size):
    """DECODE and VERIFY: S = T / B query tokens per sequence, every row the same S -- 1 in decode (T = B),
    K + 1 <= 16 in a speculative verify row (the K draft tokens and the last verified one).  Absorbed MLA:
    q_nope . W_uk -> attention over the paged latent cache (ckv as key and value, q_pe/kpe as the rope part)
    -> . W_uv.  cache = (ckv [NB, BS, R], kpe [NB, BS, r]); returns [T, H, v_head_dim].
    The v2 API in layout BNSD (B, N, S, D) for the static decode graph (TND is not supported with tiling
    sink, torch-npu 2.14.0 _op_plugin_docs.py:8632-8633), as vllm-ascend's MLA decode does
    (mla_v1.py:1373-1500, v2).  Its documented envelope with query_rope, query D = 512 (:8694-8703): query
    S 1-16 and N in 1/2/4/8/16/32/64/128, rope D 64, key N 1 and D 512, page attention with block size 16
    or 128; sparse_mode 0 without a mask for S = 1, sparse_mode 3 with the mask for S > 1 (:8697: query i
    of a row of S sees the keys up to seq_len - S + i, causal inside the verify row).  The latent cache is
    viewed (blocknum, KV_N=1, blocksize, D), the layout the docs call faster for BNSD (:8822-8823; the same
    bytes for KV_N = 1).
    A tensor-parallel rank holds num_heads / tp heads (4 for DeepSeek-V3 at tp=32): the query is padded
    with zero heads to the next power of two only when it is not one (the extra heads cost compute, not
    KV traffic, and are dropped)."""
    w = w_kv_b.view(num_heads, qk_nope_head_dim + v_head_dim, kv_lora_rank)
    w_uk, w_uv = w.split([qk_nope_head_dim, v_head_dim], dim=1)
    q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    heads = next(n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n >= num_heads)
    if heads != num_heads:
        q_lat = torch.nn.functional.pad(q_lat, (0, 0, 0, heads - num_heads))
        q_pe = torch.nn.functional.pad(q_pe, (0, 0, 0, heads - num_heads))
    t, b = q_lat.shape[0], block_table.shape[0]
    s = t // b
    # [T, N, D] -> [B, N, S, D]
    q_lat = q_lat.view(b, s, heads, kv_lora_rank).transpose(1, 2).contiguous()
    q_pe = q_pe.view(b, s, heads, q_pe.shape[-1]).transpose(1, 2).contiguous()
    nb, bs = cache[0].shape[0], cache[0].shape[1]
    ckv, kpe = cache[0].view(nb, 1, bs, kv_lora_rank), cache[1].view(nb, 1, bs, cache[1].shape[-1])
    o_lat = torch_npu.npu_fused_infer_attention_score_v2(
        q_lat, ckv, ckv, query_rope=q_pe, key_rope=kpe, atten_mask=None if s == 1 else atten_mask,
        actual_seq_kvlen=seq_lens, block_table=block_table, num_query_heads=heads, num_key_value_heads=1,
        softmax_scale=scale, input_layout="BNSD", sparse_mode=0 if s == 1 else 3, block_size=block_size)[0]
    return torch.einsum("thr,hvr->thv", o_lat.transpose(1, 2).reshape(t, heads, kv_lora_rank)[:, :num_heads], w_uv)


def _mla_unabsorbed(q_nope, q_pe, c_kv, k_pe, w_kv_b, actual_seq_lengths, cumulative_kv_lengths, atten_mask, *,
                    num_heads, qk_nope_head_dim, v_head_dim, scale):
    """PREFILL/SPLITFUSE. Un-absorbed MLA over the latent rows ``c_kv`` [S, R] / ``k_pe`` [S, r] of every
    sequence's keys (history + new, sequences concatenated): kv_b_proj up-projects them to per-head
    K_nope [S, H, n] and V [S, H, v]; K = [K_nope | k_pe broadcast over heads], Q = [q_nope | q_pe].
    Then non-paged TND fused_infer_attention_score, causal sparse_mode=3: documented for Q_D = K_D = 192
    with V_D = 128/192, Q_N = K_N = V_N, bfloat16 only, actual_seq_lengths AND actual_seq_lengths_kv both
    cumulative, no page attention, not in reduce-overhead (torch-npu 2.14.0 _op_plugin_docs.py:8730-8737;
    op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md, "query的d不等于512").  This is
    the form vllm-ascend uses for prefill (FIA / npu_ring_mla on decompressed K/V).
    The v1 TND text also asks N in 8/16/32/64/128 (_op_plugin_docs.py:8193-8199): a tensor-parallel rank
    holds num_heads / tp heads (4 for DeepSeek-V3 at tp=32), so q, k and v are padded with zero heads to
    the next documented count and the padding's output dropped (a zero head attends uniformly to zero
    values: its output is zero and never read)."""
    s = c_kv.shape[0]
    kv = F.linear(c_kv, w_kv_b).view(s, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe.view(s, 1, -1).expand(s, num_heads, k_pe.shape[-1])), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    heads = next(n for n in (8, 16, 32, 64, 128) if n >= num_heads)
    if heads != num_heads:
        q, k, v = (F.pad(x, (0, 0, 0, heads - num_heads)) for x in (q, k, v))
    return torch_npu.npu_fused_infer_attention_score(
        q, k.contiguous(), v.contiguous(), atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths,
        actual_seq_lengths_kv=cumulative_kv_lengths, num_heads=heads, num_key_value_heads=heads,
        scale=scale, input_layout="TND", sparse_mode=3)[0][:, :num_heads]


def _mla_prefill(q_nope, q_pe, cache, w_kv_b, kv_index, actual_seq_lengths, atten_mask, *, num_heads,
                 qk_nope_head_dim, v_head_dim, scale):
    """No history: the keys are exactly the step's new tokens, read back from the rows the KV write just
    filled (kv_index), in token order; so the KV lengths equal the query lengths."""
    blk, off = kv_index[:, 0], kv_index[:, 1]
    return _mla_unabsorbed(q_nope, q_pe, cache[0][blk, off], cache[1][blk, off], w_kv_b, actual_seq_lengths,
                           actual_seq_lengths, atten_mask, num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
                           v_head_dim=v_head_dim, scale=scale)


def _paged_rows(cache_part, rows):
    """Rows ``rows`` [S] int64 of a paged cache part [NB, BS, W], as [S, W]: the packed history order.
    The host builds ``rows`` (graphgen.npu.run.inputs.gather_rows): each sequence's first seq_len rows,
    block_table[i, p // BS] * BS + p % BS, in sequence order, then pad-block rows up to a static S.
    It knows the lengths; computing the order in the graph needed a stable argsort, and torchair's GE
    converter for aten.sort.stable only raises (torch-npu 2.14.0
    torchair/_ge_concrete_graph/ge_converter/aten/sort.py:36-46)."""
    return cache_part.reshape(-1, cache_part.shape[-1]).index_select(0, rows)


def _mla_splitfuse(q_nope, q_pe, cache, w_kv_b, kv_gather_rows, actual_seq_lengths, actual_seq_lengths_kv, atten_mask,
                   *, num_heads, qk_nope_head_dim, v_head_dim, scale):
    """History from the pool: gather every sequence's latent (history + the new tokens just written) from
    the paged cache by the host-packed rows ``kv_gather_rows``, then un-absorbed attention (KV lengths
    made cumulative).  The padding rows past sum(seq_lens) are up-projected but never read; the host
    keeps them few (S = (batch - 1) * max_blocks * BS + tokens per bucket, StepPadding.gather_rows)."""
    cum_kv = [sum(actual_seq_lengths_kv[:i + 1]) for i in range(len(actual_seq_lengths_kv))]
    c_kv = _paged_rows(cache[0], kv_gather_rows)
    k_pe = _paged_rows(cache[1], kv_gather_rows)
    return _mla_unabsorbed(q_nope, q_pe, c_kv, k_pe, w_kv_b, actual_seq_lengths, cum_kv, atten_mask,
                           num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim, scale=scale)


def _moe_residual(x, w_router, w_bias, w_gate_up_t, w_down_t, w_shared_gate_up, w_shared_down, residual, *,
                  top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob, num_experts, ep=1, ep_rank=0):
    """DeepSeek-V3 MoE: sigmoid grouped top-k routing, permute, two grouped matmuls, unpermute + residual.

    Expert weights come in npu_grouped_matmul's layout, built once at load (W8A8: int8 with their scales,
    _grouped_linear): w_gate_up_t [E, H, 2I]
    (gate and up merged, so one GMM yields [gate | up] for npu_swiglu) and w_down_t [E, I, H] -- no
    per-step transpose, which torchair folds into GMM's transpose_weight for fp8/mxfp4 only (audit 2 row 10).

    Permute and unpermute with the trio vllm-ascend ran inside torchair's GE graphs
    (0b65ac6c4b:vllm_ascend/torchair/ops/torchair_fused_moe.py, torchair_fused_experts), each op with a
    real GE converter in the torch-npu 2.14.0 wheel (ge_converter/custom/moe_init_routing.py,
    npu_moe_compute_expert_tokens.py, npu_moe_finalize_routing.py; audit 3 N4: npu_moe_token_unpermute
    has none): npu_moe_init_routing sorts the (token, k) pairs by expert (row_idx[i, k] = i + k*T, the
    k-major source-row numbering, _op_plugin_docs.py:11004-11045), npu_moe_compute_expert_tokens gives each
    expert's end row (:10534-10560: cumulative, group_list_type 0), and npu_moe_finalize_routing in its
    one documented drop_pad_mode 0 (:10599-10620) sums scales[i, k] * rows[expanded_row_idx[i + k*T]].

    The gating op is asked for unscaled weights (routed_scaling_factor=1.0); normalising and scaling
    happen here so the result does not depend on whether the kernel renormalises internally.

    Expert parallel (ep > 1, the all-gather form; the result is this rank's partial sum): the rank holds
    experts [lo, lo + E/ep) (its stacked weights are those E/ep). The weights of (token, k) pairs routed
    elsewhere are zeroed and their expert ids set to E/ep, one past the local ones, so init_routing sorts
    them after every local pair; compute_expert_tokens counts E/ep + 1 groups (ids must lie in
    [0, num_expert), :10545) and the GMMs run the first E/ep.  Their rows past the local pairs are
    undefined after the GMMs, so they are zeroed (torch.where: a NaN there cannot leak through a zero
    weight); the finalize index stays a permutation of [0, T*K) as documented.
    """
    t = x.shape[0]
    weights, ids, _ = torch_npu.npu_moe_gating_top_k(
        F.linear(x.float(), w_router.float()), top_k, bias=w_bias.float(), k_group=topk_group, group_count=n_group,
        group_select_mode=1, renorm=0, norm_type=1, routed_scaling_factor=1.0, eps=1e-20)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = (weights * routed_scaling_factor).to(x.dtype)
    local = num_experts // ep
    ids = ids.int()
    if ep > 1:
        mine = (ids >= ep_rank * local) & (ids < (ep_rank + 1) * local)
        weights = torch.where(mine, weights, torch.zeros_like(weights))
        ids = torch.where(mine, ids - ep_rank * local, torch.full_like(ids, local))
    row_idx = torch.arange(t * top_k, dtype=torch.int32, device=x.device).view(top_k, t).t().contiguous()
    rows, src_to_dst, sorted_ids = torch_npu.npu_moe_init_routing(x, row_idx, ids, active_num=t)
    ends = torch_npu.npu_moe_compute_expert_tokens(sorted_ids, local + (1 if ep > 1 else 0))[:local].long()
    act = torch_npu.npu_swiglu(_grouped_linear(rows, w_gate_up_t, ends), dim=-1)
    down = _grouped_linear(act, w_down_t, ends)
    if ep > 1:
        valid = torch.arange(t * top_k, device=x.device) < ends[-1]
        down = torch.where(valid.unsqueeze(-1), down, torch.zeros_like(down))
    shared = None if w_shared_gate_up is None else _swiglu_mlp(x, w_shared_gate_up, w_shared_down)
    # sum_k weight_k * expert_k(x), unpermuted; then residual + shared
    out = residual + torch_npu.npu_moe_finalize_routing(down, None, None, None, weights, src_to_dst, ids,
                                                        drop_pad_mode=0)
    return out if shared is None else out + shared
