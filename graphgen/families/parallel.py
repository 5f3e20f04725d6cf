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
                   sp: bool = False, mtp: bool = False) -> Iterator[Rule]:
    """Yield ``(path, message, fix)`` for every way the layout does not fit the family's dims, or
    combines modes graphgen does not implement together (docs/parallel.md, "Layouts"); ``mtp``: the spec has
    MTP layers (an ``mtp:`` section)."""
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
    # with MTP layers: tp, ep and dp run (the MTP layer sharded like a decoder layer, its draft runs on every
    # rank; docs/mtp.md, "With ranks"); cp and sp do not
    if cp > 1 and mtp:
        yield ("parallel.cp", f"cp ({cp}) with MTP is not implemented (the MTP layer's draft runs would need the "
               f"prompt's hidden states split head-tail like its tokens)", "set cp: 1, or turn MTP off")
    if sp and mtp:
        yield ("parallel.sp", "sp with MTP is not implemented (the sequence-parallel pass does not split the MTP "
               "layer: its eh_proj would read the embedding's token shard before the all-gather)",
               "set sp: false, or turn MTP off")


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


def layout_rules(family: str, d: Any, par: Any, *, mtp: bool = False) -> Iterator[Rule]:
    """``parallel_rules`` for a spec's ``parallel:`` (a :class:`graphgen.modelspec.model.Parallel`); ``mtp``: the
    spec has MTP layers."""
    return parallel_rules(family, d, par.tp, par.ep, dp=par.dp, cp=par.cp, sp=par.sp, mtp=mtp)


@dataclass(frozen=True)
class Launch:
    """What the runtime refusals read of a launch: the layout (a `graphgen.modelspec.model.Parallel`), whether
    the spec has MTP layers (an ``mtp:`` section), whether it decodes speculatively (``--speculative mtp``) and
    its P/D role (``graphgen serve --role``: ``both``, ``prefill`` or ``decode``)."""
    par: Any
    mtp: bool = False
    speculative: bool = False
    role: str = "both"


# What the runtimes cannot run yet (graphgen run/serve refuse it with this sentence): the one refusal table of a
# launch, rows (what is set, is it set in this Launch, the sentence). The build path (generate, validate, dry-run)
# takes every layout the spec rules accept; lifting a row is a change here plus the runtime's code.
_Gap = tuple[str, Callable[[Launch], bool], str]
_RUNTIME_GAPS: tuple[_Gap, ...] = (
    # (MTP with ranks runs since issue 38 item 1: every rank runs the drafter's steps in lockstep, the DP groups
    # pad the MTP layer's MoE gather with dummy draft runs; cp and sp with MTP are spec rules, `parallel_rules`)
    # P/D with ranks runs at any tp / cp / dp x tp (docs/pd.md "P/D with ranks"): no layout row for --role
    ("role+speculative", lambda x: x.speculative and x.role != "both",
     "--speculative mtp does not combine with --role prefill|decode yet: no MTP KV is saved to the pool, so a "
     "handoff could not cover the drafter's cache (docs/mtp.md); serve with --role both, or without --speculative"),
)
# ... and what only the NPU target lacks (the CPU ranks run it); checked first for --target npu
_NPU_GAPS: tuple[_Gap, ...] = (
    ("cp+dp", lambda x: x.par.cp > 1 and x.par.dp > 1,
     "context parallel with DP attention does not run on the NPU runner yet (its CP pieces are padded to one bucket "
     "per CP group, not to the DP ranks' agreed bucket: graphgen/npu/run/context_parallel.py); use --target cpu, or "
     "run with --cp 1"),
)


def runtime_layout_gap(par: Any, target: str = "cpu", *, mtp: bool = False, speculative: bool = False,
                       role: str = "both") -> Optional[str]:
    """The sentence refusing a launch the ``target``'s runtime cannot run (``graphgen run``/``serve``: exit 2),
    or None: ``par`` the layout, ``mtp`` whether the spec has MTP layers, ``speculative`` whether it decodes
    with them (``--speculative mtp``), ``role`` its P/D role (``graphgen serve --role``). The build path
    (generate, validate, dry-run) takes every layout the spec rules accept."""
    launch = Launch(par, mtp=mtp, speculative=speculative, role=role)
    for _, is_set, sentence in (_NPU_GAPS if target == "npu" else ()) + _RUNTIME_GAPS:
        if is_set(launch):
            return sentence
    return None


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
