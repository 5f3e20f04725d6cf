"""``EngineAdapter``: the serving interface (`ServingEngine`) on the runtime's `EngineInterface` (what
`graphgen.runtime.open_engine` returns, for every target and layout) and its step API (``engine.core``).

The engine does the serving work — continuous batching (requests join and leave between steps,
prefills grouped by variant, decodes batched, the newest request preempted and recomputed when
blocks run out), async scheduling (step N+1 planned while step N runs), token-level stops,
sampling per request from its `SamplingParams` — and this adapter only translates:

- sampling: the one seed rule (`seeded`): copy j of a seeded request draws with ``seed + j``, a
  sampled request without a seed gets one chosen here, so every rank of a tensor-parallel engine
  (which samples with its own copy of the request's sampler) draws the same token; greedy requests
  are one ``argmax`` over the batch, exactly ``Engine.generate``'s tokens;
- P/D: ``kv_naming`` / ``kv_pool`` / ``saves_in_flight`` are the engine's own (``kv_naming()`` is None
  where the engine cannot hand blocks over: ranks on the host pool, DP groups);
- several ranks (``tp``/``ep``/``cp``/``dp`` > 1): ``engine.core`` runs every call on every rank (``dp``:
  a request on the rank `DPRouter` picks); the adapter does not ask which engine it holds. No trace
  spans or timings come back from the rank processes (their ``observe`` does nothing; only the
  adapter's ``step`` span);
- stats: ``engine.core.stats()`` -> `EngineStats` (the server's gauges and totals);
- timings and trace spans: a `StepObserver` attached to the engine (``observe``): the runner, the
  connector and the engine core report forward, save, commit and scheduling spans themselves; the
  adapter adds one ``step`` span per engine step on the scheduler track.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Iterable, Optional, Sequence

from ..runtime import CacheNaming, EngineInterface, RequestOutput, SamplingParams, speculative_refusal
from ..trace import NULL, TRACK_SCHEDULER, StepObserver, TraceRecorder
from .engine_api import EngineStats

log = logging.getLogger("graphgen.serve")

# EngineCore.stats() keys the server shows besides EngineStats' own fields
_EXTRA = ("hit_blocks", "loaded_blocks", "prefill_tokens")


def seeded(params: SamplingParams, copy: int = 0) -> SamplingParams:
    """The seed a request draws with: greedy needs none; copy ``j`` of a seeded request ``seed + j``
    (each copy its own draws, reproducibly); no seed: a random one (not reproducible for the
    client, as OpenAI's API, but the same on every rank)."""
    if params.greedy:
        return params
    if params.seed is None:
        return dataclasses.replace(params, seed=secrets.randbits(63))
    return dataclasses.replace(params, seed=(params.seed + copy) % (1 << 63)) if copy else params


class EngineAdapter:
    def __init__(self, engine: EngineInterface, *, eos_token_ids: Iterable[int] = (), trace: TraceRecorder = NULL,
                 model_name: Optional[str] = None):
        self.engine = engine
        self.core = engine.core
        self.trace = trace
        self.model_name = model_name or engine.spec.name
        self.vocab_size = engine.spec.dims.vocab_size
        self.max_model_len = engine.max_model_len
        # the LoRA adapters the engine loaded (name -> folder): /v1/models lists them, "model" picks one
        self.lora_paths = {n: a.path for n, a in getattr(engine.core, "adapters", {}).items()}
        self.core.eos_token_ids = tuple(eos_token_ids)
        self.observer = StepObserver(trace, keep_timings=True)
        engine.observe(self.observer)  # an engine of several ranks reports nothing (their parts are elsewhere)

    # ---- the interface ------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    fork_of: Optional[str] = None, copy: int = 0) -> None:
        prompt = [int(t) for t in prompt_ids]
        params = seeded(params, copy)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds {self.max_model_len}")
        self.core.add_request(req_id, prompt, params, fork_of=fork_of)

    def refusal(self, params: SamplingParams) -> Optional[tuple[str, str]]:
        """``(field, sentence)`` when this engine cannot run ``params`` (speculative decoding's
        limits, `speculative_refusal`), checked by the server before the request is queued."""
        return speculative_refusal(params) if self.engine.speculative else None

    def abort(self, req_id: str, forks: bool = True) -> None:
        self.core.abort(req_id, forks)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> list[RequestOutput]:
        with self.trace.span(TRACK_SCHEDULER, "step"):
            return self.core.step()

    def stats(self) -> EngineStats:
        s = self.core.stats()
        return EngineStats(running=s["running"], waiting=s["waiting"], saves_pending=s["saves_pending"],
                           free_blocks=s["free_blocks"], prefix_hit_tokens=s["prefix_hit_tokens"],
                           prompt_tokens=s["prompt_tokens"], generation_tokens=s["generation_tokens"],
                           puts=s["puts"], put_failures=s["put_failures"], save_failures=s["save_failures"],
                           pool_errors=s["pool_errors"], preemptions=s["preemptions"], steps=s["steps"],
                           mixed_steps=s["mixed_steps"], decode_rows_stalled=s["decode_rows_stalled"],
                           prefills=s["prefills"], forks=s["forks"], device_hit_blocks=s["device_hit_blocks"],
                           device_cached_blocks=s["device_cached_blocks"],
                           spec_decode_num_draft_tokens=s.get("spec_decode_num_draft_tokens", 0),
                           spec_decode_num_accepted_tokens=s.get("spec_decode_num_accepted_tokens", 0),
                           spec_decode_num_accepted_tokens_per_pos=tuple(
                               s.get("spec_decode_num_accepted_tokens_per_pos", ())),
                           extra={k: s[k] for k in _EXTRA if k in s})

    # ---- P/D (serve/pd.py): read-only, any thread ------------------------------------------------
    def kv_naming(self) -> Optional[CacheNaming]:
        return self.engine.kv_naming()

    def kv_pool(self):
        return self.engine.kv_pool()

    def saves_in_flight(self) -> int:
        return self.engine.saves_in_flight()

    def take_timings(self) -> list[tuple[str, float]]:
        return self.observer.take_timings()

    def shutdown(self) -> None:
        try:
            self.core.shutdown()  # the step in flight lands, every request is dropped, saves committed
        finally:
            self.engine.close()
