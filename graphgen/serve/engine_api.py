"""The one interface between the HTTP server and an engine: requests in, per-step token deltas out.

The server never touches engine internals; it talks to a :class:`ServingEngine`, which
`graphgen.serve.adapter.EngineAdapter` implements on the runtime's declared `EngineInterface` (no
engine class is ever tested for, no part reached past it):

- ``add_request(req_id, prompt_ids, params, fork_of=None, copy=0)`` — queue a request (prompt
  already validated: ids in ``[0, vocab_size)``, ``len(prompt) + params.max_tokens <=
  max_model_len``). ``copy`` is the request's place among the ``n`` / ``best_of`` copies of one
  prompt: the engine's one seed rule (a seeded request's copy j draws with ``seed + j``, an unseeded
  sampled one gets a seed of its own) lives behind this call.
- ``abort(req_id)`` — drop it (waiting or running); its blocks are freed (blocks with a save in
  flight return to the free list once their commit lands). Unknown / finished ids are ignored.
- ``step()`` — run one engine step; returns one :class:`RequestOutput` per request that produced
  a token or finished during the step.
- ``has_work()`` — anything waiting or running.
- ``stats()`` — an :class:`EngineStats` snapshot (gauges and monotonically increasing totals).
- ``take_timings()`` — samples measured since the last call, ``(name, value)`` (seconds; counts for
  ``prefill_tokens`` and ``decode_rows_stalled``) with ``name`` in ``TIMING_NAMES``, for the histograms of ``/metrics``.
- ``shutdown()`` — abort what is left, commit every pending save, release the engine.
- P/D (serve/pd.py): ``kv_naming()`` — how the engine names a prompt's blocks in its pool (a
  `CacheNaming`), or None when it cannot hand blocks over (ranks on the host pool, DP groups); ``kv_pool()`` — that
  pool; ``saves_in_flight()`` — host commits not landed yet.

Threading: every method is called from ONE thread, the server's engine-loop thread, except the
three P/D reads (``kv_naming``, ``kv_pool``, ``saves_in_flight``), which only read and may be
called from any thread. Token-level
stops (stop token ids, EOS, ``max_tokens``) are the engine's; stop *strings* are the server's (it
has the text) — it aborts the request when one appears.

The runtime's step API (``EngineInterface.core``: `graphgen.runtime.EngineCore`, continuous batching,
async scheduling; over ranks `DistributedCore` / `DataParallelCore`) is what the adapter drives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from ..runtime import FINISH_REASONS, CacheNaming, RequestOutput, SamplingParams

__all__ = ["RequestOutput", "EngineStats", "ServingEngine", "SamplingParams", "TIMING_NAMES", "FINISH_REASONS",
           "CacheNaming"]
# forward: one step's generated graph (any phase); save: forward start -> the step's saved KV is in
# staging (the host event);
# commit: host event -> every block of the step put into the pool.
TIMING_NAMES = ("forward", "save", "commit", "prefill_tokens", "decode_rows_stalled")


@dataclass(frozen=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    saves_pending: int = 0  # host commits in flight
    free_blocks: int = 0  # device KV blocks free for new requests (pinned ones are not)
    prefix_hit_tokens: int = 0  # totals from here on
    prompt_tokens: int = 0
    generation_tokens: int = 0
    puts: int = 0
    put_failures: int = 0
    save_failures: int = 0
    pool_errors: int = 0
    preemptions: int = 0  # requests whose blocks were taken back (recomputed later)
    steps: int = 0  # engine steps run (fewer than tokens generated when requests are batched)
    mixed_steps: int = 0  # steps with decode rows and prefill rows in one forward (mixed batches)
    decode_rows_stalled: int = 0  # per step, running requests that could decode but were not in it, summed
    prefills: int = 0  # prompt prefills begun (n / best_of copies forked from one are not)
    forks: int = 0  # requests that shared another's prompt KV blocks (n / best_of copies)
    device_hit_blocks: int = 0  # prompt blocks shared from the device prefix cache (not the pool)
    device_cached_blocks: int = 0  # gauge: blocks the device prefix cache holds
    # speculative decoding (--speculative mtp; vLLM's counters): drafts verified, drafts accepted,
    # accepted per draft position (empty: the engine does not decode speculatively)
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple = ()
    extra: dict = field(default_factory=dict)


class ServingEngine(Protocol):
    model_name: str
    vocab_size: int
    max_model_len: int  # prompt + generated tokens, at most

    # fork_of: the id of an earlier request with the same prompt whose prompt KV this one shares
    # (n / best_of: one prefill); aborting that parent with forks=True aborts its children too
    def add_request(self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                    fork_of: Optional[str] = None, copy: int = 0) -> None: ...

    def abort(self, req_id: str, forks: bool = True) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_work(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def take_timings(self) -> list[tuple[str, float]]: ...

    def shutdown(self) -> None: ...

    def kv_naming(self) -> Optional[CacheNaming]: ...

    def kv_pool(self) -> Any: ...

    def saves_in_flight(self) -> int: ...
