"""DP attention + expert parallelism on the ranks (``parallel: {dp: N, tp: T, ep: N × T}``).

Each of the ``dp`` DP groups (``tp`` rank processes each, in lockstep as a tp-only engine's ranks are) has
its **own** requests, scheduler, KV cache and connector; the graph (`graphgen.passes.shard`, ``dp > 1``)
runs attention at tp on the group's own tokens, and every MoE layer

    all_gather (group dp)  ->  this rank's E/ep experts and 1/ep of the shared experts on every
    group's tokens (a partial sum)  ->  reduce_scatter (group ep): this rank's share of its group's
    tokens  ->  (tp > 1) all_gather (group tp): the group's tokens again.

The facade keeps one reply per DP group (its TP rank 0's: the group's ranks computed the same), so a
step's outputs, ``has_work`` and the stats are each DP group's once.

The rank side (runtime, runner, dummy forwards, the per-forward handshake, the ticks) is
`graphgen.runtime.parallel.dp_rank`; this module is the facade the caller holds and the router.

**Which rank serves a request** (`DPRouter`): prefix affinity by rendezvous
hashing of the prompt's leading full blocks over the DP ranks (`graphgen.balance.Pool`, policy
``prefix``), unless that rank already holds ``max_imbalance`` more requests than the least-loaded one
(then the least loaded): a shared prefix stays on one rank's device cache while load stays bounded.

**P/D** (``serve --role prefill|decode``, docs/pd.md "P/D with ranks"): the handoff names the ranks' keys
(`DistributedEngine.kv_naming`). They carry no DP rank, so the DP group of P that ran a prompt saves its TP
shards under the keys any DP group of D (or a tp-only instance of the same shards) looks up: D's `DPRouter` picks
the group as for any request, and its ranks load their own shard.

Not built: an all-to-all dispatch.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from . import commands as C
from .commands import failure_words
from .launcher import DistributedEngine

__all__ = ["DataParallelEngine", "DataParallelCore", "DPRouter", "prefix_affinity_key"]


def prefix_affinity_key(prompt: Sequence[int], block_size: int, blocks: int = 4) -> str:
    """What names a prompt's prefix for routing: its leading full blocks (up to ``blocks``), or the
    whole prompt when it is shorter than a block; prompts sharing those blocks get the same key."""
    n = min(len(prompt) // block_size, blocks) * block_size or len(prompt)
    return ",".join(map(str, prompt[:n]))


class DPRouter:
    """Which DP rank a request goes to: prefix affinity (rendezvous hashing of `prefix_affinity_key` over
    the ranks, `graphgen.balance.Pool` with policy ``prefix``: a shared prefix keeps going to one
    rank, whose device cache holds it), unless that rank has ``max_imbalance`` more requests in flight
    than the least-loaded one (then the least loaded, lowest first). ``load``: requests in flight per
    rank, kept by the caller (`begin`/`end`)."""

    def __init__(self, dp: int, block_size: int, *, max_imbalance: int = 2):
        from ...balance import Pool

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


class DataParallelCore:
    """The step API (`EngineCore`'s) over the DP ranks (what ``graphgen serve`` drives): ``add_request`` goes
    to the rank `DPRouter` picks; ``step`` is one tick on every rank (each steps
    its own requests; an idle one runs dummy forwards) and returns every rank's outputs; ``has_work``
    is any rank's. Request ids must be unique across ranks (the server's are)."""

    def __init__(self, engine: "DataParallelEngine"):
        self._engine = engine
        self.owner: dict[Any, int] = {}  # request id -> its DP rank (while it runs)
        self._last_stats: dict = {}

    def _call(self, dp_rank: Optional[int], call: C.StepCall) -> list:
        cmd = C.OnDPRank(dp_rank, call)
        replies = self._engine.per_group(self._engine._command(cmd, what=call.METHOD, when=failure_words(call)))
        for status, value in replies:
            if status == "invalid":
                raise ValueError(value)
        return [value for _, value in replies]

    eos_token_ids = property(None, lambda self, ids: self._call(None, C.SetAttr("eos_token_ids", tuple(ids))))

    def add_request(self, req_id, prompt_ids: Sequence[int], params=None, *, max_tokens: Optional[int] = None,
                    fork_of=None) -> None:
        prompt = [int(t) for t in prompt_ids]
        r = self.owner.get(fork_of) if fork_of is not None else None  # a fork shares its parent's blocks
        r = self._engine.router.choose(prompt) if r is None else r
        self._call(r, C.AddRequest(req_id, prompt, params, max_tokens, fork_of))
        self.owner[req_id] = r
        self._engine.router.begin(r)

    def abort(self, req_id, forks: bool = True) -> None:
        r = self.owner.pop(req_id, None)
        if r is not None:
            self._engine.router.end(r)
            self._call(r, C.Abort(req_id, forks))

    def step(self) -> list:
        outs = [o for rank_out in self._call(None, C.Step()) for o in rank_out]
        for o in outs:
            if o.finished and o.req_id in self.owner:
                self._engine.router.end(self.owner.pop(o.req_id))
        return outs

    def has_work(self) -> bool:
        return any(self._call(None, C.HasWork()))

    def stats(self) -> dict:
        """Every rank's stats summed (gauges and totals alike), ``per_rank``: each rank's."""
        if self._engine._closed:  # a server's last refresh after shutdown: the ranks are gone
            return self._last_stats
        per = self._call(None, C.CoreStats())
        total = {k: sum(s[k] for s in per) for k in per[0] if isinstance(per[0][k], (int, float))}
        # per-position counters (speculative decoding's accepted tokens per draft position): summed position-wise
        total.update({k: [sum(col) for col in zip(*(s[k] for s in per))] for k in per[0] if isinstance(per[0][k], list)})
        self._last_stats = {**total, "per_rank": per}
        return self._last_stats

    def shutdown(self, timeout: Optional[float] = None) -> None:
        self._call(None, C.Shutdown(timeout))


class DataParallelEngine(DistributedEngine):
    """``dp`` rank processes, each a DP group with its own requests (see the module doc). The `Engine`
    calls: ``generate`` spreads the prompts over the ranks (``ranks=``: the DP rank of each prompt,
    else `DPRouter.choose`) and returns the results in prompt order; ``core``: `DataParallelCore`;
    ``stats``: the ranks' connector counters summed."""

    def __init__(self, spec, weights, *, max_imbalance: int = 2, **kwargs):
        self.router = DPRouter(spec.parallel.dp, spec.kv_cache.block_size, max_imbalance=max_imbalance)
        super().__init__(spec, weights, **kwargs)
        self.dp = spec.parallel.dp
        self.last_ranks: list[int] = []  # the DP rank of each prompt of the last generate
        self.core = DataParallelCore(self)

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
        for res in self.per_group(self._command(C.DPGenerate(groups, max_new_tokens, settle), "generate")):
            if "error" in res:
                j, err, tb = res["error"]
                raise RuntimeError(f"prompt {j}: {err}\n{tb}")
            merged.update(res)
        self.last_ranks = list(ranks)
        return [merged[i] for i in range(len(prompts))]

    def per_group(self, replies: list) -> list:
        """Of every rank's replies (world order), each DP group's once: its TP rank 0's."""
        return list(replies[::self.world // self.dp])

    @property
    def stats(self) -> dict:
        """The DP groups' connector counters summed (each group saves and loads its own requests' KV), each
        group's as its TP rank 0 counts them (puts: the MLA latent is put by TP rank 0 only)."""
        per = self.per_group(self.rank_stats)
        return {k: sum(s[k] for s in per) for k in per[0]}
