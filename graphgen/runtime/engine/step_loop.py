"""The step-level engine API: requests in, per-step token deltas out (what a server drives).

`LLMEngine` runs one step per ``step()`` call over two parts, the `Scheduler` and a model runner
(CPU, rank or NPU: each owns the worker side of the KV connector):

    plan = scheduler.schedule()  ->  runner.submit(plan) / runner.collect(...)  ->  sample  ->  scheduler.update

The step flows one way as data: the plan says, per request, what to compute, load and save; the
runner builds its own inputs from it, pins and commits the step's save, and returns each row's
logits; the engine samples each request with its own `SamplingParams`; the scheduler takes the
tokens back.

With ``async_scheduling`` the forward runs on a ``forward`` worker thread and, while step N runs,
the caller's thread plans step N+1 (admission and pool loads, block allocation). The only input
that depends on step N is the token each decode row feeds back: it is left ``PENDING`` and filled
in by ``Scheduler.finalize`` once step N's logits are sampled; rows of requests that finished at
step N are dropped there. Tokens are identical either way: the same steps run in the same order
on the same inputs; only *when* they are prepared changes.

With a ``drafter`` (speculative decoding, `spec_decode.MtpDrafter`) a verify row's K + 1 logits
become the tokens it emits (`MtpDrafter.verify`), and once a step has landed the MTP graph drafts
for every request that got a token (`MtpDrafter.after_step`, on the caller's thread, before the
next step is launched).

Threading: every method is called from one thread (the caller's); only the forward runs elsewhere.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Optional, Sequence

import torch

from .request import Request, RequestOutput, RequestResult, StepPlan
from .grammar import guided_sample
from .logits import process_rows, prompt_logprobs, token_logprobs
from .sampling import Sampler, SamplingParams, sample_rows
from .spec_decode import speculative_refusal

__all__ = ["LLMEngine"]


class LLMEngine:
    """``scheduler``, ``runner``: an `Engine`'s parts (``Engine.llm`` is one of these); ``connector``
    is kept for its counters (``stats``) and ``drain`` (the runner drives its worker side).

    ``eos_token_ids``: stop tokens of every request (the model's EOS), unless its params say
    ``ignore_eos``. ``timeline``: a list to append ``(what, step_no, t_start, t_end)`` spans to
    (``"schedule"`` on the caller's thread, ``"forward"`` where the forward runs; with async
    scheduling ``"launch"``, an instant: the step queued on the forward thread)."""

    def __init__(self, scheduler, connector, runner, *, vocab_size: int, async_scheduling: bool = False,
                 eos_token_ids: Iterable[int] = (), collect_logits: bool = False,
                 timeline: Optional[list] = None, drafter=None):
        self.scheduler, self.connector, self.runner = scheduler, connector, runner
        self.vocab_size = vocab_size
        self.async_scheduling = async_scheduling
        self.eos_token_ids = tuple(eos_token_ids)
        self.collect_logits = collect_logits
        self.timeline = timeline
        self.drafter = drafter  # spec_decode.MtpDrafter: every request decodes speculatively
        self.observer = None  # a graphgen.trace.StepObserver: scheduling spans (Engine.observe sets it)
        self._requests: dict[Any, Request] = {}
        self._inflight = None  # (future, step_no): the step on the forward thread
        self._sched_no = 0  # ids of scheduled steps, in schedule order (the timeline's step_no)
        self._forward_sid = 0
        self._forward_plan: Optional[StepPlan] = None  # the plan of the forward running now
        runner.on_forward = self._forward_span
        self._totals = {"prompt_tokens": 0, "generation_tokens": 0, "prefix_hit_tokens": 0, "steps": 0,
                        "sampling_fallbacks": 0, "mixed_steps": 0, "decode_rows_stalled": 0}

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req_id: Any, prompt_ids: Sequence[int], params: Optional[SamplingParams] = None, *,
                    max_tokens: Optional[int] = None, fork_of: Any = None) -> Request:
        """Queue a request with its `SamplingParams` (default: greedy, 16 tokens); ``max_tokens=`` wins
        over the params' own. Raises ``ValueError`` (naming the problem) for input it cannot run.

        ``fork_of``: the id of a request with the same prompt (``n`` / ``best_of``): this one shares
        its prompt's KV blocks instead of computing them again (one prefill; see the scheduler's
        Forks), samples with its own params (give each child its own seed), and is aborted with the
        parent (`abort`). A parent that is unknown or finished: it runs as an ordinary request."""
        if req_id is not None and req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in use")
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
                    self._forward_sid, self._forward_plan = sid, plan
                    fut = self.runner.submit(plan)
                    row_logits = self.runner.collect(fut)
                    self._forward_plan = None  # landed: a plan holds its loads (pool memory, lent)
                    self._land(plan, row_logits, out, fut.hidden_rows)
            else:
                if self._inflight is None:
                    plan, sid = self._schedule()
                    if plan is not None:
                        self._launch(plan, sid)
                if self._inflight is not None:
                    nxt, nsid = self._schedule()  # while the step in flight runs on the forward thread
                    fut, _ = self._inflight
                    self._inflight = None
                    row_logits = self.runner.collect(fut)
                    self._forward_plan = None  # landed: a plan holds its loads (pool memory, lent)
                    self._land(fut.plan, row_logits, out, fut.hidden_rows)
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
        if plan is not None:
            self._sched_no += 1
            self._span("schedule", sid, t)
        return plan, sid

    def _launch(self, plan: StepPlan, sid: int) -> None:
        plan = self.scheduler.finalize(plan)
        if plan is None:
            return
        self._forward_sid, self._forward_plan = sid, plan
        fut = self.runner.submit(plan, background=True)
        self._span("launch", sid, time.perf_counter())
        self._inflight = (fut, sid)

    def _land(self, plan: StepPlan, row_logits: list, out: list, hidden_rows: Optional[list] = None) -> None:
        tokens: list = [None] * len(plan.rows)
        # verify rows (a decode row with drafts): the drafter turns their logits into tokens
        verify = [i for i, row in enumerate(plan.rows) if row.samples and row.decode and row.num_tokens > 1]
        for i in verify:
            tokens[i] = self.drafter.verify(plan.rows[i], row_logits[i])
        sampling = [i for i, row in enumerate(plan.rows) if row.samples and i not in verify]
        last = torch.stack([row_logits[i][-1] for i in sampling]) if sampling else None
        lps: list = [None] * len(plan.rows)
        if last is not None:
            last = self._process(last, [plan.rows[i].request for i in sampling])
            # structured output (engine/grammar.py): grammar rows masked, then sampled, then advanced
            sampled, fallbacks = guided_sample(last, [plan.rows[i].request for i in sampling], sample_rows)
            self._totals["sampling_fallbacks"] += fallbacks
            for i, tok in zip(sampling, sampled):
                tokens[i] = int(tok)
            for i, lp in zip(sampling, token_logprobs(last, sampled, [plan.rows[i].sampling.logprobs
                                                                     for i in sampling])):
                lps[i] = lp
        plps = self._prompt_logprobs(plan, row_logits)
        kept = None
        if self.collect_logits and (last is not None or verify):
            kept = [None] * len(plan.rows)
            for j, i in enumerate(sampling):
                kept[i] = last[j]
            for i in verify:
                kept[i] = row_logits[i]
        # decode-time saves (pool.save_decode): pinned before update can free a finished request's blocks
        self.connector.save_filled(*self.scheduler.blocks.decode_saves(plan))
        self.scheduler.update(plan, tokens, kept)  # a verify row's entry becomes the tokens taken
        if self.drafter is not None:
            self.drafter.after_step(plan, tokens, hidden_rows, self.collect_logits)
        self.connector.reap()
        self._totals["steps"] += 1
        self._totals["mixed_steps"] += plan.mixed
        self._totals["decode_rows_stalled"] += plan.decode_rows_stalled
        for j, (row, tok) in enumerate(zip(plan.rows, tokens)):
            r = row.request
            if tok is None or r.finish_reason == "abort":
                continue  # a row without a token, or aborted while its step ran (the caller let it go)
            new = tok if isinstance(tok, tuple) else (tok,)
            if len(r.tokens) == 1 and plan.phase == "prefill" and not r.result.preemptions:
                self._totals["prefix_hit_tokens"] += r.result.hit_tokens
            self._totals["generation_tokens"] += len(new)
            if r.finished:
                self._requests.pop(r.req_id, None)
            out.append(RequestOutput(r.req_id, new, r.finished, r.finish_reason, r.result.hit_tokens,
                                     len(r.prompt), logprobs=None if lps[j] is None else (lps[j],),
                                     prompt_logprobs=plps[j] if len(r.tokens) == 1 else None))

    def _process(self, last: torch.Tensor, requests: list) -> torch.Tensor:
        """Each request's logits processors (penalties, bias, masks) on its sampled-position row."""
        last, fallbacks = process_rows(last, requests)
        self._totals["sampling_fallbacks"] += fallbacks
        return last

    @staticmethod
    def _prompt_logprobs(plan: StepPlan, row_logits: list) -> list:
        """Per row: the prompt logprobs of a prefill row that returned every prompt position's logits."""
        out: list = [None] * len(plan.rows)
        for i, row in enumerate(plan.rows):
            k = row.sampling.prompt_logprobs
            if k is not None and plan.phase == "prefill" and row.start == 0 and row.samples \
                    and len(row.logits_positions) == row.num_tokens == len(row.request.prompt):
                out[i] = prompt_logprobs(row_logits[i], row.token_ids, k)
        return out

    def _forward_span(self, t0: float, t1: float) -> None:
        # called where the forward runs (the forward thread with async scheduling): list.append is safe
        if self.timeline is not None:
            self.timeline.append(("forward", self._forward_sid, t0, t1))
        if self.observer is not None:
            self.observer.step("forward", self._forward_sid, t0, t1)
            if self._forward_plan is not None:
                self.observer.step_rows(self._forward_plan, self._forward_sid, t0, t1)

    def _span(self, what: str, sid: int, t0: float) -> None:
        if self.timeline is not None:
            self.timeline.append((what, sid, t0, time.perf_counter()))
        if self.observer is not None:
            self.observer.step(what, sid, t0, time.perf_counter())

    def abort_all(self) -> None:
        """Wait for the forward in flight (its save is handed off, or cancelled if it failed), then
        drop every request and its blocks (after an error, or at shutdown). Nothing is reported."""
        if self._inflight is not None:
            fut, _ = self._inflight
            self._inflight = None
            self.runner.settle(fut)
        self.scheduler.abort_all()
        self._requests.clear()
        self.connector.reap()

    # ---- the rest ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Gauges (``running``, ``waiting``, ``saves_pending``, ``free_blocks``), totals since start
        (``prompt_tokens``, ``generation_tokens``, ``prefix_hit_tokens``, ``steps``, ``mixed_steps``:
        steps with decode and prefill rows, ``decode_rows_stalled``: per step, the running requests
        that could decode but were not in it, summed; ``preemptions``, ``sampling_fallbacks``; the
        scheduler's ``prefills`` — prompt prefills begun —, ``forks`` — children sharing a parent's
        prompt blocks —, ``prefill_tokens`` and ``device_hit_blocks`` — blocks shared from the device
        prefix cache, apart from the pool's ``hit_blocks``; the gauge ``device_cached_blocks``)
        and the connector's counters (``puts``, ...); with speculative decoding vLLM's
        ``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens`` and
        ``spec_decode_num_accepted_tokens_per_pos`` (a list, per draft position)."""
        self.connector.reap()
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting) + len(s.prefill) + len(s.held),
                "saves_pending": self.connector.pending, "free_blocks": s.alloc.num_free,
                "device_cached_blocks": len(s.device_cache) if s.device_cache is not None else 0,
                **self._totals, "preemptions": s.num_preemptions, **s.counts, **self.connector.stats,
                **(self.drafter.stats() if self.drafter is not None else {})}

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Abort every request (the step in flight lands first), commit every pending save."""
        try:
            self.abort_all()
        finally:
            self.connector.drain(timeout)
            self.close()

    def close(self) -> None:
        self.runner.close()
