"""CPU STAND-IN additions for the MLA-by-phase lowering -- wiring and documented limits, never NPU behaviour.

The stand-in's ``npu_fused_infer_attention_score`` (graphgen.npu.standin) models the PAGED TND form
only.  The DeepSeek prefill/splitfuse lowering now calls the kernel's NON-PAGED TND form on
up-projected K/V (graphgen.lower.npu_helpers._mla_unabsorbed), and decode keeps the absorbed form
with ``query_rope``.  This module extends the kernel with:

* non-paged TND (no ``block_table``): query [T, N, Dq], key [S, N, Dk], value [S, N, Dv], BOTH
  ``actual_seq_lengths`` and ``actual_seq_lengths_kv`` cumulative, sparse_mode 0 (no mask) or 3
  (right-down causal, the 2048x2048 mask).  Refused, as documented for query D != 512 without
  query_rope (torch-npu 2.14.0 _op_plugin_docs.py:8730-8737; op-plugin
  docs/context/torch_npu-npu_fused_infer_attention_score.md, "当query的d不等于512时"): Q_D = K_D != 192,
  V_D not in 128/192, Q_N, K_N, V_N unequal, a dtype other than bfloat16, more than 4096 sequences;
* absorbed MLA (``query_rope`` given): more than 16 query tokens in a sequence is refused
  (_op_plugin_docs.py:8174-8176, v2 :8722-8724: "支持query每个batch的s为1-16") -- the stand-in would
  have caught the old lowering, which ran prefill chunks through this form.

Everything else is delegated to the stand-in's kernel.  ``install()`` registers the extended kernel
over the stand-in's (``torch.library`` override); the coordinator may instead merge ``fia`` into
``standin._CPU_KERNELS`` / ``_META_KERNELS`` (then ``install`` becomes ``standin.install``).
"""
from __future__ import annotations

import torch

from . import standin

_state: dict = {"lib": None}
MLA_ABSORBED_MAX_QUERY = 16
NON_PAGED_QK_D = 192
NON_PAGED_V_D = (128, 192)
MAX_SEQUENCES = 4096


def _lengths(cum) -> list[int]:
    cum = [int(x) for x in (cum or [])]
    if not cum or any(b < a for a, b in zip([0] + cum, cum)):
        raise ValueError(f"TND needs non-decreasing cumulative lengths, got {cum}")
    return [b - a for a, b in zip([0] + cum, cum)]


def _check_absorbed(query, kw) -> None:
    q_lens = _lengths(kw.get("actual_seq_lengths"))
    longest = max(q_lens)
    if longest > MLA_ABSORBED_MAX_QUERY:
        raise ValueError(f"npu_fused_infer_attention_score with query_rope (absorbed MLA): {longest} query tokens "
                         f"in one sequence; documented for 1-{MLA_ABSORBED_MAX_QUERY} (_op_plugin_docs.py:8174-8176)")


def _non_paged_tnd(query, key, value, **kw):
    if kw.get("query_rope") is not None or kw.get("key_rope") is not None:
        raise NotImplementedError("stand-in models non-paged TND without query_rope/key_rope only")
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"non-paged TND: query/key/value must be [T, N, D]; got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    n = int(kw.get("num_heads", 1))
    nkv = int(kw.get("num_key_value_heads", 0)) or n
    if not (query.shape[1] == key.shape[1] == value.shape[1] == n == nkv):
        raise ValueError(f"non-paged TND (query D != 512): Q_N, K_N, V_N must be equal (num_heads={n}, "
                         f"num_key_value_heads={nkv}, shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}) (_op_plugin_docs.py:8730)")
    if query.shape[-1] != NON_PAGED_QK_D or key.shape[-1] != NON_PAGED_QK_D or value.shape[-1] not in NON_PAGED_V_D:
        raise ValueError(f"non-paged TND without query_rope: Q_D = K_D = {NON_PAGED_QK_D} and V_D in {NON_PAGED_V_D} "
                         f"are documented; got {query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]} "
                         f"(_op_plugin_docs.py:8730)")
    if not (query.dtype == key.dtype == value.dtype == torch.bfloat16):
        raise ValueError(f"non-paged TND (query D != 512): bfloat16 only, got {query.dtype}, {key.dtype}, "
                         f"{value.dtype} (_op_plugin_docs.py:8730)")
    q_lens, kv_lens = _lengths(kw.get("actual_seq_lengths")), _lengths(kw.get("actual_seq_lengths_kv"))
    if len(q_lens) != len(kv_lens) or len(q_lens) > MAX_SEQUENCES:
        raise ValueError(f"actual_seq_lengths/_kv: {len(q_lens)} and {len(kv_lens)} sequences (equal, <= 4096)")
    if sum(q_lens) > query.shape[0] or sum(kv_lens) > key.shape[0]:
        raise ValueError("cumulative lengths exceed the query/key token count")
    mode, mask = int(kw.get("sparse_mode", 0)), kw.get("atten_mask")
    if mode == 3:
        causal = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=query.device), 1)
        if mask is None or mask.shape[-2:] != (2048, 2048) or not torch.equal(mask.reshape(2048, 2048).bool(), causal):
            raise ValueError("sparse_mode=3 needs the compressed 2048x2048 causal atten_mask")
    elif mode != 0 or mask is not None:
        raise NotImplementedError("stand-in models sparse_mode 0 without a mask or 3 with the causal mask only")
    scale = float(kw.get("scale", 1.0))
    out = query.new_zeros(query.shape[0], n, value.shape[-1])
    qs = ks = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        if q_len:
            if mode == 3 and kv_len < q_len:
                raise ValueError(f"sparse_mode=3: a sequence has {q_len} queries but {kv_len} keys")
            q, k, v = (t.float() for t in (query[qs:qs + q_len], key[ks:ks + kv_len], value[ks:ks + kv_len]))
            scores = torch.einsum("qnd,snd->nqs", q, k) * scale
            if mode == 3:  # right-down causal: query i sees key j iff j <= kv_len - q_len + i
                seen = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
                scores = scores.masked_fill(~seen, float("-inf"))
            out[qs:qs + q_len] = torch.einsum("nqs,snd->qnd", torch.softmax(scores, dim=-1), v).to(out.dtype)
        qs, ks = qs + q_len, ks + kv_len
    return out, torch.zeros(1, dtype=torch.float32, device=query.device)


def fia(query, key, value, **kw):
    """The stand-in's fused_infer_attention_score plus the non-paged TND form and the absorbed-MLA
    query-length limit (see the module docstring)."""
    if kw.get("input_layout", "BSH") == "TND" and kw.get("block_table") is None:
        return _non_paged_tnd(query, key, value, **kw)
    if kw.get("query_rope") is not None:
        _check_absorbed(query, kw)
    return standin._fia(query, key, value, **kw)


def fia_meta(query, key, value, **kw):
    if kw.get("input_layout", "BSH") == "TND" and kw.get("block_table") is None:
        return query.new_empty(query.shape[0], query.shape[1], value.shape[-1]), query.new_empty(1, dtype=torch.float32)
    if kw.get("query_rope") is not None:
        _check_absorbed(query, kw)
    return standin._fia_meta(query, key, value, **kw)


def install() -> bool:
    """``standin.install()``, then the extended attention kernel over the stand-in's (CPU and Meta)."""
    if not standin.install():
        return False
    if _state["lib"] is None:
        lib = torch.library.Library("npu", "IMPL")  # noqa: TOR901
        lib.impl("npu_fused_infer_attention_score", fia, "CompositeExplicitAutograd", allow_override=True)
        lib.impl("npu_fused_infer_attention_score", fia_meta, "Meta", allow_override=True)
        _state["lib"] = lib
    return True
