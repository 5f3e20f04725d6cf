"""``LLMEngineAdapter``: the serving interface (`ServingEngine`) on the runtime's step API (`LLMEngine`).

The engine does the serving work — continuous batching (requests join and leave between steps,
prefills grouped by variant, decodes batched, the newest request preempted and recomputed when
blocks run out), async scheduling (step N+1 prepared while step N runs), token-level stops — and
this adapter only translates:

- sampling: each request carries its own `Sampler` (its seeded ``torch.Generator``) in the params
  handed to ``LLMEngine.add_request``; the engine's ``sample_fn`` reads it back from
  ``Request.params``. Greedy rows are one ``argmax`` over the batch — the engine's default, so a
  greedy request gets exactly ``Engine.generate``'s tokens. A sampled request without a seed gets
  one chosen here, so its sampler can be rebuilt identically elsewhere;
- several ranks (``tp``/``ep`` > 1): the engine is a `DistributedEngine` and ``engine.llm`` its
  `DistributedLLM`, which runs every call on every rank; the params are pickled to each rank and
  rebuild the request's sampler from its seed there, so every rank samples the same token. No
  trace spans or timings come back from the rank processes (only the adapter's ``step`` span);
- stats: ``LLMEngine.stats()`` -> `EngineStats` (the server's gauges and totals);
- timings and trace spans: a `StepObserver` attached to the engine (``Engine.observe``): the
  runner, the connector and the step engine report forward, save, commit and scheduling spans
  themselves; the adapter adds one ``step`` span per engine step on the scheduler track.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

from ..runtime.parallel.launcher import DistributedEngine
from ..runtime.engine.facade import Engine
from ..runtime.engine.sampling import Sampler, SamplingParams
from ..trace import NULL, TRACK_SCHEDULER, StepObserver, TraceRecorder
from .engine_api import EngineStats, RequestOutput

log = logging.getLogger("graphgen.serve")

# LLMEngine.stats() keys the server shows besides EngineStats' own fields
_EXTRA = ("hit_blocks", "loaded_blocks")


@dataclass(frozen=True)
class _Params:
    """What the engine reads (``max_tokens``, ``stop_token_ids``, ``ignore_eos``) and what ``sample_fn`` reads back
    (the request's own sampler)."""

    max_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    sampler: Sampler

    def __reduce__(self):
        # pickled to a rank process: the sampler is rebuilt from its params (their seed), not copied
        return _rebuild, (self.max_tokens, self.stop_token_ids, self.ignore_eos, self.sampler.params)


def _rebuild(max_tokens: int, stop_token_ids: tuple, ignore_eos: bool, params: SamplingParams) -> _Params:
    return _Params(max_tokens, stop_token_ids, ignore_eos, Sampler(params))


def max_model_len(engine: Engine) -> int:
    """Prompt + generated tokens one request may have: the device blocks, the model's positions, and
    the step token budget (no chunked prefill: a prompt must fit one step)."""
    spec = engine.spec
    return min(engine.alloc.num_blocks * engine.block_size,
               getattr(spec.dims, "max_position_embeddings", None) or 1 << 30,
               engine.scheduler.max_num_batched_tokens)


class LLMEngineAdapter:
    def __init__(self, engine: Engine, *, eos_token_id: Optional[int] = None, trace: TraceRecorder = NULL,
                 model_name: Optional[str] = None):
        self.engine = engine
        self.llm = engine.llm
        self.trace = trace
        self.model_name = model_name or engine.spec.name
        self.vocab_size = engine.spec.dims.vocab_size
        distributed = isinstance(engine, DistributedEngine)
        self.max_model_len = engine.on_ranks(max_model_len)[0] if distributed else max_model_len(engine)
        self.llm.eos_token_id = eos_token_id
        self.llm.sample_fn = self._sample
        self.observer = StepObserver(trace, keep_timings=True)
        if not distributed:  # the ranks' runners and connectors live in other processes
            engine.observe(self.observer)

    @staticmethod
    def _sample(logits, requests) -> list[int]:
        tokens = logits.argmax(-1).tolist()  # greedy rows: the engine's own argmax
        for i, r in enumerate(requests):
            p = r.params
            if p is not None and not p.sampler.params.greedy:
                tokens[i] = p.sampler(logits[i])
        return tokens

    # ---- the interface ------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        prompt = [int(t) for t in prompt_ids]
        if not params.greedy and params.seed is None:  # not reproducible for the client, as OpenAI's API
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds {self.max_model_len}")
        self.llm.add_request(req_id, prompt, _Params(params.max_tokens, tuple(params.stop_token_ids), params.ignore_eos,
                                                    Sampler(params)))

    def abort(self, req_id: str) -> None:
        self.llm.abort(req_id)

    def has_work(self) -> bool:
        return self.llm.has_work()

    def step(self) -> list[RequestOutput]:
        with self.trace.span(TRACK_SCHEDULER, "step"):
            outs = self.llm.step()
        return [RequestOutput(o.req_id, o.new_token_ids, o.finished, o.finish_reason, o.num_cached_tokens,
                              o.num_prompt_tokens, o.error) for o in outs]

    def stats(self) -> EngineStats:
        s = self.llm.stats()
        return EngineStats(running=s["running"], waiting=s["waiting"], saves_pending=s["saves_pending"],
                           free_blocks=s["free_blocks"], prefix_hit_tokens=s["prefix_hit_tokens"],
                           prompt_tokens=s["prompt_tokens"], generation_tokens=s["generation_tokens"],
                           puts=s["puts"], put_failures=s["put_failures"], save_failures=s["save_failures"],
                           pool_errors=s["pool_errors"], preemptions=s["preemptions"], steps=s["steps"],
                           extra={k: s[k] for k in _EXTRA if k in s})

    def take_timings(self) -> list[tuple[str, float]]:
        return self.observer.take_timings()

    def shutdown(self) -> None:
        try:
            self.llm.shutdown()  # the step in flight lands, every request is dropped, saves committed
        finally:
            self.engine.close()
