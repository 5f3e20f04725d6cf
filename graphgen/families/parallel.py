"""What each family splits over tensor- and expert-parallel ranks (the one per-family table for it).

The sharding itself is op-level and family-free (``graphgen.passes.shard``: a q/k/v prolog is
column-parallel whatever the family); what differs per family is listed here: which dims must divide
by ``tp``/``ep`` (for the spec checks), whether the KV cache is split by heads (Qwen3: each rank holds
its KV heads) or replicated (DeepSeek-V3 MLA: the compressed latent is the same on every rank, so the
pool stores it once), and the rank-local KV components. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from . import deepseek_v3, qwen3_dense


@dataclass(frozen=True)
class ParallelPlan:
    # (dims field, what it is) that must divide by tp: heads and MLP widths.
    tp_divides: tuple[tuple[str, str], ...]
    # dims field of the KV heads split by tp (replicated when tp exceeds them), or None: the KV is
    # replicated on every rank (the MLA latent).
    kv_heads: Optional[str]
    # dims field of the routed experts split by ep, or None (no MoE: ep must be 1).
    experts: Optional[str]
    # dims -> dims as one rank sees them (heads divided): its KV components follow from it.
    rank_dims: Callable[..., object]

    def kv_split(self) -> bool:
        """Whether each rank's KV differs (then pool keys carry the rank and every rank saves)."""
        return self.kv_heads is not None


def _qwen3_rank_dims(d, tp: int):
    return dataclasses.replace(d, num_attention_heads=d.num_attention_heads // tp,
                               num_key_value_heads=max(1, d.num_key_value_heads // tp))


def _deepseek_rank_dims(d, tp: int):
    return dataclasses.replace(d, num_attention_heads=d.num_attention_heads // tp)


PLANS: dict[str, ParallelPlan] = {
    qwen3_dense.NAME: ParallelPlan(
        tp_divides=(("num_attention_heads", "attention heads"), ("intermediate_size", "MLP width")),
        kv_heads="num_key_value_heads", experts=None, rank_dims=_qwen3_rank_dims),
    deepseek_v3.NAME: ParallelPlan(
        tp_divides=(("num_attention_heads", "attention heads"), ("intermediate_size", "dense MLP width"),
                    ("moe_intermediate_size", "expert width")),
        kv_heads=None, experts="n_routed_experts", rank_dims=_deepseek_rank_dims),
}


def parallel_rules(family: str, d, tp: int, ep: int):
    """Yield ``(path, message, fix)`` for every way ``tp``/``ep`` does not fit the family's dims."""
    plan = PLANS[family]
    for name, what in plan.tp_divides:
        n = getattr(d, name)
        if n % tp:
            yield ("parallel.tp", f"tp ({tp}) must divide {name} ({n}, the {what})",
                   f"use a tp that divides {n}")
    if plan.kv_heads is not None:
        kv = getattr(d, plan.kv_heads)
        if (tp > kv and tp % kv) or (tp <= kv and kv % tp):
            yield ("parallel.tp", f"tp ({tp}) and {plan.kv_heads} ({kv}): KV heads are split when tp divides "
                   f"them and replicated when tp is a multiple of them; neither holds",
                   f"use a tp that divides {kv} or a multiple of {kv}")
    if ep > 1:
        if plan.experts is None:
            yield "parallel.ep", f"ep ({ep}) needs routed experts; this family has none", "set ep: 1"
        else:
            e = getattr(d, plan.experts)
            if e % ep:
                yield ("parallel.ep", f"ep ({ep}) must divide {plan.experts} ({e})", f"use an ep that divides {e}")
            if ep != tp:
                yield ("parallel.ep", f"ep ({ep}) must be 1 or equal tp ({tp}): expert parallelism reuses the "
                       f"tensor-parallel ranks", f"set ep: {tp} or ep: 1")


def rank_kv_components(family: str, d, tp: int) -> tuple:
    """The KV components one rank's cache holds (``((name, per-token shape), ...)``)."""
    from . import FAMILIES

    fam = FAMILIES[family]
    return fam.kv_components(PLANS[family].rank_dims(fam.dims_of(d), tp) if tp > 1 else fam.dims_of(d))


def kv_shard_owner(family: str, d, tp: int, rank: int) -> int:
    """The lowest rank holding the same KV shard as ``rank``: it alone puts that shard, and every
    rank holding it uses its pool keys. The MLA latent (the same on every rank): 0. KV heads split
    by ``tp``: ``rank`` itself. KV heads replicated because ``tp`` exceeds them (Qwen3 with 2 KV heads
    at tp=4: ranks 0,1 hold head 0, ranks 2,3 head 1): the first rank of the group (0 or 2), as the
    shard pass slices them (rank ``r`` holds chunk ``r * parts // tp`` of ``parts = min(tp, heads)``)."""
    from . import FAMILIES

    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside a world of {tp}")
    plan = PLANS[family]
    if plan.kv_heads is None:
        return 0
    parts = min(tp, getattr(FAMILIES[family].dims_of(d), plan.kv_heads))
    chunk = rank * parts // tp
    return next(r for r in range(tp) if r * parts // tp == chunk)
