"""The step-level engine API: requests in, per-step token deltas out (what a server drives).

`LLMEngine` runs one scheduler step per ``step()`` call over the engine's three parts (the
`Scheduler`, the `KVConnector` and the `CpuModelRunner`):

    schedule() -> finalize() -> prepare_save (pin, staging) -> execute -> handoff -> sample -> update

With ``async_scheduling`` the forward runs on a ``forward`` worker thread and, while step N runs,
the caller's thread schedules step N+1 (admission and pool loads, block allocation, every input
tensor). The only input that depends on step N is the token each decode row feeds back: it is left
as a placeholder and filled in by ``Scheduler.finalize`` once step N's logits are sampled; rows of
requests that finished at step N are dropped there. Tokens are identical either way: the same
steps run in the same order on the same inputs; only *when* they are prepared changes.

Threading: every method is called from one thread (the caller's); only the forward runs elsewhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .request import Request, RequestResult, ScheduledStep, StepOutput
from ..core.streams import Job, Stream

__all__ = ["LLMEngine", "RequestOutput", "SampleFn", "greedy"]

SampleFn = Callable[[torch.Tensor, Sequence[Request]], Sequence[int]]


def greedy(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """Argmax of each row (row i is ``requests[i]``'s last position)."""
    return logits.argmax(-1).tolist()


@dataclass(frozen=True)
class RequestOutput:
    """One request's news from one step."""

    req_id: Any
    new_token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: Optional[str] = None  # "length" | "stop" | "abort" | "error" when finished
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the pool (prefix hit)
    num_prompt_tokens: int = 0
    error: Optional[str] = None  # with finish_reason "error": why


class LLMEngine:
    """``scheduler``, ``connector``, ``runner``: an `Engine`'s parts (``Engine.llm`` is one of these).

    ``sample_fn(logits_rows, requests) -> token ids`` (default: `greedy`; a request's ``params`` is
    what ``add_request`` was given). ``eos_token_id``: a stop token (or a collection of them) for every request (unless its
    params say ``ignore_eos``). ``timeline``: a list to append ``(what, step_no, t_start, t_end)``
    spans to (``"schedule"`` on the caller's thread, ``"forward"`` where the forward runs; with async
    scheduling ``"launch"``, an instant: the step queued on the forward thread)."""

    def __init__(self, scheduler, connector, runner, *, vocab_size: int, async_scheduling: bool = False,
                 sample_fn: Optional[SampleFn] = None, eos_token_id=None,
                 collect_logits: bool = False, timeline: Optional[list] = None):
        self.scheduler, self.connector, self.runner = scheduler, connector, runner
        self.vocab_size = vocab_size
        self.async_scheduling = async_scheduling
        self.sample_fn: SampleFn = sample_fn or greedy
        self.eos_token_id = eos_token_id
        self.collect_logits = collect_logits
        self.timeline = timeline
        self.observer = None  # a graphgen.trace.StepObserver: scheduling spans (Engine.observe sets it)
        self._requests: dict[Any, Request] = {}
        self._inflight: Optional[tuple[ScheduledStep, Any, Job]] = None  # (step, save, forward job)
        self._forward: Optional[Stream] = None
        self._sched_no = 0  # ids of scheduled steps, in schedule order (the timeline's step_no)
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_hit_tokens": 0, "steps": 0}

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req_id: Any, prompt_ids: Sequence[int], params: Any = None, *,
                    max_tokens: Optional[int] = None) -> Request:
        """Queue a request. ``params`` (any object; e.g. the server's SamplingParams) may carry
        ``max_tokens`` (default 16), ``stop_token_ids`` and ``ignore_eos``; ``max_tokens=`` wins."""
        if req_id is not None and req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in use")
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("empty prompt")
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        budget = self.scheduler.max_num_batched_tokens
        if len(prompt) > budget:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_num_batched_tokens ({budget}); "
                             f"chunked prefill is not supported")
        n = max_tokens if max_tokens is not None else getattr(params, "max_tokens", 16)
        if not isinstance(n, int) or n < 1:
            raise ValueError("max_tokens must be an int >= 1")
        stops = set(getattr(params, "stop_token_ids", ()) or ())
        eos = self.eos_token_id  # an id or a collection of ids (Qwen3 ships two)
        if eos is not None and not getattr(params, "ignore_eos", False):
            stops.update((eos,) if isinstance(eos, int) else eos)
        r = Request(RequestResult(prompt=prompt), n, req_id=req_id, stop_token_ids=frozenset(stops), params=params)
        self.scheduler.add(r)
        if req_id is not None:
            self._requests[req_id] = r
        self._totals["prompt_tokens"] += len(prompt)
        return r

    def abort(self, req_id: Any) -> None:
        """Finish the request ("abort"); its blocks go back (those a step in flight writes once it
        lands, those with a save in flight once the commit lands). Unknown / finished ids: ignored."""
        r = self._requests.pop(req_id, None)
        if r is not None:
            self.scheduler.abort(r)

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work() or bool(self.scheduler.failed)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; one `RequestOutput` per request that got a token or finished in it."""
        out: list[RequestOutput] = []
        try:
            if not self.async_scheduling:
                step, sid = self._schedule()
                if step is not None:
                    self._land(step, *self._run(step, sid), out)
            else:
                if self._inflight is None:
                    step, sid = self._schedule()
                    if step is not None:
                        self._launch(step, sid)
                if self._inflight is not None:
                    nxt, nsid = self._schedule()  # while the step in flight runs on the forward thread
                    step, save, job = self._inflight
                    self._inflight = None
                    handles = self._wait(save, job)
                    self._land(step, save, handles, out)
                    if nxt is not None:
                        self._launch(nxt, nsid)
        except BaseException:
            self.abort_all()
            raise
        for r in self.scheduler.take_failed():
            self._requests.pop(r.req_id, None)
            out.append(RequestOutput(r.req_id, (), True, "error", r.result.hit_tokens, len(r.prompt),
                                     error=str(r.error)))
        return out

    def _schedule(self) -> Optional[ScheduledStep]:
        t, sid = time.perf_counter(), self._sched_no
        step = self.scheduler.schedule()
        if step is not None and not self.async_scheduling:
            step = self.scheduler.finalize(step)
        if step is not None:
            self._sched_no += 1
            self._span("schedule", sid, t)
        return step, sid

    def _execute(self, step: ScheduledStep, save, loads, sid: int):
        t = time.perf_counter()
        try:
            return self.runner.execute(step.variant, step.inputs, save.staging if save else None, loads)
        finally:
            self._span("forward", sid, t)

    def _run(self, step: ScheduledStep, sid: int):
        save = self._prepare_save(step)
        try:
            return save, self._execute(step, save, self._take_loads(step), sid)
        except BaseException:
            if save is not None:
                self.connector.cancel(save)
            raise

    def _take_loads(self, step: ScheduledStep) -> list:
        """The step's loaded history blocks, per layer (empty unless its variant loads)."""
        return self.connector.take_loads(step.inputs.load_block_ids.tolist())

    def _prepare_save(self, step: ScheduledStep):
        return self.connector.prepare_save(step.save_block_ids, step.save_keys) if step.saves else None

    def _launch(self, step: ScheduledStep, sid: int) -> None:
        step = self.scheduler.finalize(step)
        if step is None:
            return
        if self._forward is None:
            self._forward = Stream("forward")
        save = self._prepare_save(step)
        loads = self._take_loads(step)
        self._span("launch", sid, time.perf_counter())
        self._inflight = (step, save, self._forward.launch(self._execute, step, save, loads, sid))

    def _wait(self, save, job: Job):
        try:
            return job.result()
        except BaseException:
            if save is not None:
                self.connector.cancel(save)
            raise

    def _land(self, step: ScheduledStep, save, handles, out: list) -> None:
        if save is not None:
            self.connector.handoff(save, handles.save_job, handles.save_done)
        logits = handles.logits
        tokens = tuple(int(t) for t in self.sample_fn(logits, step.requests))
        self.scheduler.update(step, StepOutput(tokens, logits if self.collect_logits else None))
        self.connector.reap()
        self._totals["steps"] += 1
        for r, tok in zip(step.requests, tokens):
            if r.finish_reason == "abort":
                continue  # aborted while its step ran: the caller has already let it go
            if len(r.tokens) == 1 and step.phase == "prefill" and not r.result.preemptions:
                self._totals["prefix_hit_tokens"] += r.result.hit_tokens
            self._totals["generation_tokens"] += 1
            if r.finished:
                self._requests.pop(r.req_id, None)
            out.append(RequestOutput(r.req_id, (tok,), r.finished, r.finish_reason, r.result.hit_tokens,
                                     len(r.prompt)))

    def _span(self, what: str, sid: int, t0: float) -> None:
        if self.timeline is not None:  # list.append: safe from the forward thread too
            self.timeline.append((what, sid, t0, time.perf_counter()))
        if self.observer is not None:
            self.observer.step(what, sid, t0, time.perf_counter())

    def abort_all(self) -> None:
        """Wait for the forward in flight (its save is handed off), then drop every request and its
        blocks (after an error, or at shutdown). Nothing is reported for them."""
        if self._inflight is not None:
            step, save, job = self._inflight
            self._inflight = None
            if job.exception() is not None and save is not None:
                self.connector.cancel(save)
            elif save is not None:
                handles = job.result()
                self.connector.handoff(save, handles.save_job, handles.save_done)
        self.scheduler.abort_all()
        self._requests.clear()
        self.connector.reap()

    # ---- the rest ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Gauges (``running``, ``waiting``, ``saves_pending``, ``free_blocks``), totals since start
        (``prompt_tokens``, ``generation_tokens``, ``prefix_hit_tokens``, ``steps``,
        ``preemptions``) and the connector's counters (``puts``, ``put_failures``, ...)."""
        self.connector.reap()
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting) + len(s.prefill),
                "saves_pending": self.connector.pending, "free_blocks": s.alloc.num_free,
                **self._totals, "preemptions": s.num_preemptions, **self.connector.stats}

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Abort every request (the step in flight lands first), commit every pending save."""
        try:
            self.abort_all()
        finally:
            self.connector.drain(timeout)
            self.close()

    def close(self) -> None:
        if self._forward is not None:
            self._forward.close()
            self._forward = None
