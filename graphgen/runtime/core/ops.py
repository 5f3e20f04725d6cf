"""CPU reference ops: the runtime op contract of docs/design.md ("Runtime op contract").

Generated modules call these as ``rt.<op>(...)``; names, argument order and keyword names are the
contract. Everything is pure torch and float32-exact against Hugging Face transformers (the
reference the tests compare with at ``atol=1e-4``).

Batches are token-major and flat: ``T`` new tokens of the step over all ``B`` sequences, the tokens
of sequence ``b`` contiguous and in order, sequences in ``block_tables`` order. The KV cache is
paged: component ``i`` is ``[num_blocks, block_size, *rest]`` and a token's slot is
``block * block_size + offset``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .attention import StepMemo, attend, attend_one, cat_runs, gather_seq, seq_layout, seq_runs, step_plan
from .block_copy import copy_from_blocks, copy_into_blocks
from .matmul import linear as _linear, matmul_t
from ..lora.delta import lora  # noqa: F401 (rt.lora in a module of a spec with a lora: section)
from .quant import w8a8  # noqa: F401 (rt.w8a8 in a W8A8 module: graphgen.lower.cpu_parallel.CPU_PAIR)

Tensor = torch.Tensor

__all__ = [
    "embedding", "rms_norm", "rope_cos_sin", "qwen3_attn_prolog", "kv_write", "paged_attention",
    "o_proj_residual", "swiglu_mlp_residual", "mla_prolog", "mla_attention", "moe_residual",
    "lm_head", "kv_save", "mtp_eh_proj", "w8a8", "lora",
]


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------

# In-place elementwise steps (``add_``/``mul_``/``silu_`` on a buffer the op just made) instead of
# expressions that allocate a new activation per operation: on a long prefill every fresh
# multi-MB buffer is new pages to the C allocator (page faults and zeroing cost more than the
# elementwise op itself, ~5x on a [2048, 1536] silu). Each in-place form computes the same IEEE
# operation on the same operands as transformers' expression (a + b == b + a, a * b == b * a), so
# the results are bit-identical.


def _as_dict(obj) -> Optional[dict]:
    """Accept a plain dict or a spec dataclass (e.g. ``RopeScaling``) for config-like arguments."""
    if obj is None:
        return None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    return dict(obj)


def _rope_type(scaling: Optional[dict]) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default")) or "default"


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    # YaRN's magnitude correction; no correction when the context is not extended.
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _rotate_half_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox/Llama RoPE: the two halves of the last dim form the rotated pairs."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # float32 tables, cast to q/k's dtype as transformers does
    # transformers' x * cos + rotate_half(x) * sin: the same operations, two of them in place (the
    # note under ``_linear``)
    out = x * cos
    return out.add_(torch.cat((-x2, x1), dim=-1).mul_(sin))


_rope_memo = StepMemo()


def _rope_tables(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos`` and the signed ``sin`` (``cat(-sin[:half], sin[half:])``) as ``[T, 1, rot]`` in
    ``dtype``: what `_signed_rope` multiplies with, made once per step (`StepMemo`) for every layer's
    q and k instead of the casts, the negation and the cat of `_rotate_half_rope` per call."""
    def make(cos, sin, dtype):
        half = sin.shape[-1] // 2
        return cos.to(dtype)[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)[:, None, :]
    return _rope_memo.get(make, cos, sin, dtype)


def _signed_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """`_rotate_half_rope` with `_rope_tables`' tables: ``rotate_half(x) * sin`` is
    ``roll(x, half) * signed_sin`` (``-x2 * s == x2 * -s`` exactly), so the result is bit-identical
    in 4 torch calls instead of ~9."""
    out = x * cos
    return out.add_(torch.roll(x, x.shape[-1] // 2, -1).mul_(signed_sin))


def _interleaved_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek RoPE: adjacent pairs (x0,x1),(x2,x3).. rotate together. The output comes out
    de-interleaved (all first elements, then all second elements), which is what transformers
    produces, caches and feeds to the attention; q and k get the same permutation so q.k holds."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]  # cos/sin are cat(freqs, freqs): first half = per pair
    c, s = c.to(x.dtype), s.to(x.dtype)  # float32 tables, cast to q/k's dtype as transformers does
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# --------------------------------------------------------------------------------------------
# the contract
# --------------------------------------------------------------------------------------------

def embedding(weight: Tensor, input_ids: Tensor) -> Tensor:
    return F.embedding(input_ids.long(), weight)


_SMALL = 1 << 16  # elements: a decode batch's activations, where Python calls cost more than memory


def _rms_unit(x: Tensor, eps: float) -> Tensor:
    """`rms_norm` before its weight: transformers' ``x * rsqrt(mean(x^2) + eps)`` (in float32, cast back
    to ``x``'s dtype), so that a caller can apply a different weight to each part of the result (the
    Qwen3 prolog's q and k). Decode-sized float32 inputs take torch's own rms_norm (one call instead of
    five); a long prefill the out-of-place expression (torch.rms_norm allocates its intermediates:
    measured 2-6 % of a 512/2048-token prefill step)."""
    if x.dtype == torch.float32:
        if x.numel() <= _SMALL:
            return torch.rms_norm(x, (x.shape[-1],), None, eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm, ``weight * _rms_unit(x)``, bit-identical to Qwen3RMSNorm
    (tests/runtime/test_ops_vs_hf.py::test_decode_fast_paths_bit_identical_to_transformers)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.numel() <= _SMALL:
        return torch.rms_norm(x, (x.shape[-1],), weight, eps)  # the weight inside torch's one call
    u = _rms_unit(x, eps)
    # in place when u is a float32 buffer of its own (weight * u == u * weight)
    return u.mul_(weight) if u.dtype == weight.dtype == torch.float32 else weight * u


def rope_cos_sin(positions: Tensor, *, rot_dim: int, theta: float,
                 scaling: Optional[dict] = None) -> tuple[Tensor, Tensor]:
    """cos/sin ``[T, rot_dim]`` laid out as ``cat(freqs, freqs)`` (transformers' layout; the
    interleaved RoPE uses the first half). With YaRN both carry the attention factor."""
    if rot_dim % 2:
        raise ValueError(f"rot_dim must be even, got {rot_dim}")
    scaling = _as_dict(scaling)
    exponents = torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim
    pos_freqs = float(theta) ** exponents
    inv_freq = 1.0 / pos_freqs
    attention_factor = 1.0
    kind = _rope_type(scaling)
    if kind == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(pos_freqs, rot_dim, float(theta), scaling)
    elif kind != "default":
        raise NotImplementedError(f"rope scaling type {kind!r} is not implemented (only yarn)")
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def _yarn_inv_freq(pos_freqs: Tensor, dim: int, base: float, scaling: dict) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies by ``factor``, keep high ones, blend linearly between the
    correction dims given by beta_fast/beta_slow rotations over the original context."""
    factor = float(scaling["factor"])
    orig_max = float(scaling["original_max_position_embeddings"])
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    mscale = scaling.get("mscale")
    mscale_all_dim = scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_weight) + inv_extra * extrapolation_weight
    return inv_freq, attention_factor


def qwen3_attn_prolog(x: Tensor, qkv_t: Tensor, q_norm_w: Tensor, k_norm_w: Tensor, cos: Tensor, sin: Tensor,
                      *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v of one attention layer from ``qkv_t`` = ``[q; k; v]`` stored ``[in, out]`` (a load-time
    weight): one matmul; q and k normalised per head together (one norm, each part then times its own
    weight, as transformers' q_norm/k_norm compute) and rotated together (one RoPE). q, k and v are
    views of two tensors, not copies."""
    T, hq, hkv = x.shape[0], num_heads, num_kv_heads
    qkv = matmul_t(x, qkv_t).view(T, hq + 2 * hkv, head_dim)
    qk = _rms_unit(qkv[:, :hq + hkv], eps)
    if q_norm_w.dtype == qk.dtype:  # in place (bit-identical: weight * x == x * weight)
        qk[:, :hq].mul_(q_norm_w)
        qk[:, hq:].mul_(k_norm_w)
    else:
        qk = torch.cat((q_norm_w * qk[:, :hq], k_norm_w * qk[:, hq:]), 1)
    c, s = _rope_tables(cos, sin, qk.dtype)
    qk = _signed_rope(qk, c, s)
    return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]


_slots_memo = StepMemo()


def kv_write(cache: Sequence[Tensor], values: Sequence[Tensor], slot_mapping: Tensor) -> None:
    if len(cache) != len(values):
        raise ValueError(f"cache has {len(cache)} components but {len(values)} values were given")
    slots = _slots_memo.get(Tensor.long, slot_mapping)  # every layer's slots: one int64 copy a step
    for c, v in zip(cache, values):
        if tuple(c.shape[2:]) != tuple(v.shape[1:]):
            raise ValueError(f"kv_write: cache entry shape {tuple(c.shape[2:])} != value shape {tuple(v.shape[1:])}")
        # a view of the contiguous cache, so index_copy_ writes the cache itself;
        # index_copy_ rejects out-of-range (incl. negative) slots instead of wrapping around.
        flat = c.view(c.shape[0] * c.shape[1], *c.shape[2:])
        flat.index_copy_(0, slots, v if v.dtype == c.dtype else v.to(c.dtype))


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)  # no dispatch when the cache already has q's dtype


def paged_attention(q: Tensor, cache: Sequence[Tensor], block_tables: Tensor, seq_lens: Tensor,
                    query_lens: Tensor, *, scale: float) -> Tensor:
    k_cache, v_cache = cache
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    if Hq % Hkv:
        raise ValueError(f"num_heads {Hq} is not a multiple of num_kv_heads {Hkv}")
    out = q.new_empty(T, Hq, v_cache.shape[-1])
    for b, (start, q_len, seq_len, runs) in enumerate(step_plan(block_tables, seq_lens, query_lens,
                                                                 k_cache.shape[1])):
        if q_len == 0:
            continue
        ks = [_as(k, q.dtype).transpose(0, 1) for k in seq_runs(k_cache, block_tables[b], seq_len, runs)]  # [Hkv, len, D]
        vs = [_as(v, q.dtype).transpose(0, 1) for v in seq_runs(v_cache, block_tables[b], seq_len, runs)]
        qb = q[start:start + q_len].transpose(0, 1)  # [Hq, q, D]; query head h reads kv head h // rep
        # a decode row reads the runs in place; a prompt chunk's attention is matmul-bound, one copy is noise
        o = attend_one(qb, ks, vs, scale) if q_len == 1 else attend(qb, cat_runs(ks, 1), cat_runs(vs, 1), scale)
        out[start:start + q_len] = o.transpose(0, 1)
    return out


def _add_residual(y: Tensor, residual: Tensor) -> Tensor:
    """``residual + y`` into ``y`` (a fresh op output) when the types allow it."""
    if y.dtype == residual.dtype and y.shape == residual.shape:
        return y.add_(residual)
    return residual + y


def o_proj_residual(attn: Tensor, o_t: Tensor, residual: Tensor) -> Tensor:
    """``residual + o_proj(attn)``, ``o_t`` the o_proj weight stored ``[in, out]`` (a load-time weight)."""
    return _add_residual(matmul_t(attn.flatten(1), o_t), residual)


def _swiglu(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    # down(silu(gate(x)) * up(x)) on checkpoint-layout weights (the MoE experts), silu and the product in place
    return _linear(F.silu(_linear(x, gate_w), inplace=True).mul_(_linear(x, up_w)), down_w)


def swiglu_t(x: Tensor, gate_up_t: Tensor, down_t: Tensor) -> Tensor:
    """``down(silu(gate(x)) * up(x))`` with gate/up merged and both weights stored ``[in, out]``
    (load-time weights): two matmuls; silu and the product in place on the gate/up output's halves."""
    gu = matmul_t(x, gate_up_t)
    half = gu.shape[1] // 2
    return matmul_t(F.silu(gu[:, :half], inplace=True).mul_(gu[:, half:]), down_t)


def swiglu_mlp_residual(x: Tensor, gate_up_t: Tensor, down_t: Tensor, residual: Tensor) -> Tensor:
    return _add_residual(swiglu_t(x, gate_up_t, down_t), residual)


def mla_prolog(x: Tensor, q_a_w: Optional[Tensor], q_a_norm_w: Optional[Tensor], q_b_w: Tensor,
               kv_a_w: Tensor, kv_a_norm_w: Tensor, cos: Tensor, sin: Tensor, *, num_heads: int,
               qk_nope_head_dim: int, qk_rope_head_dim: int, kv_lora_rank: int, eps: float,
               interleave: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MLA projections. ``eps`` is the epsilon of the two latent norms (q_a/kv_a_layernorm);
    transformers builds those with the RMSNorm default 1e-6, not ``rms_norm_eps``.
    ``q_a_w=None`` means no query compression (q_lora_rank null): ``q_b_w`` is then q_proj."""
    T = x.shape[0]
    if q_a_w is None:
        q = _linear(x, q_b_w)
    else:
        q = _linear(rms_norm(_linear(x, q_a_w), q_a_norm_w, eps), q_b_w)
    q = q.view(T, num_heads, qk_nope_head_dim + qk_rope_head_dim)
    q_nope, q_pe = q[..., :qk_nope_head_dim], q[..., qk_nope_head_dim:]
    kv = _linear(x, kv_a_w)
    c_kv = rms_norm(kv[:, :kv_lora_rank], kv_a_norm_w, eps)
    k_pe = kv[:, kv_lora_rank:]
    rope = _interleaved_rope if interleave else _rotate_half_rope
    q_pe = rope(q_pe, cos[:, None, :], sin[:, None, :])
    k_pe = rope(k_pe, cos, sin)
    return q_nope.contiguous(), q_pe.contiguous(), c_kv.contiguous(), k_pe.contiguous()


def mla_attention(q_nope: Tensor, q_pe: Tensor, cache: Sequence[Tensor], kv_b_w: Tensor,
                  block_tables: Tensor, seq_lens: Tensor, query_lens: Tensor, *, num_heads: int,
                  qk_nope_head_dim: int, v_head_dim: int, scale: float) -> Tensor:
    """Attention over the compressed cache. K/V are expanded from the latent with kv_b_proj per
    sequence (as transformers does); the RoPE part of the key is shared by all heads."""
    ckv_cache, kpe_cache = cache
    T = q_nope.shape[0]
    out = q_nope.new_empty(T, num_heads, v_head_dim)
    for b, (start, q_len, seq_len) in enumerate(seq_layout(seq_lens, query_lens)):
        if q_len == 0:
            continue
        ckv = gather_seq(ckv_cache, block_tables[b], seq_len).to(q_nope.dtype)  # [S, R]
        kpe = gather_seq(kpe_cache, block_tables[b], seq_len).to(q_nope.dtype)  # [S, r]
        kv = _linear(ckv, kv_b_w).view(seq_len, num_heads, qk_nope_head_dim + v_head_dim)
        # one head of size n + r: [q_nope, q_pe] . [k_nope, k_pe] (the RoPE key shared by all heads)
        k = torch.cat((kv[..., :qk_nope_head_dim], kpe[:, None, :].expand(seq_len, num_heads, kpe.shape[-1])),
                      dim=-1).transpose(0, 1)  # [H, S, n + r]
        v = kv[..., qk_nope_head_dim:].transpose(0, 1)  # [H, S, v]
        qb = torch.cat((q_nope[start:start + q_len], q_pe[start:start + q_len]), dim=-1).transpose(0, 1)
        out[start:start + q_len] = attend(qb, k, v, scale).transpose(0, 1)
    return out


def _route(x: Tensor, router_w: Tensor, e_score_bias: Optional[Tensor], *, top_k: int,
           n_group: int, topk_group: int, routed_scaling_factor: float,
           norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """noaux_tc routing: sigmoid scores; the bias steers only the choice; groups ranked by the
    sum of their top-2 biased scores; top_k experts from the kept groups; weights are the
    unbiased scores, optionally renormalised, times routed_scaling_factor."""
    T = x.shape[0]
    E = router_w.shape[0]
    scores = torch.sigmoid(F.linear(x.float(), router_w.float()))
    choice = scores if e_score_bias is None else scores + e_score_bias.float()
    if n_group > 1 and topk_group < n_group:
        if E % n_group:
            raise ValueError(f"n_routed_experts {E} is not divisible by n_group {n_group}")
        per_group = E // n_group
        grouped = choice.view(T, n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask[:, :, None].expand(T, n_group, per_group).reshape(T, E)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    idx = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, idx)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, weights * routed_scaling_factor


def moe_residual(x: Tensor, router_w: Tensor, e_score_bias: Optional[Tensor], experts_gate: Tensor,
                 experts_up: Tensor, experts_down: Tensor, shared_gate: Optional[Tensor],
                 shared_up: Optional[Tensor], shared_down: Optional[Tensor], residual: Tensor, *,
                 top_k: int, n_group: int, topk_group: int, routed_scaling_factor: float,
                 norm_topk_prob: bool) -> Tensor:
    idx, weights = _route(x, router_w, e_score_bias, top_k=top_k, n_group=n_group,
                          topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
                          norm_topk_prob=norm_topk_prob)
    T, H = x.shape
    routed = torch.zeros_like(x)
    flat_idx = idx.reshape(-1)
    flat_tok = torch.arange(T, device=x.device).repeat_interleave(top_k)
    flat_w = weights.reshape(-1).to(x.dtype)
    # group the (token, slot) pairs by expert with one sort; the loop is over experts, not tokens
    order = torch.argsort(flat_idx, stable=True)
    counts = torch.bincount(flat_idx, minlength=experts_gate.shape[0]).tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start:start + n]
        start += n
        tok = flat_tok[sel]
        y = _swiglu(x[tok], experts_gate[e], experts_up[e], experts_down[e])
        routed.index_add_(0, tok, y * flat_w[sel, None])
    if shared_gate is not None:
        routed = routed + _swiglu(x, shared_gate, shared_up, shared_down)
    return residual + routed


def lm_head(h: Tensor, norm_w: Tensor, eps: float, head_w: Tensor, logits_indices: Tensor) -> Tensor:
    # the final norm is per token, so selecting the rows first gives the same logits, cheaper
    sel = h.index_select(0, logits_indices.long())
    return _linear(rms_norm(sel, norm_w, eps), head_w)


def kv_save(cache: Sequence[Tensor], block_ids: Tensor, staging: Sequence[Tensor]) -> None:
    copy_from_blocks(staging, cache, block_ids)  # runs of consecutive ids as slice copies


def kv_load(cache: Sequence[Tensor], loads: Sequence[Tensor], block_ids: Tensor) -> None:
    """Copy the loaded history blocks (``loads``: one [n, *block shape] tensor per cache component,
    filled by the host from the pool) into cache blocks ``block_ids`` (n of them)."""
    copy_into_blocks(cache, loads, block_ids)  # runs of consecutive ids as slice copies


def mtp_eh_proj(embed: Tensor, hidden: Tensor, enorm_w: Tensor, hnorm_w: Tensor, eh_w: Tensor,
                eps: float) -> Tensor:
    """An MTP layer's input (DeepSeek-V3, transformers' ``MtpLayer``): ``eh_proj`` over
    ``cat[enorm(embedding of token t+1), hnorm(previous hidden state at t)]`` (embedding first)."""
    return _linear(torch.cat((rms_norm(embed, enorm_w, eps), rms_norm(hidden.to(embed.dtype), hnorm_w, eps)),
                             dim=-1), eh_w)
