"""CPU reference ops of the parallel-rank graphs (``graphgen.passes.shard``): rank-local partial
sums and the weight slicing. The collectives themselves are methods of the rank runtime
(``graphgen.runtime.parallel.collectives.CollectiveRuntime``); the ops here that need the rank take it as an
argument (``rank``, ``size``), which the rank runtime supplies, so they are testable without a
process group.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

import torch
import torch.nn.functional as F

from ...ir.weights import parse_shard, shard_index
from ..core.ops import _route, _swiglu, matmul_t, swiglu_t

Tensor = torch.Tensor

__all__ = ["embedding_shard", "o_proj", "swiglu_mlp", "moe", "residual_add", "slice_weight", "rank_weights"]


def embedding_shard(weight: Tensor, input_ids: Tensor, *, vocab_size: int, rank: int, size: int) -> Tensor:
    """Rows of this rank's vocabulary slice (``weight``: ``ceil(V/size)`` rows, zero-padded), zero for
    the tokens another rank holds: the all_reduce (sum) of every rank's result is the lookup."""
    rows = weight.shape[0]
    assert rows == math.ceil(vocab_size / size), (rows, vocab_size, size)
    local = input_ids.long() - rank * rows
    mine = (local >= 0) & (local < rows)
    out = F.embedding(local.clamp(0, rows - 1), weight)
    return out * mine[:, None].to(out.dtype)


def o_proj(attn: Tensor, o_t: Tensor) -> Tensor:
    """This rank's partial o_proj (``o_t``: its input slice of o_proj, stored ``[in, out]``)."""
    return matmul_t(attn.flatten(1), o_t)


def swiglu_mlp(x: Tensor, gate_up_t: Tensor, down_t: Tensor) -> Tensor:
    """This rank's partial MLP (its slices of gate/up merged, and of down; ``[in, out]``)."""
    return swiglu_t(x, gate_up_t, down_t)


def residual_add(x: Tensor, residual: Tensor) -> Tensor:
    return residual + x


def moe(x: Tensor, router_w: Tensor, e_score_bias: Optional[Tensor], experts_gate: Tensor, experts_up: Tensor,
        experts_down: Tensor, shared_gate: Optional[Tensor], shared_up: Optional[Tensor],
        shared_down: Optional[Tensor], *, top_k: int, n_group: int, topk_group: int,
        routed_scaling_factor: float, norm_topk_prob: bool, num_experts: int, ep: int, rank: int,
        size: int) -> Tensor:
    """This rank's share of the MoE output for every token (routing is replicated: the router and
    bias are whole on every rank). ``ep > 1``: ``experts_*`` are this rank's ``num_experts/ep``
    whole experts; ``ep == 1``: a width slice of every expert. Shared experts: a width slice."""
    idx, weights = _route(x, router_w, e_score_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                          routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob)
    T = x.shape[0]
    local_n = experts_gate.shape[0]
    first = shard_index(rank, ep, size) * local_n if ep > 1 else 0
    out = torch.zeros_like(x)
    flat_idx = idx.reshape(-1)
    flat_tok = torch.arange(T, device=x.device).repeat_interleave(top_k)
    flat_w = weights.reshape(-1).to(x.dtype)
    order = torch.argsort(flat_idx, stable=True)
    counts = torch.bincount(flat_idx, minlength=num_experts).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    for e in range(first, first + local_n):  # only this rank's experts
        sel = order[starts[e]:starts[e + 1]]
        if sel.numel() == 0:
            continue
        tok = flat_tok[sel]
        y = _swiglu(x[tok], experts_gate[e - first], experts_up[e - first], experts_down[e - first])
        out.index_add_(0, tok, y * flat_w[sel, None])
    if shared_gate is not None:
        out = out + _swiglu(x, shared_gate, shared_up, shared_down)
    return out


def slice_weight(full: Tensor, dim: Optional[int], parts: int, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s chunk of ``full`` cut along ``dim`` into ``parts`` (the last chunk
    zero-padded to the others' length when ``parts`` does not divide the dim)."""
    if dim is None or parts == 1:
        return full
    n = full.shape[dim]
    chunk = math.ceil(n / parts)
    i = shard_index(rank, parts, size)
    piece = full.narrow(dim, min(i * chunk, n), max(0, min(chunk, n - i * chunk)))
    if piece.shape[dim] < chunk:
        pad = list(piece.shape)
        pad[dim] = chunk - piece.shape[dim]
        piece = torch.cat([piece, piece.new_zeros(pad)], dim=dim)
    return piece.contiguous()


def rank_weights(full: Mapping[str, Tensor], names: Iterable[str], rank: int, size: int) -> dict[str, Tensor]:
    """The weights one rank holds, keyed by the graph's weight names (``key[d<dim>/<parts>]``)."""
    out = {}
    for name in names:
        key, dim, parts = parse_shard(name)
        if key not in full:
            raise KeyError(f"weight {name!r}: checkpoint key {key!r} is missing")
        out[name] = slice_weight(full[key], dim, parts, rank, size)
    return out
