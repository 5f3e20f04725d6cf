"""CPU STAND-IN for torchair / torch_npu -- graph structure and lowering wiring on CPU, never NPU behaviour.

``install()`` (and nothing else in this module) makes NPU-targeted generated code traceable on
a CPU-only machine:

* registers the ``air::`` operator schemas torchair defines (scope_enter/exit, record, wait,
  wait_tensor, tagged_event_record/wait, record_tagged_stream[_]) with no-op CPU kernels and
  meta kernels;
* registers the ``npu::`` kernels the NPU templates use, with their REAL schemas taken from
  ``manifest.json`` (extracted from the torch-npu 2.14.0 wheel), small CPU reference kernels and
  meta kernels.  Where a kernel's documented semantics are unambiguous (scatter_nd_update,
  rms_norm, swiglu, apply_rotary_pos_emb "half"/BSND, interleave_rope, and the paged TND form of
  fused_infer_attention_score that the templates use), the CPU kernel computes them in plain torch,
  so an NPU module's outputs can be compared with the CPU target's on the same weights: a WIRING
  check of the lowering (slot mappings, block tables, cache layouts, argument meaning), never an
  NPU result -- hardware limits (dtypes, head_dim 64/128, block_size multiples of 16) are not
  modelled, and a kernel feature outside what the templates use raises NotImplementedError;  Mutable ops (``npu_scatter_nd_update_``, ``npu_scatter_pa_kv_cache``) get a
  Functionalize kernel that rewrites them to their functional twin, which is what torch_npu's
  generated C++ functionalization does (the yaml declares the twins, and torchair's GE
  converters are registered on the functional names, e.g.
  ``torchair/_ge_concrete_graph/ge_converter/custom/npu_scatter_pa_kv_cache.py``);
* puts fake ``torchair`` and ``torch_npu`` modules into ``sys.modules``.

It does nothing when ``torch_npu`` is installed (registering the same ``air``/``npu`` ops a
second time would fail, and the real thing should be used).  Nothing here runs on an NPU.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.fx.node import has_side_effect

STANDIN_LABEL = "<graphgen CPU stand-in: graph structure and wiring checks only, not NPU behaviour>"
_MANIFEST = Path(__file__).with_name("manifest.json")

# air:: ops torchair defines (all of them are registered so generated code may use any).
AIR_OPS = ("scope_enter", "scope_exit", "record", "wait", "wait_tensor", "tagged_event_record",
           "tagged_event_wait", "record_tagged_stream", "record_tagged_stream_")
# torchair marks these with has_side_effect so DCE keeps them (ops/_record_wait.py, scope/_scope.py,
# ops/_tagged_event.py); record is not marked: its output feeds a wait.
_AIR_SIDE_EFFECT = ("scope_enter", "scope_exit", "wait", "tagged_event_record", "tagged_event_wait",
                    "record_tagged_stream")
# npu:: kernels a Qwen3 dense layer and a DeepSeek MLA(+MoE) layer lowering uses; the KV write and
# the save both go through npu_scatter_nd_update_ (see docs/npu-research.md).
NPU_OPS = ("npu_scatter_nd_update", "npu_scatter_nd_update_", "npu_scatter_pa_kv_cache",
           "npu_scatter_pa_kv_cache_functional", "npu_rms_norm", "npu_add_rms_norm", "npu_swiglu",
           "npu_apply_rotary_pos_emb", "npu_interleave_rope", "npu_fused_infer_attention_score",
           # DeepSeek-V3 MoE (real schemas from the manifest; CPU kernels are OUR reading of the docs)
           "npu_moe_gating_top_k", "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing")

_state: dict[str, Any] = {"installed": False, "libs": []}


def torch_npu_available() -> bool:
    """Is the REAL torch_npu installed?  (Our own stand-in in sys.modules does not count.)"""
    mod = sys.modules.get("torch_npu")
    if mod is not None:
        return not is_standin(mod)
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ValueError, ImportError):
        return False


def _schema(manifest: dict, key: str) -> str:
    return manifest["op_schemas"][key]["schema"]


# --------------------------------------------------------------------------- CPU reference kernels
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


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    # Documented: rotary_mode "half" is x * cos + rotate_half(x) * sin; BSND: q [B,S,N,D], cos [B,S,1,D].
    if layout != "BSND" or rotary_mode != "half":
        raise NotImplementedError(f"stand-in npu_apply_rotary_pos_emb models layout BSND, rotary_mode half only "
                                  f"(got {layout!r}, {rotary_mode!r})")
    if query.dim() != 4 or cos.dim() != 4 or cos.shape[2] != 1 or cos.shape[:2] != query.shape[:2]:
        raise ValueError(f"npu_apply_rotary_pos_emb BSND: query {tuple(query.shape)}, cos {tuple(cos.shape)}")
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _interleave_rope(x, cos, sin):
    # Documented formula (torch_npu.npu_interleave_rope / aclnnInterleaveRope): x is [B, N, S, D],
    #   q = reshape(x, [B, N, S, D//2, 2]).transpose(-1, -2).reshape([B, N, S, D])   (de-interleave)
    #   y = q * cos + RotateHalf(q) * sin
    # so the output comes out DE-interleaved, as transformers' DeepSeek RoPE produces and caches.
    if x.dim() != 4 or cos.dim() != 4 or cos.shape[1] != 1:
        raise ValueError(f"npu_interleave_rope: x must be [B,N,S,D] and cos [B,1,S,D]; got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}")
    b, n, s, d = x.shape
    q = x.reshape(b, n, s, d // 2, 2).transpose(-1, -2).reshape(b, n, s, d)
    return q * cos + _rotate_half(q) * sin


_MASK_SIZE = 2048
# fused_infer_attention_score features the templates never use: a non-default value is refused rather
# than silently ignored (the stand-in would then compute something the kernel does not).
_FIA_UNMODELLED = ("pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
                   "antiquant_scale", "antiquant_offset", "key_antiquant_scale", "key_antiquant_offset",
                   "value_antiquant_scale", "value_antiquant_offset", "query_padding_size", "kv_padding_size",
                   "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len", "key_rope_antiquant_scale")


def _fia_dims(query, key, value, kw):
    n = int(kw.get("num_heads", 1))
    nkv = int(kw.get("num_key_value_heads", 0)) or n  # 0: as many kv heads as query heads
    if kw.get("input_layout", "BSH") != "TND" or kw.get("block_table") is None:
        raise NotImplementedError("stand-in npu_fused_infer_attention_score models input_layout='TND' with "
                                  "page attention (block_table, block_size) only")
    if key.dim() != 3 or value.dim() != 3:
        raise NotImplementedError("stand-in page attention models the (blocknum, blocksize, H) cache layout only")
    if query.dim() != 3 or query.shape[1] != n or n % nkv:
        raise ValueError(f"TND query must be [T, num_heads={n}, D] with num_heads a multiple of "
                         f"num_key_value_heads={nkv}; got {tuple(query.shape)}")
    if key.shape[-1] % nkv or value.shape[-1] % nkv:
        raise ValueError(f"cache H ({key.shape[-1]}, {value.shape[-1]}) is not a multiple of num_key_value_heads {nkv}")
    return n, nkv, key.shape[-1] // nkv, value.shape[-1] // nkv


def _fia(query, key, value, **kw):
    """The paged TND form of npu_fused_infer_attention_score, as the torch-npu docs describe it.

    * ``actual_seq_lengths``: CUMULATIVE query lengths (TND; its length is the batch B);
      ``actual_seq_lengths_kv``: per-sequence KV lengths (page attention), len B.
    * ``key``/``value``: paged caches ``[blocknum, block_size, KV_N * D]``; sequence b's position p is
      at ``block_table[b, p // block_size]``, offset ``p % block_size``; ``block_table`` [B, M] int32.
    * ``num_key_value_heads`` (GQA): query head h reads kv head ``h // (num_heads / num_key_value_heads)``.
    * ``sparse_mode=3`` (rightDownCausal, compressed 2048x2048 lower-triangular mask): query i of a
      sequence with q_len queries and kv_len keys sees key j iff ``j <= kv_len - q_len + i``;
      ``sparse_mode=0`` without a mask: every query sees all kv_len keys (decode).
    * MLA: ``query_rope``/``key_rope`` add a rope part, scores = scale * (q.k + q_rope.k_rope); the
      absorbed form passes the latent cache as both key and value.
    Returns (attention_out [T, N, D_v], softmax_lse) -- lse is the documented [1] zero tensor for
    softmax_lse_flag=False.  Plain torch, float32 softmax; written from the docs, not from the runtime.
    """
    for name in _FIA_UNMODELLED:
        if kw.get(name) is not None:
            raise NotImplementedError(f"stand-in npu_fused_infer_attention_score does not model {name}")
    if kw.get("softmax_lse_flag", False):
        raise NotImplementedError("stand-in npu_fused_infer_attention_score does not model softmax_lse_flag=True")
    n, nkv, dk, dv = _fia_dims(query, key, value, kw)
    q_rope, k_rope = kw.get("query_rope"), kw.get("key_rope")
    if (q_rope is None) != (k_rope is None):
        raise ValueError("query_rope and key_rope must be given together")
    if query.shape[-1] != dk:
        raise ValueError(f"query D {query.shape[-1]} != key D {dk}")
    table = kw["block_table"]
    if table.dtype != torch.int32 or table.dim() != 2:
        raise ValueError(f"block_table must be a 2-D int32 tensor, got {table.dtype} {tuple(table.shape)}")
    bs = int(kw.get("block_size", 0))
    if bs != key.shape[1]:
        raise ValueError(f"block_size {bs} != the cache's block size {key.shape[1]}")
    cum = [int(x) for x in (kw.get("actual_seq_lengths") or [])]
    kv_lens = [int(x) for x in (kw.get("actual_seq_lengths_kv") or [])]
    nb = len(cum)
    if nb == 0 or len(kv_lens) != nb or table.shape[0] != nb:
        raise ValueError(f"TND needs actual_seq_lengths (len B) and actual_seq_lengths_kv (len B) matching "
                         f"block_table's B: {len(cum)}, {len(kv_lens)}, {table.shape[0]}")
    if cum[-1] > query.shape[0] or any(b < a for a, b in zip([0] + cum, cum)):
        raise ValueError(f"actual_seq_lengths must be non-decreasing cumulative lengths <= T, got {cum}")
    mode, mask = int(kw.get("sparse_mode", 0)), kw.get("atten_mask")
    if mode == 3:
        if mask is None or mask.reshape(-1, mask.shape[-1]).shape != (_MASK_SIZE, _MASK_SIZE):
            raise ValueError("sparse_mode=3 needs the compressed 2048x2048 atten_mask")
        if not torch.equal(mask.reshape(_MASK_SIZE, _MASK_SIZE).bool(),
                           torch.triu(torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool, device=mask.device), 1)):
            raise ValueError("sparse_mode=3: atten_mask must be the causal mask (True above the diagonal)")
    elif mode == 0:
        if mask is not None:
            raise NotImplementedError("stand-in models sparse_mode=0 without atten_mask only")
    else:
        raise NotImplementedError(f"stand-in models sparse_mode 0 and 3 only, got {mode}")
    scale = float(kw.get("scale", 1.0))
    rep = n // nkv
    nblocks = key.shape[0]
    out = query.new_zeros(query.shape[0], n, dv)
    start = 0
    for b in range(nb):
        end, kv_len = cum[b], kv_lens[b]
        q_len = end - start
        if q_len == 0:
            continue
        if kv_len < (q_len if mode == 3 else 1):
            raise ValueError(f"sequence {b}: actual_seq_lengths_kv {kv_len} too short for {q_len} queries")
        need = (kv_len + bs - 1) // bs
        if need > table.shape[1]:
            raise ValueError(f"sequence {b}: {need} blocks needed, block_table has {table.shape[1]} columns")
        ids = table[b, :need].long()
        if (ids < 0).any() or (ids >= nblocks).any():
            raise IndexError(f"sequence {b}: block id out of range [0, {nblocks}): {ids.tolist()}")

        def gather(cache, heads, d):
            return cache.index_select(0, ids).reshape(need * bs, heads, d)[:kv_len].float()

        k = gather(key, nkv, dk).repeat_interleave(rep, dim=1)      # [S, N, D]
        v = gather(value, nkv, dv).repeat_interleave(rep, dim=1)    # [S, N, Dv]
        q = query[start:end].float()                                # [q, N, D]
        scores = torch.einsum("qnd,snd->nqs", q, k)
        if q_rope is not None:
            kr = gather(k_rope, nkv, k_rope.shape[-1] // nkv).repeat_interleave(rep, dim=1)
            scores = scores + torch.einsum("qnd,snd->nqs", q_rope[start:end].float(), kr)
        scores = scores * scale
        if mode == 3:
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("nqs,snd->qnd", probs, v).to(out.dtype)
        start = end
    return out, torch.zeros(1, dtype=torch.float32, device=query.device)


def _fia_meta(query, key, value, **kw):
    n = int(kw.get("num_heads", 1))
    nkv = int(kw.get("num_key_value_heads", 0)) or n
    dv = value.shape[-1] // nkv if value.dim() == 3 else value.shape[-1]
    return query.new_empty(query.shape[0], n, dv), query.new_empty(1, dtype=torch.float32)


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
    # Rows of x permuted so each expert's rows are contiguous (stable by expert id); expanded_row_idx[i]
    # is the permuted position of flattened (token, k) pair i; expert_tokens = rows per expert
    # (expert_tokens_num_type 1: counts; 0: cumulative).
    t, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    expanded_x = x.index_select(0, order // k)
    row_idx = torch.empty_like(order)
    row_idx[order] = torch.arange(order.numel())
    n = expert_num if expert_num > 0 else int(flat.max()) + 1
    counts = torch.bincount(flat, minlength=n)[:n]
    tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    return expanded_x, row_idx.to(torch.int32), tokens.to(torch.int64), x.new_empty(0, dtype=torch.float32)


def _moe_init_routing_v2_meta(x, expert_idx, *, expert_num=-1, **kw):
    tk = expert_idx.numel()
    return (x.new_empty(tk, x.shape[-1]), x.new_empty(tk, dtype=torch.int32),
            x.new_empty(expert_num, dtype=torch.int64), x.new_empty(0, dtype=torch.float32))


def _grouped_matmul(x, weight, *, group_list=None, group_list_type=0, split_item=0, **kw):
    # One x [M, K] split into row groups (group_list: counts if group_list_type 1, else cumulative ends),
    # group g multiplied by weight[0][g] ([E, K, N]); split_item 2/3: a single concatenated output.
    xs, w = x[0], weight[0]
    counts = group_list.long() if group_list_type == 1 else torch.diff(group_list.long(), prepend=group_list.new_zeros(1))
    outs = [xi @ w[g] for g, xi in enumerate(torch.split(xs, counts.tolist(), dim=0))]
    return [torch.cat(outs, dim=0) if outs else xs.new_empty(0, w.shape[-1])]


def _grouped_matmul_meta(x, weight, **kw):
    return [x[0].new_empty(x[0].shape[0], weight[0].shape[-1])]


def _moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                          export_for_source_row, drop_pad_mode=0, k=1):
    # out[t] = skip1[t] + skip2[t] + sum_j scales[t, j] * rows[expanded_src_to_dst_row[t*K + j]]
    t, kk = scales.shape
    rows = expanded_permuted_rows.index_select(0, expanded_src_to_dst_row.long()).view(t, kk, -1)
    out = (rows * scales.unsqueeze(-1).to(rows.dtype)).sum(1)
    for extra in (skip1, skip2):
        if extra is not None:
            out = out + extra
    return out


def _moe_finalize_routing_meta(expanded_permuted_rows, skip1, skip2, bias, scales, *a, **kw):
    return expanded_permuted_rows.new_empty(scales.shape[0], expanded_permuted_rows.shape[-1])


_CPU_KERNELS: dict[str, Callable] = {
    "npu_moe_gating_top_k": _moe_gating_top_k,
    "npu_moe_init_routing_v2": _moe_init_routing_v2,
    "npu_grouped_matmul": _grouped_matmul,
    "npu_moe_finalize_routing": _moe_finalize_routing,
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
}
# Meta kernels: the CPU reference kernels are shape-faithful, so most run on meta tensors as-is.
_META_KERNELS: dict[str, Callable] = {
    "npu_scatter_nd_update": lambda s, i, u: torch.empty_like(s),
    "npu_scatter_nd_update_": lambda s, i, u: s,
    "npu_scatter_pa_kv_cache": lambda *a, **k: None,
    "npu_scatter_pa_kv_cache_functional": lambda key, value, kc, vc, sm, **k: (torch.empty_like(kc),
                                                                              torch.empty_like(vc)),
    "npu_fused_infer_attention_score": _fia_meta,
    "npu_moe_gating_top_k": _moe_gating_top_k_meta,
    "npu_moe_init_routing_v2": _moe_init_routing_v2_meta,
    "npu_grouped_matmul": _grouped_matmul_meta,
    "npu_moe_finalize_routing": _moe_finalize_routing_meta,
}


def _functionalize_via(functional_name: str, mutated: tuple[int, ...]):
    """Functionalize kernel: call the functional twin, then replace the mutated inputs' values.

    Mirrors what torchgen-generated functionalization does for native mutable ops; without it
    AOT would try auto_functionalize, which rejects ``-> Tensor(a!)`` returns.
    """
    def kernel(*args, **kwargs):
        for i in mutated:
            torch._sync(args[i])
        unwrap = lambda t: torch._from_functional_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        raw_args = [unwrap(a) for a in args]
        raw_kwargs = {k: unwrap(v) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)):
            out = getattr(torch.ops.npu, functional_name)(*raw_args, **raw_kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, new in zip(mutated, outs):
            torch._functionalize_replace(args[i], new)
            torch._functionalize_commit_update(args[i])
            torch._functionalize_sync(args[i])
        return args[mutated[0]] if not isinstance(out, (tuple, list)) else None
    return kernel


def _register_ops(manifest: dict) -> None:
    if not hasattr(torch.ops.air, "scope_enter"):
        air = torch.library.Library("air", "FRAGMENT")  # noqa: TOR901
        _state["libs"].append(air)
        for name in AIR_OPS:
            air.define(_schema(manifest, f"air::{name}"))
        noop = lambda *a, **k: None  # noqa: E731
        for name in AIR_OPS:
            if name == "record":
                air.impl(name, lambda *, device=None: torch.empty(0, device=device), "CompositeExplicitAutograd")
                air.impl(name, lambda *, device=None: torch.empty(0, device="meta"), "Meta")
            elif name == "wait_tensor":
                # max-autotune only on NPU; here an identity so graphs using it still trace.
                air.impl(name, lambda self, dependency: self.clone(), "CompositeExplicitAutograd")
            else:
                air.impl(name, noop, "CompositeExplicitAutograd")
        # record_tagged_stream_ does not really mutate; torchair routes its functionalization to the
        # non-mutating twin the same way (torchair/ops/_tagged_event.py).
        air.impl("record_tagged_stream_",
                 lambda input, tag: torch.ops.air.record_tagged_stream(torch._from_functional_tensor(input), tag),
                 "Functionalize")
        for name in _AIR_SIDE_EFFECT:
            has_side_effect(getattr(torch.ops.air, name).default)
    if not hasattr(torch.ops.npu, "npu_scatter_nd_update"):
        npu = torch.library.Library("npu", "FRAGMENT")  # noqa: TOR901
        _state["libs"].append(npu)
        for name in NPU_OPS:
            npu.define(_schema(manifest, f"npu::{name}"))
            npu.impl(name, _CPU_KERNELS[name], "CompositeExplicitAutograd")
            npu.impl(name, _META_KERNELS.get(name, _CPU_KERNELS[name]), "Meta")
        npu.impl("npu_scatter_nd_update_", _functionalize_via("npu_scatter_nd_update", (0,)), "Functionalize")
        npu.impl("npu_scatter_pa_kv_cache",
                 _functionalize_via("npu_scatter_pa_kv_cache_functional", (2, 3)), "Functionalize")
        # the pa kv cache write returns nothing: keep it from being dead-code eliminated when traced eagerly
        has_side_effect(torch.ops.npu.npu_scatter_pa_kv_cache.default)


# --------------------------------------------------------------------------- fake torchair
class _Scope:
    """Context manager emitting air.scope_enter / air.scope_exit, as torchair.scope does."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    def __enter__(self):
        return torch.ops.air.scope_enter(self.keys, self.values)

    def __exit__(self, *exc):
        torch.ops.air.scope_exit()
        return False


def _npu_stream_switch(stream_tag: str, stream_priority: int = 0, enable_inner_parallel: bool = True):
    return _Scope(["_user_stream_label", "_user_stream_priority", "_enable_inner_parallel"],
                  [stream_tag, str(stream_priority), str(enable_inner_parallel)])


def _npu_wait_tensor(self, dependency):
    return torch.ops.air.wait_tensor(self, dependency)


def _record():
    return torch.ops.air.record()


def _wait(tensors: list):
    if not tensors:
        raise ValueError("torchair.ops.wait() requires at least one tensor input")
    return torch.ops.air.wait(tensors)


@dataclass(frozen=True)
class StandinTaggedEvent:
    """Stand-in for the torch.npu.Event that torchair.ops.npu_create_tagged_event returns."""
    tag: str


_TAGS: dict[str, StandinTaggedEvent] = {}


def _npu_create_tagged_event(tag: str):
    if tag in _TAGS:  # torchair raises the same error for a reused tag
        raise ValueError(f"tagged event tag {tag} is already in use")
    _TAGS[tag] = StandinTaggedEvent(tag)
    return _TAGS[tag]


def _npu_tagged_event_record(event):
    return torch.ops.air.tagged_event_record(event.tag)


def _npu_tagged_event_wait(event):
    return torch.ops.air.tagged_event_wait(event.tag)


def _npu_record_tagged_stream(input, tagged_stream: str):
    return torch.ops.air.record_tagged_stream_(input, tagged_stream)


class _Option:
    def __init__(self, default, choices):
        self.value, self.choices = default, choices


class CompilerConfig:
    """Stand-in: only ``mode`` (and a ``debug`` namespace) -- the options graphgen sets."""

    def __init__(self):
        object.__setattr__(self, "mode", _Option("max-autotune", ["max-autotune", "reduce-overhead", "npugraph_ex"]))
        object.__setattr__(self, "debug", types.SimpleNamespace(graph_dump=types.SimpleNamespace(type=None)))

    def __setattr__(self, name, value):
        # torchair's config objects accept `cfg.mode = "reduce-overhead"` and validate it.
        if name == "mode":
            if value not in self.mode.choices:
                raise ValueError(f"mode must be one of {self.mode.choices}, got {value!r}")
            self.mode.value = value
        else:
            object.__setattr__(self, name, value)


@dataclass
class CapturedGraph:
    """One compiled graph: the raw post-AOT forward and the graph after the modelled torchair passes."""
    mode: str
    raw: torch.fx.GraphModule        # exactly what AOT autograd handed to the compiler
    gm: torch.fx.GraphModule         # after modelled torchair re-inplacing (what would be lowered)
    example_inputs: list
    reinplaced: list = field(default_factory=list)

    def placeholder_for(self, tensor: torch.Tensor, graph: str = "gm") -> str:
        """Name of the graph input that receives ``tensor`` (matched by identity/storage)."""
        g = getattr(self, graph)
        phs = [n for n in g.graph.nodes if n.op == "placeholder"]
        for n, ex in zip(phs, self.example_inputs):
            if ex is tensor or (isinstance(ex, torch.Tensor) and ex.data_ptr() == tensor.data_ptr()
                                and ex.shape == tensor.shape):
                return n.name
        raise KeyError("tensor is not an input of this graph")


class StandinBackend:
    """torch.compile backend: AOT autograd as torchair calls it, then the modelled re-inplace.

    torchair (npu_fx_compiler.py::_compile_graph_with_aot) calls ``aot_module_simplified`` with
    ``keep_inference_input_mutations=True`` (experimental_config default), so graph-input writes
    come back as trailing ``aten.copy_`` nodes.  Both graphs are captured for inspection.
    """

    def __init__(self, compiler_config=None, custom_decompositions=None):
        self.config = compiler_config or CompilerConfig()
        self.decompositions = dict(custom_decompositions or {})
        self.graphs: list[CapturedGraph] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified
        from graphgen.npu.aotcheck import model_torchair_reinplace

        mode = self.config.mode.value

        def fw_compiler(aot_gm: torch.fx.GraphModule, inputs):
            raw = copy.deepcopy(aot_gm)
            done = model_torchair_reinplace(aot_gm, mode)
            self.graphs.append(CapturedGraph(mode, raw, aot_gm, list(example_inputs), done))
            return aot_gm.forward

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler,
                                     inference_compiler=fw_compiler, keep_inference_input_mutations=True,
                                     decompositions=self.decompositions)


def _get_npu_backend(*, compiler_config=None, custom_decompositions=None):
    return StandinBackend(compiler_config, custom_decompositions)


def _cache_compile(func, *, config=None, dynamic=True, cache_dir=None, global_rank=None, tp_rank=None,
                   pp_rank=None, **kwargs):
    # Pass-through: the stand-in has no disk cache.
    return func


def _build_modules() -> dict[str, types.ModuleType]:
    def mod(name, doc, **attrs):
        m = types.ModuleType(name, doc)
        m.__file__ = STANDIN_LABEL
        m.__graphgen_standin__ = True
        for k, v in attrs.items():
            setattr(m, k, v)
        return m

    doc = "CPU STAND-IN for torchair (graphgen.npu.standin): graph structure and wiring checks only, not NPU behaviour."
    scope = mod("torchair.scope", doc, npu_stream_switch=_npu_stream_switch, npu_wait_tensor=_npu_wait_tensor)
    ops = mod("torchair.ops", doc, record=_record, wait=_wait, npu_create_tagged_event=_npu_create_tagged_event,
              npu_tagged_event_record=_npu_tagged_event_record, npu_tagged_event_wait=_npu_tagged_event_wait,
              npu_record_tagged_stream=_npu_record_tagged_stream)
    inference = mod("torchair.inference", doc, cache_compile=_cache_compile)
    torchair = mod("torchair", doc, scope=scope, ops=ops, inference=inference, CompilerConfig=CompilerConfig,
                   get_npu_backend=_get_npu_backend)
    tn_doc = "CPU STAND-IN for torch_npu (graphgen.npu.standin): torch_npu.<op> -> torch.ops.npu.<op>."
    torch_npu = mod("torch_npu", tn_doc, **{n: getattr(torch.ops.npu, n) for n in NPU_OPS})
    return {"torchair": torchair, "torchair.scope": scope, "torchair.ops": ops,
            "torchair.inference": inference, "torch_npu": torch_npu}


def install() -> bool:
    """Install the stand-in; returns False (and does nothing) when torch_npu is installed."""
    if torch_npu_available():
        return False
    if _state["installed"]:
        if _state.get("modules"):
            sys.modules.update(_state["modules"])  # re-insert after uninstall(); ops stay registered
        return True
    manifest = json.loads(_MANIFEST.read_text())
    _register_ops(manifest)
    mods = _build_modules()
    _state["modules"] = mods
    for name, m in mods.items():
        existing = sys.modules.get(name)
        if existing is not None and not getattr(existing, "__graphgen_standin__", False):
            raise RuntimeError(f"a real {name} module is already imported; refusing to shadow it")
        sys.modules[name] = m
    _state["installed"] = True
    return True


def uninstall() -> None:
    """Remove the fake ``torchair``/``torch_npu`` modules from ``sys.modules`` (the registered ops stay).

    Other libraries probe ``importlib.util.find_spec("torch_npu")`` (transformers does): a stand-in
    left in ``sys.modules`` would make them fail or, worse, believe an NPU is present."""
    for name, m in (_state.get("modules") or {}).items():
        if sys.modules.get(name) is m:
            del sys.modules[name]


def is_standin(module) -> bool:
    return bool(getattr(module, "__graphgen_standin__", False))


@contextlib.contextmanager
def fresh_tags():
    """Tagged-event tags are process-global (as in torchair); tests use this to start clean."""
    saved = dict(_TAGS)
    _TAGS.clear()
    try:
        yield
    finally:
        _TAGS.clear()
        _TAGS.update(saved)
