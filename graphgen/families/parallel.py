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
from typing import Any, Callable, Iterator, Optional

from . import deepseek_v3, qwen3_dense
from .base import Rule


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


def _qwen3_rank_dims(d: Any, tp: int) -> Any:
    return dataclasses.replace(d, num_attention_heads=d.num_attention_heads // tp,
                               num_key_value_heads=max(1, d.num_key_value_heads // tp))


def _deepseek_rank_dims(d: Any, tp: int) -> Any:
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


def parallel_rules(family: str, d: Any, tp: int, ep: int, *, dp: int = 1, cp: int = 1,
                   sp: bool = False, mtp: bool = False, lora: bool = False) -> Iterator[Rule]:
    """Yield ``(path, message, fix)`` for every way the layout does not fit the family's dims, or
    combines modes graphgen does not implement together (``mtp``: the spec has MTP layers, ``lora``: a
    ``lora:`` section; those combinations are the spec rules of the one refusal table,
    `graphgen.composition`, docs/composition.md)."""
    from ..composition import Launch, spec_rules

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
    yield from _ep_rules(plan, d, tp, ep, dp)
    if sp and tp == 1:
        yield ("parallel.sp", "sp: true needs tp > 1 (sequence parallelism splits the tokens over the TP group)",
               "set tp: 2 or more, or sp: false")
    yield from spec_rules(Launch(tp=tp, ep=ep, dp=dp, cp=cp, sp=sp, mtp=mtp, lora=lora))


def _ep_rules(plan: ParallelPlan, d: Any, tp: int, ep: int, dp: int) -> Iterator[Rule]:
    """EP reuses the TP ranks (ep 1 or tp); under DP attention the MoE spans every DP group (ep = dp × tp)."""
    if plan.experts is None:
        if ep > 1:
            yield "parallel.ep", f"ep ({ep}) needs routed experts; this family has none", "set ep: 1"
        return
    e = getattr(d, plan.experts)
    if dp > 1:
        if ep != dp * tp:
            yield ("parallel.ep", f"ep ({ep}) must equal dp × tp ({dp} × {tp} = {dp * tp}) under DP attention: "
                   f"the MoE runs over every rank of the DP groups", f"set ep: {dp * tp}")
            return
        shared = getattr(d, "moe_intermediate_size") * getattr(d, "n_shared_experts", 0)
        if shared % ep:
            yield ("parallel.ep", f"ep ({ep}) must divide the shared experts' width ({shared}): under DP "
                   f"attention they are split over the EP group with the routed experts",
                   f"use a dp × tp that divides {shared}")
    elif ep > 1 and ep != tp:
        yield ("parallel.ep", f"ep ({ep}) must be 1 or equal tp ({tp}): expert parallelism reuses the "
               f"tensor-parallel ranks (or set dp > 1 for DP attention with ep = dp × tp)", f"set ep: {tp} or ep: 1")
    if ep > 1 and e % ep:
        yield ("parallel.ep", f"ep ({ep}) must divide {plan.experts} ({e})", f"use an ep that divides {e}")


def layout_rules(family: str, d: Any, par: Any, *, mtp: bool = False, lora: bool = False) -> Iterator[Rule]:
    """``parallel_rules`` for a spec's ``parallel:`` (a :class:`graphgen.modelspec.model.Parallel`)."""
    return parallel_rules(family, d, par.tp, par.ep, dp=par.dp, cp=par.cp, sp=par.sp, mtp=mtp, lora=lora)


def runtime_layout_gap(par: Any, target: str = "cpu", *, mtp: bool = False, speculative: bool = False,
                       role: str = "both") -> Optional[str]:
    """The sentence refusing a launch of the layout ``par`` on ``target`` (``graphgen run``/``serve``: exit 2),
    or None: ``mtp`` whether the spec has MTP layers, ``speculative`` whether it decodes with them
    (``--speculative mtp``), ``role`` its P/D role (``graphgen serve --role``). The one refusal table's answer (`graphgen.composition.launch_refusal`: its launch
    checks, then its spec rules, which a --tp/--cp flag would otherwise bypass); a caller that knows more of
    the launch (the write mode, the pool, a P/D role) asks it with a fuller `graphgen.composition.Launch`."""
    from ..composition import Launch, launch_refusal

    return launch_refusal(Launch.of(par, target, mtp=mtp, speculative=speculative, role=role))


def rank_kv_components(family: str, d: Any, tp: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The KV components one rank's cache holds (``((name, per-token shape), ...)``)."""
    from . import FAMILIES

    fam = FAMILIES[family]
    return fam.kv_components(PLANS[family].rank_dims(fam.dims_of(d), tp) if tp > 1 else fam.dims_of(d))


def kv_shard_owner(family: str, d: Any, tp: int, rank: int) -> int:
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
