"""The commands a driver sends its rank processes: one frozen dataclass per command, one dispatch table
(`HANDLERS`: command type -> handler), as SGLang's ``io_struct`` with its type-based dispatcher.

The driver (`graphgen.runtime.parallel.launcher.DistributedEngine`, its `DistributedCore`, and
`graphgen.runtime.parallel.data_parallel.DataParallelCore`) sends every rank the same command, in the same
order (the followers of other nodes relay it as it is); each rank process (`graphgen.runtime.parallel.
rank_process`) runs ``handle(rank, command)`` on its `Rank` — its engine and its rank features, never a
reach into its runner's runtime — and replies. ``EVERY_RANK`` says whose replies the driver keeps: rank 0's
(lockstep: every rank computed the same), or every rank's (counters, probes, DP ranks' own requests).

The step API (`EngineCore`'s, what ``graphgen serve`` drives) is one command per call (`AddRequest`, `Abort`,
`Step`, `HasWork`, `CoreStats`, `Shutdown`, `SetAttr`); their replies are ``("ok", value)``, or
``("invalid", message)`` when ``add_request`` refused its input (nothing was queued; the driver raises it).
Under DP attention a step call goes to one DP rank or to all (`OnDPRank`), and a `Step` is a tick.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

__all__ = ["Rank", "Generate", "Drain", "Stats", "Probe", "Close", "SaveLedgers", "StepCall", "SetAttr",
           "AddRequest", "Abort", "Step", "HasWork", "CoreStats", "Shutdown", "DPGenerate", "OnDPRank",
           "HANDLERS", "handle", "failure_words"]


@dataclass
class Rank:
    """One rank process's side of the commands: its engine, its coordinates (`RankCoords`) and its
    rank features (the DP forward agreement under DP attention: ``dp``)."""
    engine: Any
    coords: Any
    dp: Any = None
    shard: tuple = (0, 1)  # the pool-key shard its KV is saved under (owner, tp)
    writes: bool = True    # whether it puts that shard (else its owner does)


# ---- the Engine calls -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Generate:
    prompts: list
    max_new_tokens: int
    options: dict = dataclasses.field(default_factory=dict)
    EVERY_RANK: ClassVar[bool] = False


@dataclass(frozen=True)
class Drain:
    timeout: Optional[float] = None
    EVERY_RANK: ClassVar[bool] = False


@dataclass(frozen=True)
class Stats:
    """The rank's connector counters (``skipped_puts``: puts it left to the shard's owner)."""
    EVERY_RANK: ClassVar[bool] = True


@dataclass(frozen=True)
class SaveLedgers:
    """The rank's `SaveLedger` (what its scheduler took from every step's `SaveReport`), its pool-key shard
    and whether it puts it: what `RanksSaveReport.aggregate` takes."""
    EVERY_RANK: ClassVar[bool] = True


@dataclass(frozen=True)
class Probe:
    """``fn(engine, *args)`` on every rank: a test's probe of its own rank (no collectives, unless every
    rank runs it alike, as the DP commands do)."""
    fn: Callable
    args: tuple = ()
    EVERY_RANK: ClassVar[bool] = True


@dataclass(frozen=True)
class Close:
    EVERY_RANK: ClassVar[bool] = False


# ---- the step API ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepCall:
    """One `EngineCore` call; ``METHOD`` names it in failure sentences (``during step``); ``POLL``: a call
    that is no request's work (``graphgen serve`` polls it between steps and while idle, so a failure
    during one is a failure between commands: docs/parallel.md, "Failure")."""
    METHOD: ClassVar[str] = ""
    POLL: ClassVar[bool] = False
    EVERY_RANK: ClassVar[bool] = False

    def run(self, core):
        return getattr(core, self.METHOD)()


@dataclass(frozen=True)
class SetAttr(StepCall):
    name: str
    value: Any
    METHOD: ClassVar[str] = "set"

    def run(self, core):
        setattr(core, self.name, self.value)


@dataclass(frozen=True)
class AddRequest(StepCall):
    req_id: Any
    prompt: list
    params: Any = None
    max_tokens: Optional[int] = None
    fork_of: Any = None
    METHOD: ClassVar[str] = "add_request"

    def run(self, core):
        core.add_request(self.req_id, self.prompt, self.params, max_tokens=self.max_tokens, fork_of=self.fork_of)


@dataclass(frozen=True)
class Abort(StepCall):
    req_id: Any
    forks: bool = True
    METHOD: ClassVar[str] = "abort"

    def run(self, core):
        return core.abort(self.req_id, self.forks)


@dataclass(frozen=True)
class Step(StepCall):
    METHOD: ClassVar[str] = "step"


@dataclass(frozen=True)
class HasWork(StepCall):
    METHOD: ClassVar[str] = "has_work"
    POLL: ClassVar[bool] = True


@dataclass(frozen=True)
class CoreStats(StepCall):
    METHOD: ClassVar[str] = "stats"
    POLL: ClassVar[bool] = True


@dataclass(frozen=True)
class Shutdown(StepCall):
    timeout: Optional[float] = None
    METHOD: ClassVar[str] = "shutdown"

    def run(self, core):
        return core.shutdown(self.timeout)


def failure_words(call) -> str:
    """How the sentence of a failure during ``call`` ends: ``during step``, or ``(between commands)``."""
    if isinstance(call, OnDPRank):
        call = call.call
    return "(between commands)" if getattr(call, "POLL", False) else f"during {getattr(call, 'METHOD', 'the call')}"


# ---- DP attention ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DPGenerate:
    """`Engine.generate` over the DP ranks (`graphgen.runtime.parallel.dp_rank.dp_generate`)."""
    groups: list
    max_new_tokens: int
    settle: bool
    EVERY_RANK: ClassVar[bool] = True


@dataclass(frozen=True)
class OnDPRank:
    """A step-API ``call`` on DP rank ``dp_rank`` only (None: on every DP rank); a `Step` is a tick
    (this rank's step, then dummy forwards while another rank runs)."""
    dp_rank: Optional[int]
    call: StepCall
    EVERY_RANK: ClassVar[bool] = True


# ---- the handlers ---------------------------------------------------------------------------------
def _step_call(rank: Rank, call: StepCall):
    try:
        return "ok", call.run(rank.engine.core)
    except ValueError as e:
        if isinstance(call, AddRequest):  # refused its input: nothing was queued
            return "invalid", str(e)
        raise


def _stats(rank: Rank, cmd: Stats) -> dict:
    engine = rank.engine
    skipped = getattr(engine.connector.pool, "skipped_puts", 0)  # counted as puts by the connector
    return {**engine.stats, "puts": engine.stats["puts"] - skipped, "skipped_puts": skipped}


def _on_dp_rank(rank: Rank, cmd: OnDPRank):
    if cmd.dp_rank is not None and cmd.dp_rank != rank.dp.dp_rank:
        return "ok", None
    if isinstance(cmd.call, Step):
        from .dp_rank import dp_tick

        return "ok", dp_tick(rank.engine, rank.dp)
    return _step_call(rank, cmd.call)


def _dp_generate(rank: Rank, cmd: DPGenerate):
    from .dp_rank import dp_generate

    return dp_generate(rank.engine, rank.dp, cmd.groups, cmd.max_new_tokens, cmd.settle)


def _save_ledgers(rank: Rank, cmd: SaveLedgers):
    return rank.engine.scheduler.saves, rank.shard, rank.writes


HANDLERS: dict[type, Callable] = {
    Generate: lambda rank, cmd: rank.engine.generate(cmd.prompts, cmd.max_new_tokens, **cmd.options),
    Drain: lambda rank, cmd: rank.engine.drain(cmd.timeout),
    Stats: _stats,
    SaveLedgers: _save_ledgers,
    Probe: lambda rank, cmd: cmd.fn(rank.engine, *cmd.args),
    DPGenerate: _dp_generate,
    OnDPRank: _on_dp_rank,
    **{c: _step_call for c in (SetAttr, AddRequest, Abort, Step, HasWork, CoreStats, Shutdown)},
}


def handle(rank: Rank, cmd):
    """Run ``cmd`` on ``rank`` by its type (`HANDLERS`); an unknown command is a ``TypeError``."""
    handler = HANDLERS.get(type(cmd))
    if handler is None:
        raise TypeError(f"unknown rank command {cmd!r}")
    return handler(rank, cmd)
