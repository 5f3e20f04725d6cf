"""CPU and meta reference kernels of the ``npu::`` ops graphgen's NPU lowering uses.

Written from the torch-npu 2.14.0 wheel's kernel docs (``torch_npu/_op_plugin_docs.py``), NOT from
``graphgen/runtime/core/ops.py``: the wiring tests compare an NPU module run through these kernels with
the CPU target, and that comparison means something only while the two are written independently.
Plain torch; they run on CPU tensors, and the shape-faithful ones on meta tensors too.  The
documented LIMITS of each kernel (dtypes, head dims, block sizes, query lengths) are data in
``graphgen/npu/check/limits.py`` and are checked by ``graphgen/npu/standin/oplib.py`` before these kernels run.
Registered as ``torch.ops.npu.*`` by ``oplib``; nothing here runs on an NPU.
"""
from __future__ import annotations

from typing import Callable

import torch

from .attention import _fia, _fia_meta, _fia_v2, _fia_v2_meta  # the attention kernels (their own module)
from .quant import (_dynamic_quant, _dynamic_quant_meta, _out_dtype, _quant_matmul, _quant_matmul_meta,  # W8A8
                    grouped_matmul_per_token)

def _nd_index(self, indices):
    # "indices中的索引数据不支持越界": reject what torch indexing would silently wrap (negatives) or
    # what the kernel does not define, so a miswired kv_index fails loudly instead of landing elsewhere.
    idx = indices.long()
    a = idx.shape[-1]
    bounds = torch.tensor(self.shape[:a], dtype=torch.long, device=idx.device)
    if idx.numel() and ((idx < 0).any() or (idx >= bounds).any()):
        raise IndexError(f"npu_scatter_nd_update: index out of range for input of shape {tuple(self.shape)}")
    return tuple(idx.unbind(-1))


def _scatter_nd_update(self, indices, updates):
    out = self.clone()
    out[_nd_index(self, indices)] = updates.to(out.dtype)
    return out


def _scatter_nd_update_(self, indices, updates):
    self[_nd_index(self, indices)] = updates.to(self.dtype)
    return self


def _pa_write(cache, src, slots):
    # cache_mode='Norm' layout: cache[num_blocks, block_size, ...], slot = block * block_size + offset
    flat = cache.view(-1, *cache.shape[2:])
    flat[slots.long()] = src.reshape(src.shape[0], *cache.shape[2:]).to(cache.dtype)


def _scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None,
                         compress_seq_offsets=None, seq_lens=None, cache_mode="PA_NZ"):
    _pa_write(key_cache, key, slot_mapping)
    _pa_write(value_cache, value, slot_mapping)


def _scatter_pa_kv_cache_functional(key, value, key_cache, value_cache, slot_mapping, **kw):
    k, v = key_cache.clone(), value_cache.clone()
    _scatter_pa_kv_cache(key, value, k, v, slot_mapping, **kw)
    return k, v


def _rms_norm(x, gamma, epsilon=1e-6):
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return (x.float() * rstd).to(x.dtype) * gamma, rstd


def _add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    x = x1 + x2
    y, rstd = _rms_norm(x, gamma, epsilon)
    return y, rstd, x


def _swiglu(x, dim=-1):
    a, b = x.chunk(2, dim=dim)
    return torch.nn.functional.silu(a) * b


def _rms_norm_meta(x, gamma, epsilon=1e-6):
    # the shapes and dtypes of _rms_norm without its arithmetic: under Dynamo/AOT's fake tensors every
    # op of a composite kernel is dispatched again (each trace ran _rms_norm's six ops per call)
    y = x.new_empty(torch.broadcast_shapes(x.shape, gamma.shape), dtype=torch.promote_types(x.dtype, gamma.dtype))
    return y, x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


def _add_rms_norm_meta(x1, x2, gamma, epsilon=1e-6):
    x = x1.new_empty(torch.broadcast_shapes(x1.shape, x2.shape), dtype=torch.promote_types(x1.dtype, x2.dtype))
    return (*_rms_norm_meta(x, gamma, epsilon), x)


def _swiglu_meta(x, dim=-1):
    shape = list(x.shape)
    shape[dim] = shape[dim] // 2
    return x.new_empty(shape)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    # Documented: rotary_mode "half" is x * cos + rotate_half(x) * sin; BSND: q [B,S,N,D], cos [B,S,1,D].
    _apply_rotary_pos_emb_check(query, cos, layout, rotary_mode)
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _apply_rotary_pos_emb_check(query, cos, layout, rotary_mode):
    if layout != "BSND" or rotary_mode != "half":
        raise NotImplementedError(f"stand-in npu_apply_rotary_pos_emb models layout BSND, rotary_mode half only "
                                  f"(got {layout!r}, {rotary_mode!r})")
    if query.dim() != 4 or cos.dim() != 4 or cos.shape[2] != 1 or cos.shape[:2] != query.shape[:2]:
        raise ValueError(f"npu_apply_rotary_pos_emb BSND: query {tuple(query.shape)}, cos {tuple(cos.shape)}")


def _rope_like(x, cos):
    """An empty tensor shaped and typed as ``x * cos`` (what the RoPE kernels return)."""
    return x.new_empty(torch.broadcast_shapes(x.shape, cos.shape), dtype=torch.promote_types(x.dtype, cos.dtype))


def _apply_rotary_pos_emb_meta(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    _apply_rotary_pos_emb_check(query, cos, layout, rotary_mode)
    return _rope_like(query, cos), _rope_like(key, cos)


def _interleave_rope(x, cos, sin):
    # Documented formula (torch_npu.npu_interleave_rope / aclnnInterleaveRope): x is [B, N, S, D],
    #   q = reshape(x, [B, N, S, D//2, 2]).transpose(-1, -2).reshape([B, N, S, D])   (de-interleave)
    #   y = q * cos + RotateHalf(q) * sin
    # so the output comes out DE-interleaved, as transformers' DeepSeek RoPE produces and caches.
    _interleave_rope_check(x, cos)
    b, n, s, d = x.shape
    q = x.reshape(b, n, s, d // 2, 2).transpose(-1, -2).reshape(b, n, s, d)
    return q * cos + _rotate_half(q) * sin


def _interleave_rope_check(x, cos):
    if x.dim() != 4 or cos.dim() != 4 or cos.shape[1] != 1:
        raise ValueError(f"npu_interleave_rope: x must be [B,N,S,D] and cos [B,1,S,D]; got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}")


def _interleave_rope_meta(x, cos, sin):
    _interleave_rope_check(x, cos)
    return _rope_like(x, cos)


# MoE kernels.  Semantics are our reading of the torch_npu docs / vllm-ascend usage, never checked
# against the NPU kernels; they exist so the DeepSeek graph traces and its shapes/wiring are exercised.
def _moe_gating_top_k(x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                      group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                      eps=1e-20):
    # norm_type 1: sigmoid scores; selection uses scores + bias, grouped: keep the k_group groups with the
    # best group score (group_select_mode 1: sum of the group's top-2; 0: its max); weights are the
    # unbiased scores of the chosen experts, times routed_scaling_factor (no renormalisation modelled).
    scores = torch.sigmoid(x.float()) if norm_type == 1 else torch.softmax(x.float(), dim=-1)
    sel = scores if bias is None else scores + bias.float()
    t, e = sel.shape
    if group_count > 1:
        grouped = sel.view(t, group_count, e // group_count)
        gs = grouped.topk(2, dim=-1).values.sum(-1) if group_select_mode == 1 else grouped.max(-1).values
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(k_group, dim=-1).indices, 1.0)
        sel = sel.masked_fill(keep.repeat_interleave(e // group_count, dim=1) == 0, float("-inf"))
    ids = sel.topk(k, dim=-1).indices
    weights = scores.gather(1, ids) * routed_scaling_factor
    return weights.to(x.dtype), ids.to(torch.int32), scores.to(x.dtype)


def _moe_gating_top_k_meta(x, k, **kw):
    t, e = x.shape
    return x.new_empty(t, k), x.new_empty(t, k, dtype=torch.int32), x.new_empty(t, e)


def _moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                         expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                         quant_mode=-1, active_expert_range=(), row_idx_type=0, x_dtype=None):
    # Rows of x permuted so each expert's rows are contiguous (stable by expert id); expert_tokens = rows
    # per expert (expert_tokens_num_type 1: counts; 0: cumulative).  expanded_row_idx (docs.py:11105,11108):
    # row_idx_type 0 ("gather" index) = the permuted position of flattened (token, k) pair i (what
    # npu_moe_finalize_routing and npu_moe_token_unpermute take); row_idx_type 1 ("scatter" index) = the
    # flattened pair of permuted row i (its inverse).
    # active_expert_range [lo, hi) (:11104-11110): only the pairs routed to experts in it are permuted, at
    # the front of expanded_x; the rows after them are undefined (NaN here, so a caller that reads them
    # unmasked shows it); the gather-type row index is -1 for the other pairs; the counts cover [lo, hi).
    t, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    n = expert_num if expert_num > 0 else int(flat.max()) + 1
    lo, hi = tuple(active_expert_range) if len(active_expert_range) else (0, n)
    active = (flat >= lo) & (flat < hi)
    order = torch.sort(torch.where(active, flat, torch.full_like(flat, n)), stable=True).indices
    kept = int(active.sum())
    expanded_x = torch.full((t * k, x.shape[-1]), float("nan"), dtype=x.dtype)
    expanded_x[:kept] = x.index_select(0, order[:kept] // k)
    row_idx = torch.full_like(order, -1)
    row_idx[order[:kept]] = torch.arange(kept)
    if row_idx_type == 1:
        row_idx = order
    counts = torch.bincount(flat[active] - lo, minlength=hi - lo)[:hi - lo]
    tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    return expanded_x, row_idx.to(torch.int32), tokens.to(torch.int64), x.new_empty(0, dtype=torch.float32)


def _moe_init_routing_v2_meta(x, expert_idx, *, expert_num=-1, active_expert_range=(), **kw):
    tk = expert_idx.numel()
    local = active_expert_range[1] - active_expert_range[0] if len(active_expert_range) else expert_num
    return (x.new_empty(tk, x.shape[-1]), x.new_empty(tk, dtype=torch.int32),
            x.new_empty(local, dtype=torch.int64), x.new_empty(0, dtype=torch.float32))


def _moe_init_routing(x, row_idx, expert_idx, active_num):
    # docs.py:11004-11016 and op-plugin's torch_npu-npu_moe_init_routing.md "等价计算逻辑" (its numpy
    # reference): a stable sort of the flattened expert ids carries row_idx along; expanded_row_idx[src] =
    # the sorted position of source row src (src = row_idx's value: i + k * NUM_ROWS as callers number it);
    # expanded_x[j] = x[src_j % NUM_ROWS] for the first min(NUM_ROWS, active_num) * K sorted rows.
    n, k = expert_idx.shape
    order = torch.sort(expert_idx.reshape(-1).long(), stable=True).indices
    dst_to_src = row_idx.reshape(-1).long().index_select(0, order)
    expanded_row_idx = torch.empty_like(dst_to_src)
    expanded_row_idx[dst_to_src] = torch.arange(dst_to_src.numel())
    active = min(int(active_num), n) * k
    return (x.index_select(0, dst_to_src[:active] % n), expanded_row_idx.to(torch.int32),
            expert_idx.reshape(-1).index_select(0, order))


def _moe_init_routing_meta(x, row_idx, expert_idx, active_num):
    n, k = expert_idx.shape
    return (x.new_empty(min(int(active_num), n) * k, x.shape[-1]), x.new_empty(n * k, dtype=torch.int32),
            x.new_empty(n * k, dtype=torch.int32))


def _moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    # docs.py:10537-10546: expertTokens_i = BinarySearch(sorted, i): the end (one past the last row) of
    # expert i's rows in the sorted ids, for i in [0, num_expert): cumulative counts, same dtype as the input
    ids = sorted_expert_for_source_row.long()
    ends = torch.searchsorted(ids, torch.arange(num_expert, device=ids.device), right=True)
    return ends.to(sorted_expert_for_source_row.dtype)


def _moe_compute_expert_tokens_meta(sorted_expert_for_source_row, num_expert):
    return sorted_expert_for_source_row.new_empty(num_expert)


def _grouped_matmul(x, weight, *, group_list=None, group_list_type=0, split_item=0, scale=None, per_token_scale=None,
                    output_dtype=None, **kw):
    # One x [M, K] split into row groups (group_list: counts if group_list_type 1, else cumulative ends),
    # group g multiplied by weight[0][g] ([E, K, N]); split_item 2/3: a single concatenated output.
    # Rows past the last group (an expert-parallel rank's pairs routed elsewhere) are not computed:
    # NaN here (undefined).  With per_token_scale: the per-token quantized form (graphgen.npu.standin.quant).
    if per_token_scale is not None:
        return grouped_matmul_per_token(x, weight, scale=scale, per_token_scale=per_token_scale, group_list=group_list,
                                        group_list_type=group_list_type, split_item=split_item,
                                        output_dtype=output_dtype)
    if scale is not None or output_dtype is not None:
        raise NotImplementedError("stand-in npu_grouped_matmul models the unquantized and per-token forms only")
    xs, w = x[0], weight[0]
    counts = group_list.long() if group_list_type == 1 else torch.diff(group_list.long(), prepend=group_list.new_zeros(1))
    used = int(counts.sum())
    outs = [xi @ w[g] for g, xi in enumerate(torch.split(xs[:used], counts.tolist(), dim=0))]
    rest = xs.new_full((xs.shape[0] - used, w.shape[-1]), float("nan"))
    return [torch.cat([*outs, rest], dim=0)]


def _grouped_matmul_meta(x, weight, *, output_dtype=None, **kw):
    dtype = x[0].dtype if output_dtype is None else _out_dtype(output_dtype)
    return [x[0].new_empty(x[0].shape[0], weight[0].shape[-1], dtype=dtype)]


def _moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                          export_for_source_row, drop_pad_mode=0, k=1):
    # docs.py:10604-10606: out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[src_to_dst[i + k * NUM_ROWS]]
    # + bias[export_for_source_row[i, k]]): the index is k-major, as npu_moe_init_routing numbers its rows
    t, kk = scales.shape
    rows = expanded_permuted_rows.index_select(0, expanded_src_to_dst_row.long()).view(kk, t, -1).transpose(0, 1)
    if bias is not None:
        rows = rows + bias.index_select(0, export_for_source_row.reshape(-1).long()).view(t, kk, -1).to(rows.dtype)
    out = (rows * scales.unsqueeze(-1).to(rows.dtype)).sum(1)
    for extra in (skip1, skip2):
        if extra is not None:
            out = out + extra
    return out


def _moe_finalize_routing_meta(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row=None,
                               export_for_source_row=None, drop_pad_mode=0, k=1):
    return expanded_permuted_rows.new_empty(scales.shape[0], expanded_permuted_rows.shape[-1])


def _moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    # OUR reading of the docstring torch_npu attaches (docs.py:16931-16975; it shares the doc's reading:
    # wiring, not the kernel's meaning): sorted_indices[j] is the position in permuted_tokens of flattened
    # (token, k) pair j (:16942; the example at :16966-16971 only works as this gather), weighted by
    # probs[token, k] (topK = probs.shape[-1]; 1 without probs), summed over k.  On Ascend 950 it is
    # MoeFinalizeRoutingV2 with sorted_indices = expandedRowIdx (:16957): init_routing_v2's row index.
    k = 1 if probs is None else probs.shape[-1]
    rows = permuted_tokens.index_select(0, sorted_indices.long()).view(-1, k, permuted_tokens.shape[-1])
    if probs is not None:
        rows = rows * probs.unsqueeze(-1).to(rows.dtype)
    return rows.sum(1)


def _moe_token_unpermute_meta(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    k = 1 if probs is None else probs.shape[1]
    return permuted_tokens.new_empty(permuted_tokens.shape[0] // k, permuted_tokens.shape[1])


CPU_KERNELS: dict[str, Callable] = {
    "npu_moe_token_unpermute": _moe_token_unpermute,
    "npu_moe_gating_top_k": _moe_gating_top_k,
    "npu_moe_init_routing_v2": _moe_init_routing_v2,
    "npu_grouped_matmul": _grouped_matmul,
    "npu_moe_finalize_routing": _moe_finalize_routing,
    "npu_moe_init_routing": _moe_init_routing,
    "npu_moe_compute_expert_tokens": _moe_compute_expert_tokens,
    "npu_scatter_nd_update": _scatter_nd_update,
    "npu_scatter_nd_update_": _scatter_nd_update_,
    "npu_scatter_pa_kv_cache": _scatter_pa_kv_cache,
    "npu_scatter_pa_kv_cache_functional": _scatter_pa_kv_cache_functional,
    "npu_rms_norm": _rms_norm,
    "npu_add_rms_norm": _add_rms_norm,
    "npu_swiglu": _swiglu,
    "npu_apply_rotary_pos_emb": _apply_rotary_pos_emb,
    "npu_interleave_rope": _interleave_rope,
    "npu_fused_infer_attention_score": _fia,
    "npu_fused_infer_attention_score_v2": _fia_v2,
    "npu_dynamic_quant": _dynamic_quant,
    "npu_quant_matmul": _quant_matmul,
}
# Meta kernels: shapes and dtypes only.  The CPU reference kernels are shape-faithful and would run on meta
# tensors as they are, but Dynamo and AOT trace every kernel call on fake tensors (and a meta run, see
# graphgen.npu.run.bucketing, once per step): an op that composes several torch ops pays each of them there.
META_KERNELS: dict[str, Callable] = {
    "npu_scatter_nd_update": lambda self, indices, updates: torch.empty_like(self),
    "npu_scatter_nd_update_": lambda self, indices, updates: self,
    "npu_scatter_pa_kv_cache": lambda *a, **k: None,
    "npu_scatter_pa_kv_cache_functional": lambda key, value, kc, vc, sm, **k: (torch.empty_like(kc),
                                                                              torch.empty_like(vc)),
    "npu_fused_infer_attention_score": _fia_meta,
    "npu_fused_infer_attention_score_v2": _fia_v2_meta,
    "npu_moe_gating_top_k": _moe_gating_top_k_meta,
    "npu_moe_init_routing_v2": _moe_init_routing_v2_meta,
    "npu_grouped_matmul": _grouped_matmul_meta,
    "npu_moe_finalize_routing": _moe_finalize_routing_meta,
    "npu_moe_init_routing": _moe_init_routing_meta,
    "npu_moe_compute_expert_tokens": _moe_compute_expert_tokens_meta,
    "npu_moe_token_unpermute": _moe_token_unpermute_meta,
    "npu_rms_norm": _rms_norm_meta,
    "npu_add_rms_norm": _add_rms_norm_meta,
    "npu_swiglu": _swiglu_meta,
    "npu_apply_rotary_pos_emb": _apply_rotary_pos_emb_meta,
    "npu_interleave_rope": _interleave_rope_meta,
    "npu_dynamic_quant": _dynamic_quant_meta,
    "npu_quant_matmul": _quant_matmul_meta,
}
