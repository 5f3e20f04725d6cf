"""DP attention + expert parallelism on the CPU ranks (``parallel: {dp: N, ep: N}``, tp = 1 per group).

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
`LLMEngine.step` where a rank has work, so a rank whose step forwards twice, or not at all, still
pairs up. Deadline: gloo's timeout is the engine's ``timeout``, and the facade watches the rank
processes, so a dead DP rank raises `RankFailure` on the caller, never a hang.

**Pool keys carry no DP rank** (each group's KV is the whole KV: ``r0of1``), so a prefix saved
through one DP rank hits on every other; the facade drains every rank and then barriers before the
next prompt looks the pool up (`generate` without ``batch``).

**Which rank serves a request** (`DPRouter`): prefix affinity by rendezvous
hashing of the prompt's leading full blocks over the DP ranks (`graphgen.route.policy.Pool`, policy
``prefix``), unless that rank already holds ``max_imbalance`` more requests than the least-loaded one
(then the least loaded): a shared prefix stays on one rank's device cache while load stays bounded.

Not built: ``tp > 1`` inside a DP group (the TP gather after the reduce-scatter, steps padded to a
multiple of tp, the per-group plan check and hit agreement), an all-to-all dispatch, the NPU lowering.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from ...ir.weights import parse_shard
from ..engine.facade import Engine, cpu_engine
from ..engine.runner import CpuModelRunner, StepInputs
from . import ops as ops_parallel
from .launcher import DistributedEngine
from .ops import slice_weight
from .rank import RankRuntime

__all__ = ["DPLayout", "DPRankRuntime", "DPSync", "DPModelRunner", "dp_rank_weights", "dp_rank_engine",
           "DataParallelEngine", "DataParallelLLM", "DPRouter", "prefix_affinity_key"]


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


class DPRankRuntime(RankRuntime):
    """``rt`` of a DP rank: the MoE's token all-gather over the DP ranks (counts first: the groups'
    steps differ in length), the reduce-scatter back to this group's rows, and ``moe`` with this
    rank's EP index. ``expert_owner``: whose experts ``moe`` takes its weight slices for (the EP
    index; a test swaps it to prove the layout is observable)."""

    def __init__(self, *args, layout: DPLayout, **kwargs):
        super().__init__(*args, rank=layout.rank, size=layout.world, **kwargs)
        self.layout = layout
        self.expert_owner = layout.ep_rank
        self.sync = DPSync()
        self._dp_counts: Optional[list[int]] = None  # the last gather's rows per DP rank

    def _group_size(self, group: str, size: int) -> None:
        expect = {"dp": self.layout.dp, "ep": self.layout.ep}.get(group)
        if expect is None or size != expect:
            raise RuntimeError(f"collective of group {group!r} size {size} on a dp={self.layout.dp} "
                               f"ep={self.layout.ep} tp={self.layout.tp} layout (a module of another layout?)")

    def all_gather(self, x: torch.Tensor, *, group: str, size: int, dim: int, length) -> torch.Tensor:
        if group != "dp":
            return super().all_gather(x, group=group, size=size, dim=dim, length=length)
        self._group_size(group, size)
        if dim != 0 or length is not None:
            raise ValueError(f"the DP token all-gather is over the tokens (dim 0, length None), got {dim}, {length}")
        n = torch.tensor([x.shape[0]], dtype=torch.int64)
        counts = [torch.empty_like(n) for _ in range(size)]
        dist.all_gather(counts, n)
        self._dp_counts = [int(c) for c in counts]
        padded = x.new_zeros((max(self._dp_counts), *x.shape[1:]))
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat([p[:c] for p, c in zip(parts, self._dp_counts)], dim=0)

    def reduce_scatter(self, x: torch.Tensor, *, group: str, size: int, reduce: str, dim: int) -> torch.Tensor:
        if group != "ep":
            return super().reduce_scatter(x, group=group, size=size, reduce=reduce, dim=dim)
        self._group_size(group, size)
        if dim != 0 or reduce != "sum" or self._dp_counts is None:
            raise ValueError("the MoE reduce-scatter sums over the tokens (dim 0) of the DP gather before it")
        # gloo has no reduce_scatter: all_reduce, then this group's rows (the wire cost is not a
        # reduce-scatter's; the sums are)
        total = x.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        first = sum(self._dp_counts[:self.layout.dp_rank])
        return total[first:first + self._dp_counts[self.layout.dp_rank]]

    def moe(self, *args, **kwargs):
        return ops_parallel.moe(*args, rank=self.expert_owner, size=self.layout.ep, **kwargs)


class DPModelRunner(CpuModelRunner):
    """The CPU runner of a DP rank: every real forward begins with the handshake (`DPSync`);
    `dummy_forward` is what an idle rank runs meanwhile."""

    def submit(self, plan, *, background: bool = False):
        if background:  # the handshake and the forward's collectives must stay on one thread
            raise RuntimeError("a DP rank runs its forwards inline (async scheduling is off on ranks)")
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
        if handles.save_job is not None:  # a save program of zero blocks: let it finish
            handles.save_job.wait()


def dp_rank_engine(spec, weights: dict, *, layout: DPLayout, pool, faults=None, event_timeout: float = 120.0,
                   **options) -> Engine:
    """The engine of one DP rank (tp = 1): the single-rank KV parts (keys without the DP rank), the
    DP runtime and runner."""
    if layout.tp != 1:
        raise ValueError("DP attention with tp > 1 inside a group does not run yet (docs/parallel.md)")
    runtime = DPRankRuntime(faults, event_timeout=event_timeout, layout=layout)
    options["async_scheduling"] = False  # the handshake and the forward on the caller's thread
    return cpu_engine(spec, weights, runtime=runtime, runner_cls=DPModelRunner, faults=faults, pool=pool,
                      event_timeout=event_timeout, **options)


def build_dp_rank(spec, weights: dict, rank: int, cfg: dict, pool) -> Engine:
    """What `rank.rank_main` builds for a DP layout: this rank's slices and engine."""
    layout = DPLayout.of(spec.parallel, rank)
    mine = dp_rank_weights(weights, cfg["weight_names"], layout)
    return dp_rank_engine(spec, mine, layout=layout, pool=pool, faults=cfg["faults"], spec_file=cfg["spec_file"],
                          sources=cfg["sources"], **{"event_timeout": cfg["timeout"], **cfg["engine_kwargs"]})


# ---- the rank side of the facade's commands (run by `rank_main`'s "call": fn(engine, *args)) --------
def _dp_rank(engine) -> int:
    return engine.runner.rt.layout.dp_rank


def dp_tick(engine) -> list:
    """One tick on every DP rank (each calls it): a step where this rank has work, then dummy
    forwards for as long as another rank still runs real ones. This rank's outputs."""
    llm = engine.llm
    out = llm.step() if llm.has_work() else []
    engine.runner.rt.sync.serve_others(engine.runner.dummy_forward)
    return out


def _run_until_idle(engine) -> None:
    sync = engine.runner.rt.sync
    while True:
        dp_tick(engine)
        if not sync.any(engine.llm.has_work()):
            return


def _rank_generate(engine, groups: list, max_new_tokens: int, settle: bool):
    """`Engine.generate` over the DP ranks: ``groups`` are lists of (index, dp rank, prompt) run one
    group after another (each rank adds its own); ``settle``: every rank drains, then all barrier,
    before the next group looks the pool up. ``{index: RequestResult}`` of this rank's prompts."""
    me, sync = _dp_rank(engine), engine.runner.rt.sync
    results = {}
    for i, group in enumerate(groups):
        if i and settle:
            engine.drain()
            sync.barrier()  # every rank's commits landed before any rank's next lookup
        reqs = {j: engine.llm.add_request(None, list(p), max_tokens=max_new_tokens) for j, r, p in group if r == me}
        _run_until_idle(engine)
        for j, req in reqs.items():
            if req.finish_reason == "error":
                engine.llm.abort_all()
                return {"error": (j, repr(req.error), "".join(traceback.format_exception(req.error)))}
            results[j] = req.result
    return results


def _rank_llm(engine, dp_rank: Optional[int], method: str, args: tuple):
    """One `DataParallelLLM` call: on rank ``dp_rank`` only (None: on every rank). ``("ok", result)``
    or ``("invalid", message)`` (add_request refused the input)."""
    if dp_rank is not None and dp_rank != _dp_rank(engine):
        return "ok", None
    llm = engine.llm
    if method == "add_request":
        req_id, prompt, params, max_tokens, fork_of = args
        try:
            llm.add_request(req_id, prompt, params, max_tokens=max_tokens, fork_of=fork_of)
        except ValueError as e:
            return "invalid", str(e)
        return "ok", None
    if method == "set":
        setattr(llm, args[0], args[1])
        return "ok", None
    if method == "step":
        return "ok", dp_tick(engine)
    if method == "has_work":
        return "ok", llm.has_work()
    if method in ("abort", "stats", "shutdown"):
        return "ok", getattr(llm, method)(*args)
    raise ValueError(f"unknown step-API call {method!r}")


def prefix_affinity_key(prompt: Sequence[int], block_size: int, blocks: int = 4) -> str:
    """What names a prompt's prefix for routing: its leading full blocks (up to ``blocks``), or the
    whole prompt when it is shorter than a block; prompts sharing those blocks get the same key."""
    n = min(len(prompt) // block_size, blocks) * block_size or len(prompt)
    return ",".join(map(str, prompt[:n]))


class DPRouter:
    """Which DP rank a request goes to: prefix affinity (rendezvous hashing of `prefix_affinity_key` over
    the ranks, `graphgen.route.policy.Pool` with policy ``prefix``: a shared prefix keeps going to one
    rank, whose device cache holds it), unless that rank has ``max_imbalance`` more requests in flight
    than the least-loaded one (then the least loaded, lowest first). ``load``: requests in flight per
    rank, kept by the caller (`begin`/`end`). Torch-free."""

    def __init__(self, dp: int, block_size: int, *, max_imbalance: int = 2):
        from ...route.policy import Pool

        if max_imbalance < 1:
            raise ValueError(f"max_imbalance must be >= 1, got {max_imbalance}")
        self.block_size, self.max_imbalance = block_size, max_imbalance
        self._pool = Pool([f"dp{r}" for r in range(dp)], policy="prefix")
        self.load = [0] * dp

    def choose(self, prompt: Sequence[int]) -> int:
        r = self._pool.backends.index(self._pool.pick(prefix_affinity_key(prompt, self.block_size)))
        low = min(range(len(self.load)), key=lambda i: (self.load[i], i))
        return low if self.load[r] - self.load[low] >= self.max_imbalance else r

    def begin(self, r: int) -> None:
        self.load[r] += 1

    def end(self, r: int) -> None:
        self.load[r] -= 1


class DataParallelLLM:
    """`LLMEngine`'s step API over the DP ranks (what ``graphgen serve`` drives): ``add_request`` goes
    to the rank `DPRouter` picks; ``step`` is one tick on every rank (each steps
    its own requests; an idle one runs dummy forwards) and returns every rank's outputs; ``has_work``
    is any rank's. Request ids must be unique across ranks (the server's are)."""

    def __init__(self, engine: "DataParallelEngine"):
        self._engine = engine
        self.owner: dict[Any, int] = {}  # request id -> its DP rank (while it runs)

    def _call(self, dp_rank: Optional[int], method: str, *args) -> list:
        replies = self._engine.on_ranks(_rank_llm, dp_rank, method, args)
        for status, value in replies:
            if status == "invalid":
                raise ValueError(value)
        return [value for _, value in replies]

    eos_token_ids = property(None, lambda self, ids: self._call(None, "set", "eos_token_ids", tuple(ids)))

    def add_request(self, req_id, prompt_ids: Sequence[int], params=None, *, max_tokens: Optional[int] = None,
                    fork_of=None) -> None:
        prompt = [int(t) for t in prompt_ids]
        r = self.owner.get(fork_of) if fork_of is not None else None  # a fork shares its parent's blocks
        r = self._engine.router.choose(prompt) if r is None else r
        self._call(r, "add_request", req_id, prompt, params, max_tokens, fork_of)
        self.owner[req_id] = r
        self._engine.router.begin(r)

    def abort(self, req_id, forks: bool = True) -> None:
        r = self.owner.pop(req_id, None)
        if r is not None:
            self._engine.router.end(r)
            self._call(r, "abort", req_id, forks)

    def step(self) -> list:
        outs = [o for rank_out in self._call(None, "step") for o in rank_out]
        for o in outs:
            if o.finished and o.req_id in self.owner:
                self._engine.router.end(self.owner.pop(o.req_id))
        return outs

    def has_work(self) -> bool:
        return any(self._call(None, "has_work"))

    def stats(self) -> dict:
        """Every rank's stats summed (gauges and totals alike), ``per_rank``: each rank's."""
        per = self._call(None, "stats")
        total = {k: sum(s[k] for s in per) for k in per[0] if isinstance(per[0][k], (int, float))}
        return {**total, "per_rank": per}

    def shutdown(self, timeout: Optional[float] = None) -> None:
        self._call(None, "shutdown", timeout)


class DataParallelEngine(DistributedEngine):
    """``dp`` rank processes, each a DP group with its own requests (see the module doc). The `Engine`
    calls: ``generate`` spreads the prompts over the ranks (``ranks=``: the DP rank of each prompt,
    else `DPRouter.choose`) and returns the results in prompt order; ``llm``: `DataParallelLLM`;
    ``stats``: the ranks' connector counters summed."""

    def __init__(self, spec, weights, *, max_imbalance: int = 2, **kwargs):
        self.router = DPRouter(spec.parallel.dp, spec.kv_cache.block_size, max_imbalance=max_imbalance)
        super().__init__(spec, weights, **kwargs)
        self.dp = spec.parallel.dp
        self.last_ranks: list[int] = []  # the DP rank of each prompt of the last generate
        self.llm = DataParallelLLM(self)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, *, batch: bool = False,
                 settle: bool = True, ranks: Optional[Sequence[int]] = None):
        """As `Engine.generate` (``batch``: all prompts at once, each rank batching its own), over the
        DP ranks: prompt ``i`` runs on DP rank ``ranks[i]`` (default: `DPRouter.choose`)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        prompts = [list(p) for p in prompts]
        for p in prompts:
            if not p:
                raise ValueError("empty prompt")
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.spec.dims.vocab_size
                   for t in p):
                raise ValueError(f"prompt token ids must be ints in [0, {self.spec.dims.vocab_size})")
        if ranks is None:
            ranks = []
            for p in prompts:  # spread as they come: a batch's load counts
                ranks.append(self.router.choose(p))
                self.router.begin(ranks[-1])
            for r in ranks:
                self.router.end(r)
        elif len(ranks) != len(prompts) or any(not 0 <= r < self.dp for r in ranks):
            raise ValueError(f"ranks: one DP rank in [0, {self.dp}) per prompt")
        tagged = [(i, r, p) for i, (r, p) in enumerate(zip(ranks, prompts))]
        groups = [tagged] if batch else [[t] for t in tagged]
        merged: dict = {}
        for res in self.on_ranks(_rank_generate, groups, max_new_tokens, settle):
            if "error" in res:
                j, err, tb = res["error"]
                raise RuntimeError(f"prompt {j}: {err}\n{tb}")
            merged.update(res)
        self.last_ranks = list(ranks)
        return [merged[i] for i in range(len(prompts))]

    @property
    def stats(self) -> dict:
        """The DP ranks' connector counters summed (each rank saves and loads its own requests' KV)."""
        per = self.rank_stats
        return {k: sum(s[k] for s in per) for k in per[0]}
