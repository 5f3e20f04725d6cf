"""CPU and meta reference kernels of ``npu_fused_infer_attention_score`` (v1: paged TND, non-paged TND) and
``npu_fused_infer_attention_score_v2`` (BSH/BNSD page attention, one token per sequence: the static decode graph).

Written from the torch-npu 2.14.0 wheel's kernel docs (``torch_npu/_op_plugin_docs.py``), NOT from
``graphgen/runtime/core/ops.py`` (see ``graphgen.npu.standin.kernels``, which registers them).  Plain torch;
the documented limits are rows of ``graphgen/npu/check/limits.py``, checked before these run.  Nothing here
runs on an NPU.

Each form's contract (layouts, head counts, length lists, sparse mode) is checked by one function that reads
shapes and Python ints only (``_*_contract``): the CPU kernel and the meta kernel both call it, so a shapes-only
run (``graphgen.npu.run.bucketing.run_standin_loop`` on meta tensors) checks what a CPU run checks, except what
needs tensor values (block ids in range, the causal mask's content: CPU only).  Ints are read through
``limits.value`` (a SymInt's hint) so a check made while Dynamo traces installs no guard.
"""
from __future__ import annotations

import weakref

import torch

from ..check.limits import value as _int

_MASK_SIZE = 2048
# fused_infer_attention_score features the templates never use: a non-default value is refused rather
# than silently ignored (the stand-in would then compute something the kernel does not).
_FIA_UNMODELLED = ("pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
                   "antiquant_scale", "antiquant_offset", "key_antiquant_scale", "key_antiquant_offset",
                   "value_antiquant_scale", "value_antiquant_offset", "query_padding_size", "kv_padding_size",
                   "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len", "key_rope_antiquant_scale")


def _causal_mask_checked(mask) -> None:
    """Refuse a sparse_mode=3 mask that is not the causal one (True above the diagonal).  Reads the mask's
    values: CPU kernels only.  The reference is built once per device, and a mask already found causal is
    not compared again until it is written (its version counter moves): the runner passes one shared mask
    to every attention call of every step (``graphgen.npu.run.inputs.causal_mask``)."""
    seen = _VERIFIED_MASKS.get(id(mask))
    if seen is not None and seen[0]() is mask and seen[1] == mask._version:
        return
    ref = _CAUSAL.get(mask.device)
    if ref is None:
        ref = _CAUSAL.setdefault(mask.device, torch.triu(torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool,
                                                                    device=mask.device), 1))
    if not torch.equal(mask.reshape(_MASK_SIZE, _MASK_SIZE).bool(), ref):
        raise ValueError("sparse_mode=3: atten_mask must be the causal mask (True above the diagonal)")
    key = id(mask)

    def forget(ref, key=key):
        if _VERIFIED_MASKS.get(key, (None,))[0] is ref:
            del _VERIFIED_MASKS[key]

    _VERIFIED_MASKS[key] = (weakref.ref(mask, forget), mask._version)


_CAUSAL: dict = {}  # device -> the causal reference
# id(mask) -> (a weak reference to it, its version counter when found causal); a tensor's == is elementwise,
# so a WeakKeyDictionary cannot hold tensors
_VERIFIED_MASKS: dict = {}


def _fia_dims(query, key, value, kw):
    n = int(kw.get("num_heads", 1))
    nkv = int(kw.get("num_key_value_heads", 0)) or n  # 0: as many kv heads as query heads
    if kw.get("input_layout", "BSH") != "TND" or kw.get("block_table") is None:
        raise NotImplementedError("stand-in npu_fused_infer_attention_score models input_layout='TND' with "
                                  "page attention (block_table, block_size) only")
    if key.dim() != 3 or value.dim() != 3:
        raise NotImplementedError("stand-in page attention models the (blocknum, blocksize, H) cache layout only")
    if query.dim() != 3 or _int(query.shape[1]) != n or n % nkv:
        raise ValueError(f"TND query must be [T, num_heads={n}, D] with num_heads a multiple of "
                         f"num_key_value_heads={nkv}; got {tuple(query.shape)}")
    hk, hv = _int(key.shape[-1]), _int(value.shape[-1])
    if hk % nkv or hv % nkv:
        raise ValueError(f"cache H ({hk}, {hv}) is not a multiple of num_key_value_heads {nkv}")
    return n, nkv, hk // nkv, hv // nkv


# ---- the non-paged TND form (DeepSeek prefill/splitfuse, un-absorbed MLA on up-projected K/V) -------
# Documented for query D != 512 without query_rope (torch-npu 2.14.0 _op_plugin_docs.py:8730-8737;
# op-plugin docs "当query的d不等于512时"): Q_D = K_D = 192, V_D 128/192, Q_N = K_N = V_N, bfloat16
# only, both length lists cumulative, sparse_mode 0 or 3 with the 2048x2048 causal mask.  The absorbed
# form (query_rope) keeps its 1-16 query tokens per sequence (:8174-8176, v2 :8722-8724).
MAX_SEQUENCES = 4096


def _lengths(cum) -> list[int]:
    cum = [_int(x) for x in (cum or [])]
    if not cum or any(b < a for a, b in zip([0] + cum, cum)):
        raise ValueError(f"TND needs non-decreasing cumulative lengths, got {cum}")
    return [b - a for a, b in zip([0] + cum, cum)]


def _non_paged_contract(query, key, value, kw):
    """(num_heads, query lengths, kv lengths, sparse mode) of a valid non-paged TND call; raises otherwise."""
    if kw.get("query_rope") is not None or kw.get("key_rope") is not None:
        raise NotImplementedError("stand-in models non-paged TND without query_rope/key_rope only")
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"non-paged TND: query/key/value must be [T, N, D]; got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    # dtype, head dims and head counts: limits.py rows fia.dense.* (checked before this kernel runs)
    n = int(kw.get("num_heads", 1))
    q_lens, kv_lens = _lengths(kw.get("actual_seq_lengths")), _lengths(kw.get("actual_seq_lengths_kv"))
    if len(q_lens) != len(kv_lens) or len(q_lens) > MAX_SEQUENCES:
        raise ValueError(f"actual_seq_lengths/_kv: {len(q_lens)} and {len(kv_lens)} sequences (equal, <= 4096)")
    if sum(q_lens) > _int(query.shape[0]) or sum(kv_lens) > _int(key.shape[0]):
        raise ValueError("cumulative lengths exceed the query/key token count")
    mode, mask = int(kw.get("sparse_mode", 0)), kw.get("atten_mask")
    if mode == 3:
        if mask is None or tuple(_int(d) for d in mask.shape[-2:]) != (_MASK_SIZE, _MASK_SIZE):
            raise ValueError("sparse_mode=3 needs the compressed 2048x2048 causal atten_mask")
        short = next(((q, kv) for q, kv in zip(q_lens, kv_lens) if q and kv < q), None)
        if short:
            raise ValueError(f"sparse_mode=3: a sequence has {short[0]} queries but {short[1]} keys")
    elif mode != 0 or mask is not None:
        raise NotImplementedError("stand-in models sparse_mode 0 without a mask or 3 with the causal mask only")
    return n, q_lens, kv_lens, mode


def _non_paged_tnd(query, key, value, **kw):
    n, q_lens, kv_lens, mode = _non_paged_contract(query, key, value, kw)
    if mode == 3:
        try:
            _causal_mask_checked(kw["atten_mask"])
        except ValueError:
            raise ValueError("sparse_mode=3 needs the compressed 2048x2048 causal atten_mask") from None
    scale = float(kw.get("scale", 1.0))
    out = query.new_zeros(query.shape[0], n, value.shape[-1])
    qs = ks = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        if q_len:
            q, k, v = (t.float() for t in (query[qs:qs + q_len], key[ks:ks + kv_len], value[ks:ks + kv_len]))
            scores = torch.einsum("qnd,snd->nqs", q, k) * scale
            if mode == 3:  # right-down causal: query i sees key j iff j <= kv_len - q_len + i
                seen = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
                scores = scores.masked_fill(~seen, float("-inf"))
            out[qs:qs + q_len] = torch.einsum("nqs,snd->qnd", torch.softmax(scores, dim=-1), v).to(out.dtype)
        qs, ks = qs + q_len, ks + kv_len
    return out, torch.zeros(1, dtype=torch.float32, device=query.device)


def _fia(query, key, value, **kw):
    if kw.get("input_layout", "BSH") == "TND" and kw.get("block_table") is None:
        return _non_paged_tnd(query, key, value, **kw)
    return _fia_paged(query, key, value, **kw)


def _fia_paged(query, key, value, **kw):
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
    n, nkv, dk, dv, cum, kv_lens, mode = _paged_contract(query, key, value, kw)
    q_rope, k_rope, table, bs = kw.get("query_rope"), kw.get("key_rope"), kw["block_table"], int(kw["block_size"])
    if mode == 3:
        _causal_mask_checked(kw["atten_mask"])
    scale = float(kw.get("scale", 1.0))
    rep = n // nkv
    nblocks = key.shape[0]
    out = query.new_zeros(query.shape[0], n, dv)
    start = 0
    for b, (end, kv_len) in enumerate(zip(cum, kv_lens)):
        q_len = end - start
        if q_len == 0:
            continue
        need = (kv_len + bs - 1) // bs
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


def _paged_contract(query, key, value, kw):
    """(n, nkv, dk, dv, cumulative query lengths, kv lengths, sparse mode) of a valid paged TND call, from
    shapes and ints only (block ids and the mask's content are the CPU kernel's); raises otherwise."""
    for name in _FIA_UNMODELLED:
        if kw.get(name) is not None:
            raise NotImplementedError(f"stand-in npu_fused_infer_attention_score does not model {name}")
    if kw.get("softmax_lse_flag", False):
        raise NotImplementedError("stand-in npu_fused_infer_attention_score does not model softmax_lse_flag=True")
    n, nkv, dk, dv = _fia_dims(query, key, value, kw)
    if (kw.get("query_rope") is None) != (kw.get("key_rope") is None):
        raise ValueError("query_rope and key_rope must be given together")
    if _int(query.shape[-1]) != dk:
        raise ValueError(f"query D {query.shape[-1]} != key D {dk}")
    table = kw["block_table"]
    if table.dtype != torch.int32 or table.dim() != 2:
        raise ValueError(f"block_table must be a 2-D int32 tensor, got {table.dtype} {tuple(table.shape)}")
    bs, cols = int(kw.get("block_size", 0)), _int(table.shape[1])
    if bs != _int(key.shape[1]):
        raise ValueError(f"block_size {bs} != the cache's block size {key.shape[1]}")
    cum = [_int(x) for x in (kw.get("actual_seq_lengths") or [])]
    kv_lens = [_int(x) for x in (kw.get("actual_seq_lengths_kv") or [])]
    nb = len(cum)
    if nb == 0 or len(kv_lens) != nb or _int(table.shape[0]) != nb:
        raise ValueError(f"TND needs actual_seq_lengths (len B) and actual_seq_lengths_kv (len B) matching "
                         f"block_table's B: {len(cum)}, {len(kv_lens)}, {table.shape[0]}")
    if cum[-1] > _int(query.shape[0]) or any(b < a for a, b in zip([0] + cum, cum)):
        raise ValueError(f"actual_seq_lengths must be non-decreasing cumulative lengths <= T, got {cum}")
    mode, mask = int(kw.get("sparse_mode", 0)), kw.get("atten_mask")
    if mode == 3:
        if mask is None or _int(mask.numel()) != _MASK_SIZE * _MASK_SIZE or _int(mask.shape[-1]) != _MASK_SIZE:
            raise ValueError("sparse_mode=3 needs the compressed 2048x2048 atten_mask")
    elif mode == 0:
        if mask is not None:
            raise NotImplementedError("stand-in models sparse_mode=0 without atten_mask only")
    else:
        raise NotImplementedError(f"stand-in models sparse_mode 0 and 3 only, got {mode}")
    for b, (start, end, kv_len) in enumerate(zip([0] + cum, cum, kv_lens)):
        q_len = end - start
        if q_len and kv_len < (q_len if mode == 3 else 1):
            raise ValueError(f"sequence {b}: actual_seq_lengths_kv {kv_len} too short for {q_len} queries")
        if q_len and (kv_len + bs - 1) // bs > cols:
            raise ValueError(f"sequence {b}: {(kv_len + bs - 1) // bs} blocks needed, block_table has {cols} columns")
    return n, nkv, dk, dv, cum, kv_lens, mode


def _fia_meta(query, key, value, **kw):
    if kw.get("input_layout", "BSH") == "TND" and kw.get("block_table") is None:
        _non_paged_contract(query, key, value, kw)
        return query.new_empty(query.shape[0], query.shape[1], value.shape[-1]), query.new_empty(1, dtype=torch.float32)
    return _fia_paged_meta(query, key, value, **kw)


def _fia_paged_meta(query, key, value, **kw):
    n, _, _, dv, *_ = _paged_contract(query, key, value, kw)
    return query.new_empty(query.shape[0], n, dv), query.new_empty(1, dtype=torch.float32)


# ---- npu_fused_infer_attention_score_v2: the static decode graph's attention (BSH / BNSD, page attention, one
# query token per sequence).  Written from the v2 doc (torch-npu 2.14.0 _op_plugin_docs.py:8577-8823), the same
# reading the decode emitters were written from: it proves the wiring (layouts, heads, block tables, lengths),
# not the kernel's meaning.  What the decode graph does not use is refused, not ignored.
_FIA2_UNMODELLED = ("pse_shift", "dequant_scale_query", "dequant_scale_key", "dequant_offset_key",
                    "dequant_scale_value", "dequant_offset_value", "dequant_scale_key_rope", "quant_scale_out",
                    "quant_offset_out", "quant_scale_p", "learnable_sink", "query_dtype", "key_dtype", "value_dtype",
                    "query_rope_dtype", "key_rope_dtype", "out_dtype")


def _v2_decode_as_paged(query, key, value, kw):
    """The v2 page-attention call restated in the paged-TND terms of :func:`_fia_paged` (same formula, :8581):
    query BSH (B, S, N*D) or BNSD (B, N, S, D) -> [B*S, N, D] with cumulative lengths S, 2S, .., B*S (S query
    tokens per sequence: 1 in decode, K + 1 in a speculative verify row, whose sparse_mode 3 mask the TND
    kernel applies as for any multi-token row); cache (blocknum, blocksize, KV_N*D) as is, or BNSD's
    (blocknum, KV_N, blocksize, D) -> the former."""
    for name in _FIA2_UNMODELLED:
        if kw.get(name) is not None:
            raise NotImplementedError(f"stand-in npu_fused_infer_attention_score_v2 does not model {name}")
    if kw.get("return_softmax_lse", False):
        raise NotImplementedError("stand-in npu_fused_infer_attention_score_v2 does not model return_softmax_lse")
    layout, n = kw.get("input_layout", "BSH"), int(kw.get("num_query_heads", 1))
    nkv = int(kw.get("num_key_value_heads", 0)) or n
    if layout not in ("BSH", "BNSD") or kw.get("block_table") is None:
        raise NotImplementedError("stand-in npu_fused_infer_attention_score_v2 models BSH/BNSD page attention only")
    if layout == "BSH":
        if query.dim() != 3 or query.shape[2] % n:
            raise ValueError(f"BSH query must be (B, S, H = N*D); got {tuple(query.shape)} with N={n}")
        b, s = query.shape[0], query.shape[1]
        q = query.reshape(b, s, n, query.shape[2] // n)
        if key.dim() != 3:  # :8822: BSH/BSND take the (blocknum, blocksize, H) cache only
            raise ValueError("BSH page attention takes the (blocknum, blocksize, H) cache layout only")
    else:
        if query.dim() != 4 or query.shape[1] != n:  # :8626: num_query_heads equals the query's N axis (BNSD)
            raise ValueError(f"BNSD query must be (B, N={n}, S, D); got {tuple(query.shape)}")
        b, s = query.shape[0], query.shape[2]
        q = query.transpose(1, 2)

    def paged3(cache):
        if cache is None or cache.dim() == 3:
            return cache
        if cache.dim() != 4 or cache.shape[1] != nkv:
            raise ValueError(f"BNSD cache must be (blocknum, KV_N={nkv}, blocksize, D); got {tuple(cache.shape)}")
        return cache.transpose(1, 2).reshape(cache.shape[0], cache.shape[2], -1)

    rope = kw.get("query_rope")
    q_rope = None if rope is None else (rope.reshape(b, s, n, -1) if layout == "BSH" else rope.transpose(1, 2))
    v1 = {"num_heads": n, "num_key_value_heads": nkv, "scale": kw.get("softmax_scale", 1.0), "input_layout": "TND",
          "block_table": kw["block_table"], "block_size": kw.get("block_size", 0), "sparse_mode": kw.get("sparse_mode", 0),
          "atten_mask": kw.get("atten_mask"), "actual_seq_lengths": list(range(s, b * s + 1, s)),
          "actual_seq_lengths_kv": kw.get("actual_seq_kvlen"),
          "query_rope": None if q_rope is None else q_rope.reshape(b * s, n, -1), "key_rope": paged3(kw.get("key_rope"))}
    if v1["actual_seq_lengths_kv"] is None:  # :8779: page attention needs actual_seq_kvlen
        raise ValueError("page attention needs actual_seq_kvlen")
    return q.reshape(b * s, n, -1), paged3(key), paged3(value), v1, (layout, b, s)


def _v2_out(out, shape):
    """[B*S, N, Dv] -> the query's layout with value's D (attention_out, :8677)."""
    layout, b, s = shape
    out = out.reshape(b, s, *out.shape[1:])
    return out.reshape(b, s, -1) if layout == "BSH" else out.transpose(1, 2)


def _fia_v2(query, key, value, **kw):
    q, k, v, v1, shape = _v2_decode_as_paged(query, key, value, kw)
    out, lse = _fia_paged(q, k, v, **v1)  # [B*S, N, Dv]
    return _v2_out(out, shape), lse


def _fia_v2_meta(query, key, value, **kw):
    q, k, v, v1, shape = _v2_decode_as_paged(query, key, value, kw)
    out, lse = _fia_paged_meta(q, k, v, **v1)
    return _v2_out(out, shape), lse
