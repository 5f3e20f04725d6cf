"""What a rank is, decided in one place: `build_rank(spec, layout, target)` gives every rank of a layout
(CPU or another target's) its process groups, its KV side, its weight slices and its rank features,
and has the target build its engine around them.

A rank is an ordinary engine of its target given four parts of its own:

* its **process groups** by name, from the layout's one table (`graphgen.runtime.parallel.layout`);
  the CPU target's runtime resolves a module's ``group=`` in it
  (`graphgen.runtime.parallel.collectives.CollectiveRuntime`), the NPU's binds its modules' HCCL group
  names from it;
* its **KV side** (`graphgen.runtime.parallel.rank_kv.RankParts`): its KV shard, per-shard pool keys,
  agreed hits, save-once, the drain barrier;
* its **weight slices** (`rank_slices`: by TP rank, or by EP index for the experts under DP attention);
* its **rank features** (`graphgen.runtime.parallel.features`): the plan check (more than one rank in its
  lockstep group: ``cp × tp > 1``, on that group), the DP forward agreement (``dp > 1``: the target's
  `RankTarget.dp_forward`, over the whole world), the CP split (``cp > 1``) —
  applied by one `RankRunner` around the target's own runner (`RankSetup.wrap`).

A target's builder is ``build(spec, weights, *, rank: RankSetup, pool, faults, spec_file, sources, **options)
-> Engine``; it takes `RankSetup.engine_options` (KV shapes, connector factories, the runner wrap, no async
scheduling under DP attention) into its ordinary engine. The CPU's is `cpu_rank_engine`.

**Why lockstep.** Ranks of one DP group run in lockstep: each has its own scheduler, fed the same calls
in the same order by the launcher (`DistributedCore`), with hits agreed by collectives, so every rank
plans the same steps. Why not one scheduler on rank 0 broadcasting its plan (as vLLM does)? Each rank's
KV shard has its own pool keys and its own hits, so a broadcast plan would still need the same per-rank
agreement (the MIN collectives) and per-rank load staging; the calls the launcher broadcasts carry no
more than the plan would. What lockstep needs — that no rank's plan drifts — is checked every step
(`graphgen.runtime.parallel.features.PlanCheck`).

**Threads.** Without async scheduling every collective runs on the caller's (main) thread, in the same order
on every rank: the plan check, the forward's (the graph's), then the connector's (lookup, load, drain), which
the scheduler issues in the same deterministic order on every rank because every rank sees the same prompts
and agreed hits. With async scheduling (``dp = 1``) the forward runs on the forward thread while the caller's
thread plans step N+1; what the caller's thread issues meanwhile -- the hit MINs of its pool lookups and loads
-- runs on the **host-side group** (``host``/``lockstep``), a gloo group of its own that no module's
collective uses (`graphgen.runtime.parallel.rank_process` makes it even when the world is gloo), and what the
forward thread issues runs on the modules' groups only. So each group sees one thread at a time, in one
order on every rank: the plan check and the DP handshake run at launch (the caller's thread, no forward in
flight), the CP logits reduce inside the forward, the drafter's runs after a step landed and before the next
is launched. Under DP attention (``dp > 1``) async scheduling stays off: a DP rank with nothing to run
serves the others' forwards with dummies between the launcher's calls, a protocol of whole steps.

**Targets.** What a rank process builds is looked up by name in `RANK_TARGETS` (``"cpu"``:
`cpu_rank_engine`); another target registers its builder with `register_rank_target` when its module is
imported (the NPU's: ``graphgen.npu.run.runner``), and the launcher names that module in the rank's
config, so the rank process imports it without the runtime importing the target. The target's
``setup`` picks the rank's device and the process group's backend (``gloo`` here, ``hccl`` on an NPU)
before the group is made; the host-side agreement (plan check, hit MINs, drain barrier, the DP
handshake) always runs on a gloo group (the world group when it is gloo, else a gloo group beside it).
The rank process itself: `graphgen.runtime.parallel.rank_process`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from ..engine.assembly import cpu_engine
from ..engine.engine import Engine
from .collectives import CollectiveRuntime
from .context_parallel import ContextSplit
from .dp_rank import CpuDPForward, DPLayout, dp_rank_weights
from .features import PlanCheck, RankRunner
from .layout import RankGroups, RankLayout
from .ops import rank_weights
from .rank_kv import RankParts, rank_parts

__all__ = ["RankSetup", "build_rank", "rank_slices", "cpu_rank_engine", "RankTarget", "RANK_TARGETS",
           "register_rank_target"]


@dataclasses.dataclass
class RankSetup:
    """One rank, as its target's builder gets it: ``groups`` (its process groups, layout and coordinates),
    ``parts`` (its KV side), ``host`` (the host-side gloo group of the world, apart from the world group; None:
    the world's own, in-process tests without async scheduling),
    ``lockstep`` (the gloo group of its DP group's ranks, `RankLayout.lockstep_group`; None: ``host``, when
    dp = 1), ``features`` (made when the runner exists: `wrap`) and ``dp_forward`` (the target's DP feature
    factory, under DP attention)."""
    groups: RankGroups
    parts: RankParts
    host: object = None
    dp_forward: Optional[Callable] = None
    runner: Optional[RankRunner] = None  # set by `wrap`
    lockstep: object = None

    @property
    def lockstep_host(self):
        """The host-side group of the ranks that run this rank's plans (the plan check, the hit MINs)."""
        return self.lockstep if self.layout.dp > 1 else self.host

    @property
    def layout(self) -> RankLayout:
        return self.groups.layout

    @property
    def coords(self):
        return self.groups.coords

    def features(self, runner) -> list:
        lay, co = self.layout, self.coords
        out: list = []
        if lay.world > lay.dp:  # more than one rank plans each step: keep them honest
            out.append(PlanCheck(self.lockstep_host))
        if lay.dp > 1:
            assert self.dp_forward is not None  # every RankTarget has one (register_rank_target)
            out.append(self.dp_forward(co.dp_rank, self.host))
        if lay.cp > 1:
            out.append(ContextSplit(co.cp_rank, lay.cp))
        return out

    def wrap(self, runner) -> RankRunner:
        """The target's runner as this rank (`RankRunner` with the layout's features)."""
        self.runner = RankRunner(runner, self.features(runner))
        return self.runner

    def engine_options(self) -> dict:
        """What a target's ordinary engine builder takes to build this rank (`build_engine`'s options; under DP
        attention no async scheduling: module doc, "Threads")."""
        off = {"async_scheduling": False} if self.layout.dp > 1 else {}
        return {**self.parts.engine_options(), "wrap_runner": self.wrap, **off}


def rank_slices(weights, names, layout: RankLayout, coords, parallel) -> dict:
    """This rank's slices of a dict of checkpoint tensors, by the graph's weight names (a streamed
    `CheckpointWeights` slices itself and is returned as it is): by its TP rank (innermost in the rank
    order), or under DP attention by its EP index for a split into ``ep`` parts (`dp_rank_weights`)."""
    if not isinstance(weights, dict):
        return weights
    if layout.dp > 1:
        return dp_rank_weights(weights, names, DPLayout.of(parallel, coords.rank))
    return rank_weights(weights, names, coords.tp_rank, layout.tp)


def build_rank(spec, layout: RankLayout, target: "RankTarget", *, groups: RankGroups, weights, names,
               host=None, lockstep=None, **build_kwargs) -> tuple[Engine, RankSetup]:
    """Rank ``groups.coords`` of ``layout``: its slices of ``weights`` (``names``: the graph's weight names)
    and its engine, built by ``target`` (``build_kwargs``: the builder's own: pool, faults, spec_file, ...);
    ``host``/``lockstep``: its host-side gloo groups (`RankSetup`)."""
    if RankLayout.of(spec.parallel) != layout:
        raise ValueError(f"spec {spec.name}'s layout {RankLayout.of(spec.parallel)} is not the rank's {layout}")
    if layout.dp > 1 and layout.world > layout.dp and lockstep is None:
        raise ValueError(f"rank {groups.coords.rank} of {layout}: DP groups of several ranks need their lockstep "
                         f"group (RankLayout.lockstep_group)")
    if build_kwargs.get("async_scheduling") and layout.dp == 1 and host is None and layout.world > 1:
        raise ValueError(f"rank {groups.coords.rank} of {layout}: async scheduling on ranks needs a host-side gloo "
                         f"group of its own (the scheduler's collectives must not share the modules' groups)")
    kv_group = lockstep if layout.dp > 1 else host
    setup = RankSetup(groups, rank_parts(spec, layout, groups.coords, kv_group), host, target.dp_forward,
                      lockstep=lockstep)
    mine = rank_slices(weights, names, layout, groups.coords, spec.parallel)
    return target.build(spec, mine, rank=setup, **build_kwargs), setup


def cpu_rank_engine(spec, weights: dict, *, rank: RankSetup, faults=None, event_timeout: float = 120.0,
                    **options) -> Engine:
    """The CPU engine of one rank: the CPU engine with the layout's `CollectiveRuntime` and the rank's options."""
    runtime = CollectiveRuntime(faults, event_timeout=event_timeout, groups=rank.groups)
    return cpu_engine(spec, weights, runtime=runtime, faults=faults, event_timeout=event_timeout,
                      **{**options, **rank.engine_options()})


@dataclasses.dataclass(frozen=True)
class RankTarget:
    """A target's rank builder (module doc); ``setup(local_rank, world, engine_kwargs) -> backend`` runs in the
    rank process before the process group exists (selects the device, names the backend); ``module``: what
    the rank process imports to find it (the builder's own module, which registers it); ``dp_forward(dp_rank,
    host_group) -> DPForward``: its DP attention feature (`graphgen.runtime.parallel.features.DPForward`);
    ``env(env, placement, deadlines) -> dict``: variables the launcher adds to its children's environment
    before they start (so before they import torch; an NPU rank's CANN/HCCL variables), None: none."""
    build: Callable
    setup: Callable
    module: str
    dp_forward: Callable
    env: Optional[Callable] = None


def _gloo(local_rank: int, world: int, engine_kwargs: dict) -> str:
    return "gloo"


RANK_TARGETS: dict[str, RankTarget] = {}


def register_rank_target(name: str, build: Callable, *, setup: Optional[Callable] = None,
                         dp_forward: Optional[Callable] = None, env: Optional[Callable] = None) -> None:
    """Make ``DistributedEngine(..., target=name)`` build each rank with ``build`` (see `RankTarget`)."""
    RANK_TARGETS[name] = RankTarget(build, setup or _gloo, build.__module__, dp_forward or CpuDPForward, env)


register_rank_target("cpu", cpu_rank_engine)
