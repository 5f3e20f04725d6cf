"""Attention over the paged KV cache for the CPU reference ops (`graphgen.runtime.core.ops`):
the per-step sequence layout and block runs, reading a sequence's KV (in place or gathered), and
the attention kernels (torch's fused flash kernel for prompt chunks, batched matmuls for decode rows).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

__all__ = ["StepMemo", "seq_layout", "step_plan", "seq_runs", "gather_seq", "cat_runs", "attend_one", "attend"]


class StepMemo:
    """The last value derived from a step's input tensors, recomputed only when one of them is another
    tensor or was changed in place (its ``_version``): every layer of a step passes the same input
    tensors (block tables, slot mapping, RoPE tables), so what is derived from them is computed once
    per step instead of once per layer. The memo holds the tensors, so an id is never reused while
    it is the key."""

    __slots__ = ("_last",)

    def __init__(self):
        # (key, value) as one tuple: one assignment, so a thread never pairs a key with another's value.
        # The key alternates argument, version: inference tensors (made under torch.inference_mode,
        # e.g. a graph's own RoPE tables) track no version and are keyed by identity alone, which
        # holds for graph values (each is written once).
        self._last: tuple = ((), None)

    def get(self, fn, *args):
        """``fn(*args)``, or the value of the last call when ``args`` are the same objects (tensors at
        the same version; other arguments equal). Plain loops: this runs a few times per layer."""
        key = []
        for a in args:
            if isinstance(a, Tensor):
                key.append(a)
                key.append(-1 if a.is_inference() else a._version)
            else:
                key.append(a)
                key.append(None)
        old, value = self._last
        if len(old) == len(key):
            for x, y in zip(old, key):
                if x is not y and (type(x) is not type(y) or isinstance(x, Tensor) or x != y):
                    break
            else:
                return value
        value = fn(*args)
        self._last = (key, value)
        return value


def seq_layout(seq_lens: Tensor, query_lens: Tensor) -> list[tuple[int, int, int]]:
    """(token offset in the flat batch, query_len, seq_len) per sequence."""
    q_list = [int(v) for v in query_lens.tolist()]
    s_list = [int(v) for v in seq_lens.tolist()]
    if len(q_list) != len(s_list):
        raise ValueError(f"seq_lens has {len(s_list)} sequences but query_lens has {len(q_list)}")
    out, start = [], 0
    for q, s in zip(q_list, s_list):
        if q > s:
            raise ValueError(f"query_len {q} exceeds seq_len {s}")
        out.append((start, q, s))
        start += q
    return out


# at most this many runs of consecutive blocks are attended as views; a more fragmented table is gathered
_MAX_RUNS = 8
_plan_memo = StepMemo()


def _block_runs(table: list[int], seq_len: int, block_size: int) -> Optional[list[tuple[int, int]]]:
    """(first slot, length) per run of consecutive blocks covering the first ``seq_len`` positions,
    or None when the table has more than ``_MAX_RUNS`` runs (then the sequence is gathered)."""
    nblocks = (seq_len + block_size - 1) // block_size
    runs, lo = [], 0
    for i in range(1, nblocks + 1):
        if i == nblocks or table[i] != table[i - 1] + 1:
            runs.append((table[lo] * block_size, min(i * block_size, seq_len) - lo * block_size))
            if len(runs) > _MAX_RUNS:
                return None
            lo = i
    return runs


def step_plan(block_tables: Tensor, seq_lens: Tensor, query_lens: Tensor, block_size: int) -> list:
    """(start, query_len, seq_len, runs) per sequence (`seq_layout` plus `_block_runs`), computed
    once per step (`StepMemo`)."""
    return _plan_memo.get(_step_plan, block_tables, seq_lens, query_lens, block_size)


def _step_plan(block_tables: Tensor, seq_lens: Tensor, query_lens: Tensor, block_size: int) -> list:
    layout = seq_layout(seq_lens, query_lens)
    tables = block_tables.tolist()
    return [(start, q, S, _block_runs(tables[b], S, block_size) if q else None)
            for b, (start, q, S) in enumerate(layout)]


def seq_runs(cache: Tensor, block_table: Tensor, seq_len: int,
              runs: Optional[list[tuple[int, int]]] = ()) -> list[Tensor]:
    """The first ``seq_len`` cached positions of one sequence as views of the cache, one per run of
    consecutive blocks ([len, *rest] each, in order), or one gathered copy when the table has more
    than ``_MAX_RUNS`` runs. A FIFO allocator hands a request long runs, so a decode step reads the
    KV in place instead of copying the sequence's whole KV once per layer. ``runs``: the table's
    `_block_runs` when the caller has them."""
    block_size = cache.shape[1]
    if runs == ():
        runs = _block_runs(block_table.tolist(), seq_len, block_size)
    if runs is None:
        return [gather_seq(cache, block_table, seq_len)]
    flat = cache.view(cache.shape[0] * block_size, *cache.shape[2:])
    return [flat[first:first + n] for first, n in runs]


def gather_seq(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """The first ``seq_len`` cached positions of one sequence, copied: [seq_len, *rest]."""
    block_size = cache.shape[1]
    nblocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:nblocks].long())
    return blocks.reshape(nblocks * block_size, *cache.shape[2:])[:seq_len]


def cat_runs(runs: list[Tensor], dim: int = 0) -> Tensor:
    return runs[0] if len(runs) == 1 else torch.cat(runs, dim=dim)


def _flash_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Fused attention with its log-sum-exp (torch's CPU flash kernel; GQA by head count):
    q [H, q, D], k [Hkv, S, D], v [Hkv, S, D] -> ([H, q, D], [H, q])."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], 0.0, causal, scale=scale)[:2]
    return out[0], lse[0]


def attend_one(q: Tensor, ks: list[Tensor], vs: list[Tensor], scale: float) -> Tensor:
    """One query per head (a decode row) over all S keys, given as runs ``ks``/``vs`` ([Hkv, len,
    D/Dv] each, together the S keys in order): batched matmuls over the KV heads (the query heads of
    one KV head are that matmul's rows; no repeated KV) and one softmax of the [H, S] scores, which
    are small for one query. Measured ~2x faster than the flash kernel for one query at S = 512
    and 2048 on one thread (``benchmarks/bench_cpu_kernels.py``'s decode rows)."""
    Hq, D = q.shape[0], q.shape[-1]
    Hkv = ks[0].shape[0]
    qg = q.reshape(Hkv, Hq // Hkv, D)  # query head h reads kv head h // rep
    # torch.bmm, not matmul: the same kernel without matmul's expand/reshape dispatches (per run, per layer)
    scores = torch.cat([torch.bmm(qg, k.transpose(1, 2)) for k in ks], dim=-1) if len(ks) > 1 \
        else torch.bmm(qg, ks[0].transpose(1, 2))
    probs = torch.softmax(scores.mul_(scale), dim=-1, dtype=torch.float32).to(vs[0].dtype)  # [Hkv, rep, S]
    out, at = None, 0
    for v in vs:
        part = torch.bmm(probs[..., at:at + v.shape[1]], v)
        out = part if out is None else out.add_(part)
        at += v.shape[1]
    return out.reshape(Hq, 1, vs[0].shape[-1])


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of ``q_len`` queries that sit at the last positions of ``S`` keys, fused
    (no [q, S] score matrix, mask or repeated KV is built): q [H, q, D], k/v [Hkv, S, D/Dv]
    -> [H, q, Dv]. A whole prompt (q == S) is one causal call; a decode row (q == 1) sees every
    key; a chunk with history is the history part (no mask) and the chunk's own square causal
    part, merged by their log-sum-exps."""
    q_len, S, dv = q.shape[1], k.shape[1], v.shape[-1]
    if q_len == 1:
        return attend_one(q, [k], [v], scale)
    # the flash kernel wants one head size; MLA's v may be narrower or wider than q/k (v_head_dim vs
    # qk_nope + qk_rope): zero columns pad the narrower side, which leaves q.k (scale given) and the
    # first dv output columns unchanged
    if dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    elif dv > q.shape[-1]:
        q, k = F.pad(q, (0, dv - q.shape[-1])), F.pad(k, (0, dv - k.shape[-1]))
    h = S - q_len
    if h == 0:
        out, _ = _flash_lse(q, k, v, True, scale)
    else:
        o1, l1 = _flash_lse(q, k[:, :h], v[:, :h], False, scale)
        o2, l2 = _flash_lse(q, k[:, h:], v[:, h:], True, scale)
        lse = torch.logaddexp(l1, l2)
        out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    return out[..., :dv]
