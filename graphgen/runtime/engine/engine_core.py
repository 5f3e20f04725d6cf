"""`EngineCore`: the step loop — requests in, per-step token deltas out (what a server drives).

The name is vLLM's (``vllm/v1/engine/core.py``): the inner loop over a scheduler and a model
runner. `graphgen.runtime.engine.engine.Engine` is the outer object a caller holds (``generate``,
``drain``, ``close``); it reaches this loop as ``Engine.core``. One step:

    plan = scheduler.schedule()  ->  output = runner.collect(runner.submit(plan))
         ->  sample_step(plan, output)  ->  scheduler.update(plan, output)  ->  RequestOutputs

The step flows one way as data. The plan says, per request, what to compute, load and save, and
which blocks the runner saves from the cache after the forward (decode-time saves, write-backs).
The runner (CPU, rank or NPU) alone drives the KV connector's worker side: it builds its inputs,
pins and commits every save of the plan, and returns one `StepOutput` (each row's logits, hidden
rows, the saves it pinned and the commits that landed, its spans). Sampling fills the output's
tokens, each request with its own `SamplingParams` (`sample_step`); the scheduler takes the
output back. This loop holds no connector.

With ``async_scheduling`` the forward runs on a ``forward`` worker thread and, while step N runs,
the caller's thread plans step N+1 (admission and pool loads, block allocation). The only input
that depends on step N is the token each decode row feeds back: it is left ``PENDING`` and filled
in by ``Scheduler.finalize`` once step N's logits are sampled; rows of requests that finished at
step N are dropped there. Tokens are identical either way: the same steps run in the same order
on the same inputs; only *when* they are prepared changes.

With a ``drafter`` (speculative decoding, `spec_decode.MtpDrafter`) a verify row's K + 1 logits
become the tokens it emits (`MtpDrafter.verify`, in sampling), and once a step has landed the MTP
graph drafts for every request that got a token (`MtpDrafter.after_step`: draft plans submitted
through the runner, on the caller's thread, before the next step is launched).

Threading: every method is called from one thread (the caller's); only the forward runs elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterable, Optional, Sequence

from .request import Request, RequestOutput, RequestResult, StepPlan
from .sample_step import sample_step
from .sampling import Sampler, SamplingParams
from .spec_decode import speculative_refusal
from .step_output import StepOutput

__all__ = ["EngineCore"]

log = logging.getLogger("graphgen.engine")


class EngineCore:
    """``scheduler``, ``runner``: an `Engine`'s parts (``Engine.core`` is one of these).

    ``eos_token_ids``: stop tokens of every request (the model's EOS), unless its params say
    ``ignore_eos``. ``timeline``: a list to append ``(what, step_no, t_start, t_end)`` spans to
    (``"schedule"`` on the caller's thread, ``"forward"`` as the runner timed it; with async
    scheduling ``"launch"``, an instant: the step queued on the forward thread)."""

    def __init__(self, scheduler, runner, *, vocab_size: int, async_scheduling: bool = False,
                 eos_token_ids: Iterable[int] = (), collect_logits: bool = False,
                 timeline: Optional[list] = None, drafter=None):
        self.scheduler, self.runner = scheduler, runner
        self.vocab_size = vocab_size
        self.adapters: dict = {}  # LoRA adapters by the name requests use (graphgen.runtime.lora; assembly loads them)
        self.async_scheduling = async_scheduling
        self.eos_token_ids = tuple(eos_token_ids)
        self.collect_logits = collect_logits
        self.timeline = timeline
        self.drafter = drafter  # spec_decode.MtpDrafter: every request decodes speculatively
        self.observer = None  # a graphgen.trace.StepObserver: scheduling spans (Engine.observe sets it)
        self._requests: dict[Any, Request] = {}
        self._inflight: Optional[tuple[Any, int]] = None  # (future, step_no): the step on the forward thread
        self._sched_no = 0  # ids of scheduled steps, in schedule order (the timeline's step_no)
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_hit_tokens": 0, "steps": 0,
                        "sampling_fallbacks": 0, "mixed_steps": 0, "decode_rows_stalled": 0}

    # ---- requests ---------------------------------------------------------------------------
    def resolve_lora(self, lora: Any) -> Any:
        """The adapter a request names (``lora``: None for the base model, a loaded `Adapter`, or the name of
        one in ``self.adapters``); ValueError in one sentence for a name that is not loaded."""
        if lora is None:
            return None
        if self.scheduler.spec.lora is None:
            raise ValueError(f"spec {self.scheduler.spec.name} has no lora: section: it serves no adapter")
        if isinstance(lora, str):
            if lora not in self.adapters:
                raise ValueError(f"no LoRA adapter named {lora!r} is loaded (loaded: {', '.join(self.adapters) or 'none'})")
            return self.adapters[lora]
        return lora

    def add_request(self, req_id: Any, prompt_ids: Sequence[int], params: Optional[SamplingParams] = None, *,
                    max_tokens: Optional[int] = None, fork_of: Any = None, lora: Any = None) -> Request:
        """Queue a request with its `SamplingParams` (default: greedy, 16 tokens); ``max_tokens=`` wins
        over the params' own. Raises ``ValueError`` (naming the problem) for input it cannot run.

        ``fork_of``: the id of a request with the same prompt (``n`` / ``best_of``): this one shares
        its prompt's KV blocks instead of computing them again (one prefill; see the scheduler's
        Forks), samples with its own params (give each child its own seed), and is aborted with the
        parent (`abort`). A parent that is unknown or finished: it runs as an ordinary request."""
        if req_id is not None and req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in use")
        adapter = self.resolve_lora(lora if lora is not None else (params.lora if params is not None else None))
        parent = self._requests.get(fork_of) if fork_of is not None else None
        if parent is not None and list(prompt_ids) != parent.prompt:
            raise ValueError(f"a fork of request {fork_of!r} must have its prompt")
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if max_tokens is not None:
            params = dataclasses.replace(params, max_tokens=max_tokens)  # validated again there
        if self.drafter is not None and (why := speculative_refusal(params)) is not None:
            raise ValueError(why[1])
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("empty prompt")
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be ints in [0, {self.vocab_size})")
        ids = [t for t, _ in params.logit_bias] + [t for w in params.bad_words for t in w] \
            + list(params.allowed_token_ids or ())
        if any(t >= self.vocab_size for t in ids):
            raise ValueError(f"logit_bias / bad_words / allowed_token_ids ids must be in [0, {self.vocab_size})")
        # a prompt over max_num_batched_tokens runs in chunks (chunked prefill), or, with chunking
        # off, as one oversized step: the step budget is no limit on a prompt's length
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.eos_token_ids)
        r = Request(RequestResult(prompt=prompt), params, req_id=req_id, stop_token_ids=frozenset(stops),
                    sampler=None if params.greedy else Sampler(params))
        r.lora = adapter
        if parent is not None and parent.lora is not adapter:
            parent = None  # another adapter computes another prompt KV: nothing to share
        if self.drafter is not None:
            r.result.accepted_per_pos = [0] * self.drafter.k
        self.scheduler.add(r, fork_of=parent)
        if parent is not None:
            parent.forks.append(r)
        if req_id is not None:
            self._requests[req_id] = r
        self._totals["prompt_tokens"] += len(prompt)
        return r

    def abort(self, req_id: Any, forks: bool = True) -> None:
        """Finish the request ("abort"); its blocks go back (those a step in flight writes once it
        lands, those with a save in flight once the commit lands). With ``forks`` its forked
        children are aborted too (without: they go on; a server cutting one choice at a stop
        string). Unknown / finished ids: ignored."""
        r = self._requests.pop(req_id, None)
        if r is None:
            return
        if forks:
            for c in r.forks:
                if not c.finished:
                    self._requests.pop(c.req_id, None)
                    self.scheduler.abort(c)
        self.scheduler.abort(r)

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work() or bool(self.scheduler.failed)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; one `RequestOutput` per request that got a token or finished in it."""
        out: list[RequestOutput] = []
        try:
            if not self.async_scheduling:
                plan, sid = self._schedule()
                if plan is not None:
                    plan = self.scheduler.finalize(plan)
                if plan is not None:
                    out += self._land(plan, sid, self.runner.collect(self.runner.submit(plan)))
            else:
                if self._inflight is None:
                    plan, sid = self._schedule()
                    if plan is not None:
                        self._launch(plan, sid)
                if self._inflight is not None:
                    nxt, nsid = self._schedule()  # while the step in flight runs on the forward thread
                    fut, sid = self._inflight
                    self._inflight = None
                    out += self._land(fut.plan, sid, self.runner.collect(fut))
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

    def _schedule(self) -> tuple[Optional[StepPlan], int]:
        t, sid = time.perf_counter(), self._sched_no
        plan = self.scheduler.schedule()
        if plan is not None and plan.rows:  # a step with no forward (write-backs only) has no spans
            self._sched_no += 1
            self._span("schedule", sid, t)
        return plan, sid

    def _launch(self, plan: StepPlan, sid: int) -> None:
        plan = self.scheduler.finalize(plan)
        if plan is None:
            return
        fut = self.runner.submit(plan, background=True)
        if plan.rows:
            self._span("launch", sid, time.perf_counter())
        self._inflight = (fut, sid)

    def _land(self, plan: StepPlan, sid: int, output: StepOutput) -> list[RequestOutput]:
        """The step's output back: sampled (unless the runner sampled), taken by the scheduler, the
        drafts made; one `RequestOutput` per row that got a token."""
        for what, t0, t1 in output.spans:
            self._span(what, sid, t0, t1)
            if self.observer is not None:
                self.observer.step_rows(plan, sid, t0, t1)
        if plan.rows and output.tokens is None:
            output = sample_step(plan, output, drafter=self.drafter, collect_logits=self.collect_logits)
        taken = self.scheduler.update(plan, output)
        if not plan.rows:
            return []
        if self.drafter is not None:
            self.drafter.after_step(plan, taken, output.hidden, self.collect_logits)
        self._totals["steps"] += 1
        self._totals["mixed_steps"] += plan.mixed
        self._totals["decode_rows_stalled"] += plan.decode_rows_stalled
        self._totals["sampling_fallbacks"] += output.sampling_fallbacks
        return self._outputs(plan, taken, output)

    def _outputs(self, plan: StepPlan, taken: list, output: StepOutput) -> list[RequestOutput]:
        out = []
        for j, (row, tok) in enumerate(zip(plan.rows, taken)):
            r = row.request
            if tok is None or r.finish_reason == "abort":
                continue  # a row without a token, or aborted while its step ran (the caller let it go)
            new = tok if isinstance(tok, tuple) else (tok,)
            if len(r.tokens) == 1 and plan.phase == "prefill" and not r.result.preemptions:
                self._totals["prefix_hit_tokens"] += r.result.hit_tokens
            self._totals["generation_tokens"] += len(new)
            if r.finished:
                self._requests.pop(r.req_id, None)
            lp = output.logprobs[j] if output.logprobs else None
            out.append(RequestOutput(r.req_id, new, r.finished, r.finish_reason, r.result.hit_tokens,
                                     len(r.prompt), logprobs=None if lp is None else (lp,),
                                     prompt_logprobs=output.prompt_logprobs[j] if len(r.tokens) == 1
                                     and output.prompt_logprobs else None))
        return out

    def _span(self, what: str, sid: int, t0: float, t1: Optional[float] = None) -> None:
        t1 = time.perf_counter() if t1 is None else t1
        if self.timeline is not None:
            self.timeline.append((what, sid, t0, t1))
        if self.observer is not None:
            self.observer.step(what, sid, t0, t1)

    def abort_all(self) -> None:
        """Wait for the forward in flight (its save is handed off, or cancelled if it failed), then
        drop every request and its blocks (after an error, or at shutdown); the write-backs this
        leaves (dirty blocks let go) run as a step with no forward. Nothing is reported."""
        if self._inflight is not None:
            fut, _ = self._inflight
            self._inflight = None
            self.runner.settle(fut)
        self.scheduler.abort_all()
        self._requests.clear()
        plan = self.scheduler.finalize(StepPlan.no_forward())  # None: nothing to write back
        if plan is not None:
            try:
                self.scheduler.update(plan, self.runner.collect(self.runner.submit(plan)))
            except Exception as e:  # a save that did not land only costs a later recompute
                log.warning("write-backs at abort failed; their blocks are not saved: %s", e)
                self.scheduler.blocks.drop_write_backs(pending=True)

    # ---- the rest ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Gauges (``running``, ``waiting``, ``saves_pending``, ``free_blocks``), totals since start
        (``prompt_tokens``, ``generation_tokens``, ``prefix_hit_tokens``, ``steps``, ``mixed_steps``:
        steps with decode and prefill rows, ``decode_rows_stalled``: per step, the running requests
        that could decode but were not in it, summed; ``preemptions``, ``sampling_fallbacks``; the
        scheduler's ``prefills`` — prompt prefills begun —, ``forks`` — children sharing a parent's
        prompt blocks —, ``prefill_tokens`` and ``device_hit_blocks`` — blocks shared from the device
        prefix cache, apart from the pool's ``hit_blocks``; the gauge ``device_cached_blocks``)
        and the connector's counters through the runner (``puts``, ...); with speculative decoding
        vLLM's ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
        ``spec_decode_num_accepted_tokens_per_pos`` (a list, per draft position)."""
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting) + len(s.prefill) + len(s.held),
                "free_blocks": s.alloc.num_free,
                "device_cached_blocks": len(s.device_cache) if s.device_cache is not None else 0,
                **self._totals, "preemptions": s.num_preemptions, **s.counts, **self.runner.save_stats(),
                **(self.drafter.stats() if self.drafter is not None else {})}

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Abort every request (the step in flight lands first), commit every pending save."""
        try:
            self.abort_all()
        finally:
            self.runner.drain_saves(timeout)
            self.close()

    def close(self) -> None:
        self.runner.close()
