"""A DP-attention rank (``parallel: {dp: N, ep: N}``, tp = 1 per group): its runtime, runner and engine,
and the rank side of the facade's commands (`graphgen.runtime.parallel.data_parallel` drives them).

Each of the ``dp`` rank processes is a DP group of one rank with its **own** requests, scheduler, KV
cache and connector (an ordinary single-rank engine in everything but the MoE); the graph
(`graphgen.passes.shard`, ``dp > 1``) runs attention on the group's own tokens, and every MoE layer

    all_gather (group dp)  ->  this rank's E/ep experts and 1/ep of the shared experts on every
    group's tokens (a partial sum)  ->  reduce_scatter (group ep): back to this group's tokens.

`DPRankRuntime` is those collectives on gloo. The groups' steps hold different token counts (their
own batches): the gather first all-gathers the counts, pads to the largest, and keeps the counts for
the reduce-scatter that follows (this rank's rows of the summed tensor), so no step input is padded.

**Lockstep of forwards, not of plans.** The MoE collectives pair up only if every DP rank runs a
forward whenever one does. Every forward begins with a handshake (`DPSync`: an all_reduce MAX over
the DP ranks): a rank about to run a real step says 1; a rank with nothing (more) to run in this
tick says 0 and, while some rank says 1, runs a **dummy forward**: the decode module on zero tokens,
which still runs its experts on the other groups' gathered tokens (they are needed: each rank holds
a different half of the experts). When every rank says 0 the tick ends. A tick (`dp_tick`) is one
`EngineCore.step` where a rank has work, so a rank whose step forwards twice, or not at all, still
pairs up. Deadline: gloo's timeout is the engine's ``timeout``, and the facade watches the rank
processes, so a dead DP rank raises `RankFailure` on the caller, never a hang.

**Pool keys carry no DP rank** (each group's KV is the whole KV: ``r0of1``), so a prefix saved
through one DP rank hits on every other; the facade drains every rank and then barriers before the
next prompt looks the pool up (`generate` without ``batch``).

Not built: ``tp > 1`` inside a DP group (the TP gather after the reduce-scatter, steps padded to a
multiple of tp, the per-group plan check and hit agreement), an all-to-all dispatch, the NPU lowering.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Optional

import torch
import torch.distributed as dist

from ...ir.weights import parse_shard
from ..engine.assembly import cpu_engine
from ..engine.engine import Engine
from ..engine.runner import CpuModelRunner, StepInputs
from .collectives import CollectiveRuntime
from .core_calls import core_call
from .ops import slice_weight

__all__ = ["DPLayout", "DPSync", "DPModelRunner", "dp_rank_weights", "dp_rank_engine",
           "build_dp_rank", "dp_tick", "rank_generate", "rank_core"]


@dataclasses.dataclass(frozen=True)
class DPLayout:
    """Where world rank ``rank`` sits: ``rank = dp_rank × tp + tp_rank`` (cp = 1 under DP attention),
    and its index in the EP group (``dp_rank × tp + tp_rank``: the world rank)."""
    dp: int
    tp: int
    ep: int
    rank: int

    @classmethod
    def of(cls, par, rank: int) -> "DPLayout":
        if par.cp != 1:
            raise ValueError("DP attention with cp > 1 has no rank order (spec rule)")
        return cls(par.dp, par.tp, par.ep, rank)

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank * self.tp + self.tp_rank


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
    """The DP ranks' per-forward handshake and tick agreement (all_reduce MAX on the world group;
    every DP rank calls the same ones in the same order, see the module doc)."""

    @staticmethod
    def _max(v: int) -> int:
        t = torch.tensor([int(v)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def forward_begins(self) -> None:
        """Before a real forward: tell the other ranks to run theirs (real or dummy)."""
        self._max(1)

    def serve_others(self, dummy_forward) -> int:
        """This rank has nothing (more) to run this tick: run a dummy forward for every real one
        another rank begins; returns when no rank does. How many dummies ran."""
        n = 0
        while self._max(0):
            dummy_forward()
            n += 1
        return n

    def any(self, flag: bool) -> bool:
        return bool(self._max(int(flag)))

    def barrier(self) -> None:
        dist.barrier()


class DPModelRunner(CpuModelRunner):
    """The CPU runner of a DP rank: every real forward begins with the handshake (`DPSync`);
    `dummy_forward` is what an idle rank runs meanwhile."""

    dummy_forwards = 0  # how many this rank ran (a probe for tests)

    def submit(self, plan, *, background: bool = False):
        if background:  # the handshake and the forward's collectives must stay on one thread
            raise RuntimeError("a DP rank runs its forwards inline (async scheduling is off on ranks)")
        if plan.rows:  # a step with no forward (write-backs only) is no forward for the other ranks
            self.rt.sync.forward_begins()
        return super().submit(plan)

    def _dummy_variant(self) -> str:
        for v, m in self.modules.items():  # a module without history (nothing to load)
            if not m.META.get("history"):
                return v
        raise RuntimeError("no variant without history for the dummy forward")

    def dummy_forward(self) -> None:
        """A forward on zero tokens: attention on nothing, the MoE's experts on the other groups'
        gathered tokens (this rank's share of their sums), logits of nothing; no cache row written."""
        v = self._dummy_variant()
        none = torch.zeros(0, dtype=torch.long)
        inputs = StepInputs(input_ids=none, positions=none, slot_mapping=none,
                            block_tables=torch.zeros((0, 1), dtype=torch.long), seq_lens=none,
                            query_lens=none, logits_indices=none, save_block_ids=none)
        staging = self.cache.make_staging(0) if self.saves(v) else None
        handles = self.execute(v, inputs, staging)
        self.dummy_forwards += 1
        if handles.save_job is not None:  # a save program of zero blocks: let it finish
            handles.save_job.wait()


def dp_rank_engine(spec, weights: dict, *, layout: DPLayout, groups, pool, faults=None, event_timeout: float = 120.0,
                   **options) -> Engine:
    """The engine of one DP rank (tp = 1): the single-rank KV parts (keys without the DP rank), the
    DP runtime and runner."""
    if layout.tp != 1:
        raise ValueError("DP attention with tp > 1 inside a group does not run yet (docs/parallel.md)")
    runtime = CollectiveRuntime(faults, event_timeout=event_timeout, groups=groups)
    runtime.sync = DPSync()
    options["async_scheduling"] = False  # the handshake and the forward on the caller's thread
    return cpu_engine(spec, weights, runtime=runtime, runner_cls=DPModelRunner, faults=faults, pool=pool,
                      event_timeout=event_timeout, **options)


def build_dp_rank(spec, weights: dict, rank: int, cfg: dict, pool, target=None, group=None, groups=None) -> Engine:
    """What `rank.rank_main` builds for a DP layout: this rank's slices and engine: the CPU one here, or
    another target's (``target``: its `RankTarget`, built with ``parts=None``, ``dp_layout`` and ``dp_group``:
    the host-side gloo group its DP ranks agree on, the NPU's: `graphgen.npu.run.data_parallel`)."""
    layout = DPLayout.of(spec.parallel, rank)
    # a dict: every tensor, sliced here; else the rank's `CheckpointWeights` (streamed when the engine loads)
    mine = dp_rank_weights(weights, cfg["weight_names"], layout) if isinstance(weights, dict) else weights
    if cfg["target"] != "cpu":
        return target.build(spec, mine, rank=rank, parts=None, dp_layout=layout, dp_group=group, pool=pool,
                            faults=cfg["faults"], spec_file=cfg["spec_file"], **cfg["engine_kwargs"])
    return dp_rank_engine(spec, mine, layout=layout, groups=groups, pool=pool, faults=cfg["faults"], spec_file=cfg["spec_file"],
                          sources=cfg["sources"], **{"event_timeout": cfg["timeout"], **cfg["engine_kwargs"]})


# ---- the rank side of the facade's commands (run by `rank_main`'s "call": fn(engine, *args)) --------
def _dp_rank(engine) -> int:
    return engine.runner.rt.coords.dp_rank


def dp_tick(engine) -> list:
    """One tick on every DP rank (each calls it): a step where this rank has work, then dummy
    forwards for as long as another rank still runs real ones. This rank's outputs."""
    core = engine.core
    out = core.step() if core.has_work() else []
    engine.runner.rt.sync.serve_others(engine.runner.dummy_forward)
    return out


def _run_until_idle(engine) -> None:
    sync = engine.runner.rt.sync
    while True:
        dp_tick(engine)
        if not sync.any(engine.core.has_work()):
            return


def rank_generate(engine, groups: list, max_new_tokens: int, settle: bool):
    """`Engine.generate` over the DP ranks: ``groups`` are lists of (index, dp rank, prompt) run one
    group after another (each rank adds its own); ``settle``: every rank drains, then all barrier,
    before the next group looks the pool up. ``{index: RequestResult}`` of this rank's prompts."""
    me, sync = _dp_rank(engine), engine.runner.rt.sync
    results = {}
    for i, group in enumerate(groups):
        if i and settle:
            engine.drain()
            sync.barrier()  # every rank's commits landed before any rank's next lookup
        reqs = {j: engine.core.add_request(None, list(p), max_tokens=max_new_tokens) for j, r, p in group if r == me}
        _run_until_idle(engine)
        for j, req in reqs.items():
            if req.finish_reason == "error":
                engine.core.abort_all()
                return {"error": (j, repr(req.error), "".join(traceback.format_exception(req.error)))}
            results[j] = req.result
    return results


def rank_core(engine, dp_rank: Optional[int], method: str, args: tuple):
    """One `DataParallelCore` call: on rank ``dp_rank`` only (None: on every rank). ``("ok", result)``
    or ``("invalid", message)`` (add_request refused the input)."""
    if dp_rank is not None and dp_rank != _dp_rank(engine):
        return "ok", None
    if method == "step":  # a tick: this rank's step, then dummy forwards while another rank runs
        return "ok", dp_tick(engine)
    return core_call(engine.core, method, args)
