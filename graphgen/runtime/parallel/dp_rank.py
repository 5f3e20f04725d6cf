"""A DP-attention rank (``parallel: {dp: N, ep: N}``, tp = 1 per group): its weight slices, the CPU
runner's DP feature (`CpuDPForward`) and the rank side of the DP commands
(`graphgen.runtime.parallel.data_parallel` drives them, `graphgen.runtime.parallel.commands` dispatches).

Each of the ``dp`` rank processes is a DP group of one rank with its **own** requests, scheduler, KV
cache and connector (an ordinary single-rank engine in everything but the MoE); the graph
(`graphgen.passes.shard`, ``dp > 1``) runs attention on the group's own tokens, and every MoE layer

    all_gather (group dp)  ->  this rank's E/ep experts and 1/ep of the shared experts on every
    group's tokens (a partial sum)  ->  reduce_scatter (group ep): back to this group's tokens.

`graphgen.runtime.parallel.collectives.CollectiveRuntime` runs those collectives on gloo. The groups' steps
hold different token counts (their own batches): the gather first all-gathers the counts, pads to the
largest, and keeps the counts for the reduce-scatter that follows (this rank's rows of the summed
tensor), so no step input is padded.

**Lockstep of forwards, not of plans.** The MoE collectives pair up only if every DP rank runs a
forward of the same graph *kind* whenever one does: the target's graphs (decode, prefills: one MoE gather
per MoE decoder layer) or the MTP layer's (speculative decoding's draft runs, docs/mtp.md: one per MTP
layer). Every forward begins with a handshake (`CpuDPForward`, a rank feature: an all_reduce MAX over the
DP ranks of the forward's kind, `TARGET` 1 or `DRAFT` 2): a rank about to run a real forward says its
kind and runs it if the MAX is that kind; otherwise (and a rank with nothing (more) to run in this tick,
which says 0) it runs a **dummy forward** of the agreed kind — that kind's graph on zero tokens, which still
runs its experts on the other groups' gathered tokens (they are needed: each rank holds a different half
of the experts) — and offers its own again. So a group's draft runs, which follow its step, pair with the
draft runs of the groups that draft after the same tick and with dummy draft runs of the others, and the
MTP layer's MoE gather is padded like the target's. When every rank says 0 the tick ends. A tick (`dp_tick`) is one
`EngineCore.step` where a rank has work, so a rank whose step forwards twice, or not at all, still
pairs up. Deadline: gloo's timeout is the engine's ``timeout``, and the facade watches the rank
processes, so a dead DP rank raises `RankFailure` on the caller, never a hang.

**Pool keys carry no DP rank** (each group's KV is the whole KV: ``r0of1``), so a prefix saved
through one DP rank hits on every other; the facade drains every rank and then barriers before the
next prompt looks the pool up (`generate` without ``batch``).

``tp > 1`` inside a DP group: its ranks plan in lockstep (plan check and hit MINs on the group's gloo group,
`graphgen.runtime.parallel.layout.RankLayout.lockstep_group`), every one of them runs the group's real or dummy
forwards, and the facade keeps TP rank 0's replies. ``cp > 1`` inside a DP group likewise: its ``cp × tp``
ranks are the lockstep group, each CP rank's share of a prefill meets the other groups' same CP rank in the
MoE's collectives (the ``dp`` and ``ep`` groups hold one CP rank), and the facade keeps the group's first rank's
replies. Not built: an all-to-all dispatch. The NPU's DP feature is
`graphgen.npu.run.data_parallel.NpuDPForward`.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any
import torch
import torch.distributed as dist

from ...ir.weights import parse_shard
from ..engine.runner import MtpInputs, StepInputs
from .layout import RankCoords, RankLayout
from .ops import slice_weight

__all__ = ["DPLayout", "DPSync", "CpuDPForward", "dp_rank_weights", "dp_tick", "dp_generate"]


@dataclasses.dataclass(frozen=True)
class DPLayout:
    """A DP rank's place as its weight slicing reads it: a view of `RankLayout.coords` (``rank = (dp_rank × cp +
    cp_rank) × tp + tp_rank``; its EP index ``dp_rank × tp + tp_rank``: the world rank at cp = 1, and the same for
    the CP ranks of one DP and TP rank, which hold the same experts)."""
    layout: RankLayout
    coords: RankCoords

    @classmethod
    def of(cls, par, rank: int) -> "DPLayout":
        lay = RankLayout.of(par)
        return cls(lay, lay.coords(rank))

    dp = property(lambda self: self.layout.dp)
    tp = property(lambda self: self.layout.tp)
    ep = property(lambda self: self.layout.ep)
    world = property(lambda self: self.layout.world)
    rank = property(lambda self: self.coords.rank)
    dp_rank = property(lambda self: self.coords.dp_rank)
    tp_rank = property(lambda self: self.coords.tp_rank)
    ep_rank = property(lambda self: self.coords.ep_rank)


def dp_rank_weights(full, names, layout: DPLayout) -> dict:
    """The weights one rank holds (graph weight names ``key[d<dim>/<parts>]``): a slice into ``ep`` parts
    (the experts and the shared experts' width) is the rank's EP index's chunk; any other slice the
    TP rank's (``parts <= tp < ep`` under DP attention, so the two never collide)."""
    out = {}
    for name in names:
        key, dim, parts = parse_shard(name)
        if key not in full:
            raise KeyError(f"weight {name!r}: checkpoint key {key!r} is missing")
        index, size = (layout.ep_rank, layout.ep) if parts == layout.ep else (layout.tp_rank, layout.tp)
        out[name] = slice_weight(full[key], dim, parts, index, size)
    return out


class DPSync:
    """The DP ranks' per-forward handshake and tick agreement (all_reduce MAX on ``group``, the host-side
    gloo group; None: the world's; every DP rank calls the same ones in the same order, see the module doc)."""

    def __init__(self, group=None):
        self.group = group

    def max(self, v: int) -> int:
        t = torch.tensor([int(v)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.group)


TARGET, DRAFT = 1, 2  # the kinds of forward (module doc): the target model's graphs, the MTP layer's


def forward_kind(runner, variant: str) -> int:
    """`DRAFT` for the MTP layer's graph (``phase: mtp``), `TARGET` for every other: graphs of one kind issue
    the same MoE collectives (one gather per MoE layer of the same layers)."""
    return DRAFT if runner.modules[variant].META.get("phase") == "mtp" else TARGET


class CpuDPForward:
    """The CPU runner's `graphgen.runtime.parallel.features.DPForward`: every real forward begins with a
    MAX of its kind (`DPSync`); a rank whose kind does not go, or that has nothing to run, answers with a
    dummy forward of the agreed kind on zero tokens (module doc)."""
    name = "dp"

    def __init__(self, dp_rank: int, group=None):
        self.dp_rank, self.sync = dp_rank, DPSync(group)
        self.runner: Any = None  # the CPU runner, once attached
        self.dummy_forwards = 0
        self.dummy_kinds = {TARGET: 0, DRAFT: 0}  # dummy forwards per kind (a probe for tests)

    def attach(self, runner) -> None:
        self.runner = runner

    def before_forward(self, plan) -> None:
        mine = forward_kind(self.runner, plan.variant)
        while (agreed := self.sync.max(mine)) != mine:  # another group's kind first: pair with it, offer again
            self.dummy_forward(agreed)

    def serve_others(self) -> int:
        n = 0
        while kind := self.sync.max(0):
            self.dummy_forward(kind)
            n += 1
        return n

    def any(self, flag: bool) -> bool:
        return bool(self.sync.max(int(flag)))

    def barrier(self) -> None:
        self.sync.barrier()

    def dummy_forward(self, kind: int = TARGET) -> None:
        """A forward of ``kind`` on zero tokens: attention on nothing, the MoE's experts on the other groups'
        gathered tokens (this rank's share of their sums), logits of nothing; no cache row written."""
        runner = self.runner
        v = next((v for v, m in runner.modules.items() if not m.META.get("history")
                  and forward_kind(runner, v) == kind), None)  # nothing to load
        if v is None:
            raise RuntimeError(f"no variant of kind {kind} without history for the dummy forward")
        none = torch.zeros(0, dtype=torch.long)
        fields = dict(input_ids=none, positions=none, slot_mapping=none,
                      block_tables=torch.zeros((0, 1), dtype=torch.long), seq_lens=none,
                      query_lens=none, logits_indices=none, save_block_ids=none)
        if kind == DRAFT:  # the MTP graph reads each row's previous hidden state: none
            norm = runner.W[f"model.layers.{runner.modules[v].META['mtp_layer']}.hnorm.weight"]  # [hidden]
            inputs: StepInputs = MtpInputs(**fields, prev_hidden=norm.new_zeros((0, norm.shape[0])))
        else:
            inputs = StepInputs(**fields)
        staging = runner.cache.make_staging(0) if runner.saves(v) else None
        handles = runner.execute(v, inputs, staging)
        self.dummy_forwards += 1
        self.dummy_kinds[kind] += 1
        if handles.save_job is not None:  # a save program of zero blocks: let it finish
            handles.save_job.wait()


# ---- the rank side of the DP commands (`graphgen.runtime.parallel.commands`) --------------------------
def dp_tick(engine, dp) -> list:
    """One tick on every DP rank (each calls it): a step where this rank has work, then dummy
    forwards for as long as another rank still runs real ones. This rank's outputs."""
    core = engine.core
    out = core.step() if core.has_work() else []
    dp.serve_others()
    return out


def _run_until_idle(engine, dp) -> None:
    while True:
        dp_tick(engine, dp)
        if not dp.any(engine.core.has_work()):
            return


def dp_generate(engine, dp, groups: list, max_new_tokens: int, settle: bool):
    """`Engine.generate` over the DP ranks: ``groups`` are lists of (index, dp rank, prompt) run one
    group after another (each rank adds its own); ``settle``: every rank drains, then all barrier,
    before the next group looks the pool up. ``{index: RequestResult}`` of this rank's prompts."""
    results = {}
    for i, group in enumerate(groups):
        if i and settle:
            engine.drain()
            dp.barrier()  # every rank's commits landed before any rank's next lookup
        reqs = {j: engine.core.add_request(None, list(p), max_tokens=max_new_tokens)
                for j, r, p in group if r == dp.dp_rank}
        _run_until_idle(engine, dp)
        for j, req in reqs.items():
            if req.finish_reason == "error":
                engine.core.abort_all()
                return {"error": (j, repr(req.error), "".join(traceback.format_exception(req.error)))}
            results[j] = req.result
    return results
