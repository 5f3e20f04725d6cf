"""One request's state, what the caller gets back, and what one step is made of.

`Request` is the scheduler's record (queue position, block table, how far its KV is computed);
`RequestResult` is the caller's view (tokens, prefix-hit tokens, TTFT, finish reason).
`StepInputs` are the tensors a generated module reads; `ScheduledStep` is one step as scheduled,
`StepOutput` what came back from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["StepInputs", "RequestResult", "Request", "ScheduledStep", "StepOutput", "FINISH_REASONS"]

# "length": max tokens reached; "stop": a stop token (or EOS) was sampled (it is kept);
# "abort": the caller aborted it; "error": it cannot run (e.g. its KV alone exceeds the cache).
FINISH_REASONS = ("length", "stop", "abort", "error")


@dataclass
class StepInputs:
    """What the host fills before a graph runs (names match the IR's inputs)."""

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

    def to_json(self, with_logits: bool = False) -> dict:
        d = {"tokens": self.tokens, "hit_tokens": self.hit_tokens, "ttft_ms": round(self.ttft_ms, 3),
             "variant": self.variant}
        if with_logits:
            d["logits"] = [float(x) for x in self.step_logits[0].tolist()]
        return d


@dataclass(eq=False)  # identity: two requests with the same prompt are still two requests
class Request:
    """One request's scheduling state (its `RequestResult` is what the caller gets back).

    ``cached`` counts the positions whose KV is computed *or scheduled to be*: it advances when a
    step is scheduled, so a step can be prepared while the previous one still runs (``in_steps``
    counts the scheduled steps holding it whose tokens have not come back)."""

    result: RequestResult
    max_new_tokens: int
    req_id: Any = None
    stop_token_ids: frozenset = frozenset()  # sampling one finishes the request ("stop"), kept
    params: Any = None  # the caller's sampling parameters, opaque here (a sample_fn reads them)
    t0: float = field(default_factory=time.perf_counter)  # TTFT clock start
    table: list[int] = field(default_factory=list)  # device block ids, in position order
    cached: int = 0
    hit_blocks: int = 0  # leading blocks loaded from the pool in the current admission
    keys: Optional[list[str]] = None  # pool keys of the current prefill sequence's full blocks
    in_steps: int = 0
    error: Optional[BaseException] = None  # with finish_reason "error"

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
class ScheduledStep:
    """One step: the variant to run, its requests (row i of the logits is request i) and inputs.

    ``save_block_ids[j]`` is saved under ``save_keys[j]`` and belongs to request ``save_rows[j]``;
    ``saves`` says whether the variant has a save program at all (it may have one with zero
    blocks: a prompt shorter than a block). ``pending_rows``: decode rows whose input token was not
    sampled yet when the step was scheduled (`Scheduler.finalize` fills them in)."""

    variant: str
    phase: str  # "prefill" | "decode"
    requests: tuple[Request, ...]
    inputs: StepInputs
    saves: bool
    save_block_ids: tuple[int, ...] = ()
    save_keys: tuple[str, ...] = ()
    save_rows: tuple[int, ...] = ()
    pending_rows: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.inputs.input_ids.numel())


@dataclass(frozen=True)
class StepOutput:
    """What came out of a step, one entry per request: the sampled token, and its logits row when
    the caller collects them."""

    tokens: tuple[int, ...]
    logits: Optional[torch.Tensor] = None
