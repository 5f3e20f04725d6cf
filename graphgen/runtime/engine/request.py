"""One request's state, what the caller gets back, and what one step plans for each request.

`Request` is the scheduler's record (queue position, block table, how far its KV is computed,
its sampling state); `RequestResult` is the caller's view of a whole request (tokens, prefix-hit
tokens, TTFT, finish reason); `RequestOutput` is one request's news from one step (what a server
streams). `StepPlan` is one step as the scheduler decided it: per request, a `RowPlan` saying which
tokens it feeds, at which positions, in which blocks, which blocks it loads and saves and which
positions' logits come back, and which full blocks the runner saves from the cache after the step
(decode-time saves, write-backs). Each runner (CPU, rank, NPU) builds its own inputs from the plan.

What is a tensor here: the pool blocks a row loads (``RowPlan.loaded``, fetched at admission into
host staging), a draft run's ``StepPlan.prev_hidden``, a request's speculative state
(``Request.spec_hidden``, ``draft_probs``) and the logits a result keeps (``RequestResult.step_logits``,
``draft_logits``); the rest is plain data (ids, tokens, positions, block ids, keys).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from .sampling import Sampler, SamplingParams

__all__ = ["RequestResult", "RequestOutput", "Request", "RowPlan", "StepPlan", "FINISH_REASONS", "PENDING"]

# "length": max tokens reached; "stop": a stop token (or EOS) was sampled (it is kept);
# "abort": the caller aborted it; "error": it cannot run (e.g. its KV alone exceeds the cache).
FINISH_REASONS = ("length", "stop", "abort", "error")

# a decode row's input token that the step in flight has not sampled yet (`Scheduler.finalize` fills it)
PENDING = -1


@dataclass
class RequestResult:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    hit_tokens: int = 0  # prompt tokens whose KV came from the pool (first admission)
    ttft_ms: float = 0.0
    variant: str = ""  # the variant of its first prefill
    saved_blocks: int = 0  # blocks handed to the save (committed later, if the pool accepts them)
    step_logits: list = field(default_factory=list)  # per generated token, when collect_logits
    finish_reason: Optional[str] = None  # one of FINISH_REASONS once finished
    preemptions: int = 0  # times its blocks were taken back and its KV recomputed later
    # speculative decoding (spec_decode.py), vLLM's counters: drafts verified, drafts accepted,
    # accepted per draft position; with collect_logits each draft run's first-draft logits
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list = field(default_factory=list)
    draft_logits: list = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def to_json(self, with_logits: bool = False) -> dict:
        d = {"tokens": self.tokens, "hit_tokens": self.hit_tokens, "ttft_ms": round(self.ttft_ms, 3),
             "variant": self.variant, "finish_reason": self.finish_reason}
        if with_logits:
            d["logits"] = [float(x) for x in self.step_logits[0].tolist()]
        return d


@dataclass(frozen=True)
class RequestOutput:
    """One request's news from one step (the server streams these)."""

    req_id: Any
    new_token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: Optional[str] = None  # one of FINISH_REASONS when finished
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the pool (prefix hit)
    num_prompt_tokens: int = 0
    error: Optional[str] = None  # with finish_reason "error": why
    # per new token, when the params ask for logprobs: (token id, logprob, ((id, logprob), ...top-k))
    logprobs: Optional[tuple] = None
    # with the first token, when the params ask for prompt_logprobs: per prompt token, None for the
    # first, then (token id, logprob, top-k) as above
    prompt_logprobs: Optional[tuple] = None


@dataclass(eq=False)  # identity: two requests with the same prompt are still two requests
class Request:
    """One request's scheduling state (its `RequestResult` is what the caller gets back).

    ``cached`` counts the positions whose KV is computed *or scheduled to be*: it advances when a
    step is scheduled, so a step can be prepared while the previous one still runs (``in_steps``
    counts the scheduled steps holding it whose tokens have not come back). ``loaded`` holds the
    pool blocks fetched at admission (one staging block each, in table order) until the prefill
    that writes them into the cache is planned: the plan carries them from there."""

    result: RequestResult
    sampling: SamplingParams = field(default_factory=SamplingParams)
    req_id: Any = None
    stop_token_ids: frozenset = frozenset()  # sampling one finishes the request ("stop"), kept
    sampler: Optional[Sampler] = None  # the request's own generator (temperature > 0)
    t0: float = field(default_factory=time.perf_counter)  # TTFT clock start
    table: list[int] = field(default_factory=list)  # device block ids, in position order
    cached: int = 0
    hit_blocks: int = 0  # leading blocks loaded from the pool in the current admission
    loaded: list = field(default_factory=list)  # their load staging, until a plan takes them
    keys: Optional[list[str]] = None  # pool keys of the current prefill sequence's full blocks
    in_steps: int = 0
    error: Optional[BaseException] = None  # with finish_reason "error"
    # n / best_of (forks): a child names the request whose prompt KV it shares (``fork_parent``)
    # until it holds those blocks; the parent lists its children (``forks``: an abort of the parent
    # aborts them). ``shared_blocks``: leading prompt blocks this request shares from its parent
    # (one reference each, freed like its own), set when it is forked, 0 after a preemption.
    fork_parent: Optional["Request"] = None
    forks: list = field(default_factory=list)
    shared_blocks: int = 0
    # positions whose KV is in the cache for sure (their step landed, or found there); unlike
    # ``cached`` never ahead of the steps that write it: what a device prefix cache may keep
    computed: int = 0
    device_blocks: int = 0  # leading blocks shared from the device prefix cache in this admission
    # speculative decoding (spec_decode.py): the target's hidden states at positions
    # ``spec_p0 ..`` whose MTP KV is not final yet (the next draft run's input), the drafts the
    # next verify row carries, and (temperature > 0) their draft distributions ``[len(drafts), V]``
    spec_hidden: Optional[Any] = None
    spec_p0: int = 0
    drafts: tuple = ()
    draft_probs: Optional[Any] = None
    # finished on the token its prompt's step sampled, its blocks held (one ``in_steps``) for the draft run
    # that computes the prompt's MTP KV and saves its blocks (`Scheduler.hold_for_draft`): a P/D prefill
    # (max_tokens 1) hands exactly those blocks off
    save_hold: bool = False
    # the LoRA adapter it runs under (a graphgen.runtime.lora.Adapter; None: the base model)
    lora: Optional[Any] = None

    @property
    def lora_salt(self) -> str:
        """What salts its pool keys: its adapter's weight digest ("" : the base model)."""
        return self.lora.digest if self.lora is not None else ""

    def plan_decode(self) -> "RowPlan":
        """Its decode row for the next step: the token after its KV (``PENDING`` when the step in
        flight samples it: `Scheduler.finalize` fills it in) and its drafts, a logits position each
        (a verify row, speculative decoding). ``cached`` advances provisionally past them:
        `Scheduler.update` rolls it back to the accepted prefix."""
        p = self.cached
        ids = (self.seq[p] if p < len(self.seq) else PENDING, *self.drafts)
        self.drafts = ()  # verified by this row (the draft distributions stay for its rejection sampling)
        self.cached = p + len(ids)
        self.in_steps += 1
        return RowPlan(self, ids, p, tuple(self.table), logits_positions=tuple(range(len(ids))), decode=True)

    def take(self, tokens, logits, now: float) -> tuple[tuple[int, ...], Optional[str]]:
        """Append a step's ``tokens`` (one, or a verify row's emitted ones) up to the first that
        finishes the request; ``logits``: their rows ``[len(tokens), V]`` to keep, or None. Returns
        the tokens taken and the finish reason ("stop", "length") or None."""
        res, taken = self.result, []
        for j, tok in enumerate(int(t) for t in tokens):
            taken.append(tok)
            res.tokens.append(tok)
            if logits is not None:
                res.step_logits.append(logits[j].detach().float().clone())
            if len(res.tokens) == 1:
                res.ttft_ms = (now - self.t0) * 1e3
            reason = "stop" if tok in self.stop_token_ids else "length" if len(res.tokens) >= self.max_new_tokens \
                else None
            if reason is not None:
                return tuple(taken), reason
        return tuple(taken), None

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def prompt(self) -> list[int]:
        return self.result.prompt

    @property
    def tokens(self) -> list[int]:
        return self.result.tokens

    @property
    def seq(self) -> list[int]:
        """Prompt and generated tokens: what a (re)computed prefill covers."""
        return self.result.prompt + self.result.tokens

    @property
    def finished(self) -> bool:
        return self.result.finish_reason is not None

    @property
    def finish_reason(self) -> Optional[str]:
        return self.result.finish_reason


@dataclass(frozen=True)
class RowPlan:
    """What one request does in one step.

    It feeds ``token_ids`` at positions ``start .. start + len(token_ids)`` (any number: a whole
    prompt, a chunk of one, one decode token, several verify tokens) into the blocks of
    ``block_table``, attending to every position before ``start + len`` (``seq_len``). It writes
    ``load_block_ids`` (cache blocks of its history) from ``loaded`` (their pool blocks, fetched at
    admission) before its own KV, and its step saves ``save_block_ids`` under ``save_keys``. Logits
    come back for ``logits_positions`` (offsets into ``token_ids``); the row samples its next token
    from the last of them when ``samples``. A ``PENDING`` token id is filled by `Scheduler.finalize`.

    ``decode`` marks a decode row: it feeds the tokens after its request's computed KV (one token;
    speculative decoding's verify rows feed k+1, with a logits position each) and attends to all of
    it as history. In a mixed batch (see `StepPlan.mixed`) decode rows and prefill rows (a prompt
    or a chunk of one) share one forward of the history variant: both are rows with history, only
    their query lengths differ."""

    request: Request
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    load_block_ids: tuple[int, ...] = ()
    loaded: Sequence = ()  # per load block its staging: a kv_load.LoadedBlocks run (one staging for all)
    save_block_ids: tuple[int, ...] = ()
    save_keys: tuple[str, ...] = ()
    logits_positions: tuple[int, ...] = ()
    samples: bool = True
    decode: bool = False
    # decode-time saves (pool.save_decode; set by Scheduler.finalize): the full blocks this decode row
    # fills, saved from the cache once the step's forward is done (decode graphs have no save program)
    cache_save_block_ids: tuple[int, ...] = ()
    cache_save_keys: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def positions(self) -> range:
        return range(self.start, self.seq_len)

    @property
    def chunk(self) -> tuple[int, int]:
        """The prompt-or-sequence positions this row computes: ``[start, seq_len)``."""
        return self.start, self.seq_len

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def pending(self) -> bool:
        return PENDING in self.token_ids


@dataclass(frozen=True)
class StepPlan:
    """One step: the variant to run and its rows (row i's logits are the step's i-th group).

    ``saves`` says whether the variant has a save program at all (it may have one with zero
    blocks: a prompt shorter than a block). ``phase`` is the variant's: a mixed batch (decode rows
    and prefill rows together) runs the prefill-with-history variant, so its phase is "prefill".

    Saves from the cache (no save program: the runner packs the blocks from the cache after the
    forward, `cache_saves`): the rows' decode-time saves and ``write_back_ids`` under
    ``write_back_keys`` — dirty blocks that left the device since the last plan (``pool.policy:
    write_back``), held by the scheduler until this plan has landed. A plan with no rows
    (`no_forward`) runs no forward, only its write-backs (vLLM's ``no_forward``)."""

    variant: str
    phase: str  # "prefill" | "decode"
    rows: tuple[RowPlan, ...]
    saves: bool
    decode_rows_stalled: int = 0  # running requests that could decode but are not in this step
    write_back_ids: tuple[int, ...] = ()
    write_back_keys: tuple[str, ...] = ()
    # a draft run's input (speculative decoding): each row's previous hidden state, [tokens, H] (a tensor)
    prev_hidden: Any = None

    @classmethod
    def no_forward(cls) -> "StepPlan":
        """A step without a forward: it carries only the write-backs `Scheduler.finalize` adds."""
        return cls("", "", (), False)

    @property
    def requests(self) -> tuple[Request, ...]:
        return tuple(r.request for r in self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def decode_rows(self) -> int:
        return sum(1 for r in self.rows if r.decode)

    @property
    def prefill_tokens(self) -> int:
        """The tokens of its prefill rows (prompts and chunks): the step's share of prompt work."""
        return sum(r.num_tokens for r in self.rows if not r.decode)

    @property
    def mixed(self) -> bool:
        """Decode rows and prefill rows in one forward (a mixed batch)."""
        return 0 < self.decode_rows < len(self.rows)

    @property
    def save_block_ids(self) -> tuple[int, ...]:
        return tuple(b for r in self.rows for b in r.save_block_ids)

    @property
    def save_keys(self) -> tuple[str, ...]:
        return tuple(k for r in self.rows for k in r.save_keys)

    @property
    def load_block_ids(self) -> tuple[int, ...]:
        return tuple(b for r in self.rows for b in r.load_block_ids)

    def cache_saves(self) -> tuple[list[int], list[str]]:
        """(block ids, keys) the runner saves from the cache once the forward is done: the decode-time
        saves of rows whose request goes on (an aborted one's are dropped, as its blocks are), then
        the write-backs."""
        ids: list[int] = []
        keys: list[str] = []
        for row in self.rows:
            if row.cache_save_block_ids and not row.request.finished:
                ids += row.cache_save_block_ids
                keys += row.cache_save_keys
        return ids + list(self.write_back_ids), keys + list(self.write_back_keys)

    def keep(self, rows) -> "StepPlan":
        return replace(self, rows=tuple(rows))
