"""The CPU model runner: a step plan in, its `StepOutput` out; it owns the worker side of the KV
connector (as vLLM's model runner does): every save the plan asks for is made here.

``submit(plan)`` builds the module's inputs from the plan (`build_inputs`: the plan's rows become
the flat token/position/slot tensors the generated module reads), pins and stages the step's save
(`KVConnector.prepare_save`), stacks the loaded history blocks the plan carries, and runs the
step — inline, or on the ``forward`` worker thread when the caller schedules ahead (async
scheduling). ``collect(future)`` waits for it, hands the save to the connector (commit after the
save's event: inline for ``sync``, on the host stream for ``async``), then makes the plan's saves
from the cache (`StepPlan.cache_saves`: decode-time saves and write-backs, pinned now, committed
after the forward's), and returns the `StepOutput`: each row's logits (and hidden states), the
`SaveReport` and the forward's span. A plan with no rows runs no forward, only its cache saves.
The MTP drafter's runs come through the same two calls (a plan of the ``mtp`` variant with its
``prev_hidden``). `RunnerSaves` holds the rest of the connector's worker side a runner owns
(waiting for commits, closing), for the NPU runner too.

Per step it binds the module's events to a fresh generation (so a wait of this step can never be
satisfied by an earlier step's record), runs ``mod.run`` on the CPU runtime, and keeps
`StepHandles`: the logits, the save program the module launched (a `Job` on the save stream) and
the save's event bound to this step (``HOST_EVENT``: what a commit must wait for). Nothing is
recovered afterwards from shared state: the module's launches go through a per-step view of the
runtime (`StepRuntime`) that keeps them.

If the forward raises, the step's events are aborted (the save program, blocked on an event the
forward will never record, is released with `EventAborted`), its launched jobs are waited for, and
the error propagates.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ...ir.graph import SAVE_STREAM
from ..core.cpu_runtime import CpuRuntime
from ..core.kvcache import slot_mapping
from ..core.streams import BoundEvent, EventSet, Job, Stream
from ..core.weights import load_time_weights
from .kv_load import LoadedBlocks
from .request import StepPlan
from .step_output import SaveReport, StepOutput

__all__ = ["StepInputs", "MtpInputs", "StepHandles", "StepRuntime", "StepFuture", "RunnerSaves", "CpuModelRunner",
           "build_inputs", "stack_loads"]


@dataclass
class StepInputs:
    """What the host fills before a CPU graph runs (names match the IR's step inputs)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    logits_indices: torch.Tensor
    save_block_ids: torch.Tensor
    # the cache blocks a history prefill's loaded blocks go to (the graph's kv_load writes them)
    load_block_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # Multi-LoRA (a spec with a lora: section): each token's adapter slot (0: the base model; None: no token
    # has an adapter) and the slots by checkpoint weight (graphgen.runtime.lora.slots)
    lora_index: Optional[torch.Tensor] = None
    lora: Optional[Mapping] = None


@dataclass
class MtpInputs(StepInputs):
    """The MTP graph's inputs: the step inputs plus each row's previous hidden state ``[T, H]``."""

    prev_hidden: Optional[torch.Tensor] = None


def build_inputs(plan: StepPlan, block_size: int) -> StepInputs:
    """The CPU module's inputs for ``plan``: rows in order, each row's tokens contiguous; logits at
    each row's ``logits_positions``; block tables padded with block 0 (never read past seq_len)."""
    rows = plan.rows
    ids, pos, slots, logit_idx, offset = [], [], [], [], 0
    for row in rows:
        slots.append(slot_mapping(row.block_table, row.start, row.seq_len, block_size))
        ids.extend(row.token_ids)
        pos.extend(row.positions)
        logit_idx.extend(offset + i for i in row.logits_positions)
        offset += row.num_tokens
    width = max(len(r.block_table) for r in rows)
    tables = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        tables[i, :len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.long)
    long = torch.long
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=long), positions=torch.tensor(pos, dtype=long),
        slot_mapping=torch.cat(slots), block_tables=tables,
        seq_lens=torch.tensor([r.seq_len for r in rows], dtype=long),
        query_lens=torch.tensor([r.num_tokens for r in rows], dtype=long),
        logits_indices=torch.tensor(logit_idx, dtype=long),
        save_block_ids=torch.tensor(plan.save_block_ids, dtype=long),
        load_block_ids=torch.tensor(plan.load_block_ids, dtype=long))


def stack_loads(plan: StepPlan) -> list:
    """The plan's loaded history blocks per layer, per component ``[num loaded, *shape]`` (row j
    for ``plan.load_block_ids[j]``); [] when the step loads nothing. One row's `LoadedBlocks` run
    is handed over as its staging's views (no copy: the graph's kv_load copies them into the cache
    once); several rows' runs are concatenated per layer and component."""
    runs = [row.loaded.layers() if isinstance(row.loaded, LoadedBlocks) else _stack_blocks(row.loaded)
            for row in plan.rows if len(row.loaded)]
    if len(runs) <= 1:
        return runs[0] if runs else []
    return [tuple(torch.cat([run[layer][c] for run in runs]) for c in range(len(runs[0][layer])))
            for layer in range(len(runs[0]))]


def _stack_blocks(blocks) -> list:
    """Per-block stagings (``[1, *shape]`` per layer, per component) stacked per layer and component."""
    return [tuple(torch.cat([blk[layer][c] for blk in blocks]) for c in range(len(blocks[0][layer])))
            for layer in range(len(blocks[0]))]


def lora_inputs(plan: StepPlan, slots) -> tuple[Optional[torch.Tensor], list[int]]:
    """(each token's adapter slot, or None when no row has an adapter; the slots acquired, which the step
    holds until it is collected) for a LoRA module's step: `LoraSlots.acquire` loads the rows' adapters on
    demand (LRU) and never overwrites a slot a running step holds."""
    adapters = [row.request.lora for row in plan.rows]
    if all(a is None for a in adapters):
        return None, []
    got = slots.acquire(adapters)
    index = torch.cat([torch.full((row.num_tokens,), got[a.digest] if a is not None else 0, dtype=torch.long)
                       for row, a in zip(plan.rows, adapters)])
    return index, list(got.values())


@dataclass
class StepFuture:
    """A submitted step: its plan, its save (pinned, staged) and the forward (a `Job`, or done)."""

    plan: StepPlan
    save: Any = None  # the connector's PendingSave, when the variant saves
    job: Optional[Job] = None  # the forward on the worker thread (async scheduling)
    handles: Any = None  # the forward's result when it ran inline (the CPU runner's StepHandles)
    span: Optional[tuple[float, float]] = None  # (t_start, t_end) of the forward, when the runner times it there
    lora_slots: list = field(default_factory=list)  # the LoRA slots it holds until collected


@dataclass(frozen=True)
class StepHandles:
    """What one step started. ``save_job``/``save_done`` are None when the module saves nothing."""

    logits: torch.Tensor
    save_job: Optional[Job] = None
    save_done: Optional[BoundEvent] = None
    # every row's last hidden state, from the modules of a spec with MTP layers (what the MTP
    # layer drafts from; graphgen.runtime.engine.spec_decode); None otherwise
    hidden: Optional[torch.Tensor] = None
    span: tuple[float, float] = (0.0, 0.0)  # (t_start, t_end) of the forward, as the runner timed it


class StepRuntime:
    """``rt`` as one step's module sees it: every op and event call goes to the shared runtime;
    ``launch`` also keeps the job, per stream, for the runner to return. With an ``observer`` (see
    `graphgen.trace.StepObserver`) the save copies and the record of the step's host event (its KV
    is staged; on the save stream for ``write: async``, inline on main for ``sync``) are reported."""

    __slots__ = ("_rt", "launched", "_obs", "_t0", "_step", "_host")

    def __init__(self, rt: CpuRuntime, observer=None, forward_start: float = 0.0, step: int = 0,
                 host_event: Optional[str] = None):
        self._rt = rt
        self.launched: dict[str, Job] = {}
        self._obs, self._t0, self._step, self._host = observer, forward_start, step, host_event

    def launch(self, stream: str, fn: Callable[[], None]) -> Job:
        if stream in self.launched:  # one program per stream per step: a second one is a codegen bug
            raise RuntimeError(f"the step launched a second program on stream {stream!r}")
        job = self._rt.start(stream, fn)
        self.launched[stream] = job
        return job

    def record(self, ev) -> None:
        self._rt.record(ev)
        if self._obs is not None and ev.name == self._host:  # the step's KV is staged (either write mode)
            self._obs.save_done(self._t0, time.perf_counter(), step=self._step)

    # the save copies, timed when observed (kv_save_layers is the bulk form of kv_save)
    def kv_save(self, cache, block_ids, staging) -> None:
        if self._obs is None:
            return self._rt.kv_save(cache, block_ids, staging)
        t = time.perf_counter()
        self._rt.kv_save(cache, block_ids, staging)
        self._obs.save_copy(t, time.perf_counter(), blocks=len(block_ids))

    def kv_save_layers(self, kv, layers, block_ids, staging) -> None:
        if self._obs is None:
            return self._rt.kv_save_layers(kv, layers, block_ids, staging)
        t = time.perf_counter()
        self._rt.kv_save_layers(kv, layers, block_ids, staging)
        self._obs.save_copy(t, time.perf_counter(), blocks=len(block_ids), layers=len(layers))

    def __getattr__(self, name: str):
        return getattr(self._rt, name)


class RunnerSaves:
    """The KV connector's worker side beyond one step, as a model runner (CPU or NPU) owns it:
    ``connector`` is a `KVConnector` (None: the runner saves nothing)."""

    connector: Any

    def collect(self, fut: StepFuture) -> StepOutput:  # every runner's: the step's output
        raise NotImplementedError

    def save_report(self, pinned: Sequence[int]) -> SaveReport:
        """A step's `SaveReport`: ``pinned`` by it; commits landed since the last report (reaped)."""
        if self.connector is None:
            return SaveReport(tuple(pinned))
        landed = self.connector.reap()
        return SaveReport(tuple(pinned), landed, self.connector.pending)

    def save_from_cache(self, block_ids: Sequence[int], keys: Sequence[str]) -> list[int]:
        """Save blocks from the cache (a landed step filled them: nothing stages them); the ids pinned."""
        if not block_ids or self.connector is None or self.connector.write == "off":
            return []
        self.save_filled(block_ids, keys)
        return list(block_ids)

    def save_filled(self, block_ids: Sequence[int], keys: Sequence[str]) -> None:
        """Pin, pack from the cache, commit (`KVConnector.save_filled`; the NPU runner: through its ring)."""
        self.connector.save_filled(block_ids, keys)

    def settle(self, fut: StepFuture) -> None:
        """Let a step go without its output (shutdown, an error elsewhere): its save is handed off if the
        forward succeeded, cancelled if it failed; its error, if any, is not raised again."""
        try:
            self.collect(fut)
        except BaseException:
            pass

    def save_stats(self) -> dict:
        """The connector's counters (``puts``, ...) and ``saves_pending`` (commits not reaped yet)."""
        if self.connector is None:
            return {"saves_pending": 0}
        self.connector.reap()
        return {"saves_pending": self.connector.pending, **self.connector.stats}

    def drain_saves(self, timeout: Optional[float] = None) -> None:
        """Wait for every pending commit (failures are logged and counted, never raised)."""
        if self.connector is not None:
            self.connector.drain(timeout)

    def saves_in_flight(self) -> int:
        """Commits not finished yet; safe from any thread (P/D's handoff waits on it)."""
        return self.connector.in_flight() if self.connector is not None else 0

    def close_saves(self) -> None:
        """Commit what is pending and stop the connector's host stream."""
        if self.connector is not None:
            self.connector.close()


class CpuModelRunner(RunnerSaves):
    """Runs the generated CPU modules of one spec (``modules``: variant -> module) on ``cache``,
    committing saves through ``connector`` (the worker side of the KV connector)."""

    def __init__(self, modules: Mapping[str, types.ModuleType], weights: Mapping, cache, rt: CpuRuntime,
                 connector=None, *, event_timeout: Optional[float] = 120.0):
        self.modules = dict(modules)
        # the modules' load-time weights (merged, [in, out] projections: `graphgen.runtime.core.weights`)
        # built once here, their sources dropped; a rank builds them from its own slices
        self.W = load_time_weights(weights, self.modules.values())
        self.cache = cache
        self.rt = rt
        self.connector = connector
        self.block_size = cache.block_size if cache is not None else None
        self.events = {v: EventSet(m.EVENTS, default_timeout=event_timeout) for v, m in self.modules.items()}
        self._gen = 0  # step counter: the generation every event of a step is bound to
        self._forward: Optional[Stream] = None  # the worker thread of async scheduling
        self.observer = None  # a graphgen.trace.StepObserver: forward spans, save copies, save done
        self.lora_slots: Any = None  # a graphgen.runtime.lora.LoraSlots, for a spec with a lora: section (assembly)
        # a rank feature's share of each step (context parallel's head-tail split: its `step_inputs` and
        # `execute` around this runner's; graphgen.runtime.parallel.context_parallel.ContextSplit), or None
        self.split = None

    def saves(self, variant: str) -> bool:
        """Whether the variant's module has a save program (then it takes a staging area)."""
        return self.modules[variant].HOST_EVENT is not None

    def step_inputs(self, plan: StepPlan) -> StepInputs:
        """The module's inputs for ``plan`` (a context-parallel rank builds only its share of a prefill;
        a draft run's plan adds its ``prev_hidden``: `MtpInputs`)."""
        if self.split is not None:
            share = self.split.step_inputs(plan, self.block_size)
            if share is not None:
                return share
        base = build_inputs(plan, self.block_size)
        if plan.prev_hidden is None:
            return base
        return MtpInputs(**{f: getattr(base, f) for f in StepInputs.__dataclass_fields__}, prev_hidden=plan.prev_hidden)

    # ---- the runner interface (CPU, rank and NPU runners alike) ----------------------------------
    def submit(self, plan: StepPlan, *, background: bool = False) -> StepFuture:
        """Start ``plan``: pin and stage its save, build its inputs, run it (``background``: on the
        forward thread, so the caller can schedule the next step meanwhile). A plan with no rows:
        nothing runs (`collect` makes its cache saves)."""
        if not plan.rows:
            return StepFuture(plan)
        save = self.connector.prepare_save(plan.save_block_ids, plan.save_keys) if plan.saves else None
        held: list = []
        try:
            inputs = self.step_inputs(plan)
            if self.lora_slots is not None and self.modules[plan.variant].META.get("lora"):
                inputs.lora_index, held = lora_inputs(plan, self.lora_slots)
                inputs.lora = self.lora_slots.views()
            loads = stack_loads(plan)
            if not loads and self.modules[plan.variant].META.get("history"):
                # a history variant with nothing to load (a later chunk of a prompt: its history is
                # in the cache already): its kv_load program copies zero blocks per layer
                loads = self.cache.make_staging(0)
            fut = StepFuture(plan, save, lora_slots=held)
            if background:
                if self._forward is None:
                    self._forward = Stream("forward")
                fut.job = self._forward.launch(self._timed, plan.variant, inputs, save, loads)
            else:
                fut.handles = self._timed(plan.variant, inputs, save, loads)
            return fut
        except BaseException:
            if held:
                self.lora_slots.release(held)
            if save is not None:
                self.connector.cancel(save)
            raise

    def collect(self, fut: StepFuture) -> StepOutput:
        """Wait for the step, hand its save to the connector, make the plan's saves from the cache, and
        return its `StepOutput` (row i's logits ``[len(row.logits_positions), vocab]``)."""
        rows, pinned = fut.plan.rows, []
        handles: Optional[StepHandles] = None
        if rows:
            try:
                handles = fut.handles if fut.job is None else fut.job.result()
            except BaseException:
                if fut.save is not None:
                    self.connector.cancel(fut.save)
                raise
            finally:  # the forward is over: its adapter slots may be reloaded from now on
                if fut.lora_slots:
                    self.lora_slots.release(fut.lora_slots)
                    fut.lora_slots = []
            if fut.save is not None:
                self.connector.handoff(fut.save, handles.save_job, handles.save_done)
                pinned += fut.save.block_ids
        pinned += self.save_from_cache(*fut.plan.cache_saves())  # the forward is done: its KV is in the cache
        saves = self.save_report(pinned)
        if handles is None:
            return StepOutput(saves=saves)
        hidden = None if handles.hidden is None else tuple(torch.split(handles.hidden, [r.num_tokens for r in rows]))
        return StepOutput(tuple(torch.split(handles.logits, [len(r.logits_positions) for r in rows])), hidden, saves,
                          spans=(("forward", *handles.span),))

    def close(self) -> None:
        try:
            if self._forward is not None:
                self._forward.close()
                self._forward = None
        finally:
            self.close_saves()

    # ---- one module run ---------------------------------------------------------------------
    def _timed(self, variant: str, inputs, save, loads) -> StepHandles:
        t = time.perf_counter()
        handles = self.execute(variant, inputs, save.staging if save is not None else None, loads)
        return replace(handles, span=(t, time.perf_counter()))

    def execute(self, variant: str, inputs, staging=None, loads=()) -> StepHandles:
        """Run one module on built inputs (through the rank's ``split``, when it has one)."""
        if self.split is not None:
            return self.split.execute(self._execute, variant, inputs, staging, loads)
        return self._execute(variant, inputs, staging, loads)

    def _execute(self, variant: str, inputs, staging=None, loads=()) -> StepHandles:
        """Run one module on built inputs. ``staging``: the save's pool staging (exactly when the
        module saves); ``loads``: the loaded history blocks per layer (empty when the variant loads
        nothing), copied into the cache by the module's kv_load stream."""
        mod = self.modules[variant]
        if (staging is None) != (mod.HOST_EVENT is None):
            raise ValueError(f"{variant}: a staging area is needed exactly when the module saves "
                             f"(HOST_EVENT={mod.HOST_EVENT!r}, staging given: {staging is not None})")
        self._gen += 1
        ev = self.events[variant].bind(self._gen)
        obs = self.observer
        t0 = time.perf_counter()
        rt = StepRuntime(self.rt, obs, t0, self._gen, mod.HOST_EVENT)
        try:
            with torch.inference_mode():
                out = mod.run(rt, self.W, inputs, self.cache, staging, loads, ev)
        except BaseException:
            ev.abort("the forward failed")
            for job in rt.launched.values():
                job.wait()
            raise
        if obs is not None:
            obs.forward(variant, t0, time.perf_counter(), tokens=int(inputs.input_ids.numel()),
                        seqs=int(inputs.seq_lens.numel()), step=self._gen)
        logits, hidden = out if isinstance(out, tuple) else (out, None)
        return StepHandles(logits, rt.launched.get(SAVE_STREAM),
                           ev[mod.HOST_EVENT] if mod.HOST_EVENT is not None else None, hidden)
