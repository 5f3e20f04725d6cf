"""How much of a prompt one step computes (chunked prefill) and which of its logits come back.

The scheduler's prompt-cutting rules, apart from its queues and blocks (docs/runtime.md,
"Mixed batches"): a prompt longer than what is left of the step's budget, or than
``long_prefill_token_threshold``, runs in chunks; a prompt-logprobs request is never cut.
"""

from __future__ import annotations

from .request import Request

__all__ = ["wants_prompt_logits", "prefill_logits_positions", "chunk_tokens"]


def wants_prompt_logits(r: Request) -> bool:
    """A request asking for prompt logprobs whose first token is not sampled yet."""
    return r.sampling.prompt_logprobs is not None and not r.result.tokens


def prefill_logits_positions(r: Request, start: int, end: int) -> tuple[int, ...]:
    """Its last position's logits; every position's for a prompt-logprobs request's first prefill
    (such a request is never chunked: its prompt is one row)."""
    if start == 0 and wants_prompt_logits(r):
        return tuple(range(end))
    return (end - start - 1,)


def chunk_tokens(r: Request, budget_left: int, first: bool, *, chunked: bool, threshold: int) -> int:
    """How many of ``r``'s remaining prompt tokens this step computes (0: none, the step is full).
    Chunked: at most what is left of the budget and, for a prompt longer than ``threshold`` (0:
    off), at most that; whole otherwise (the first request of a step always goes: an oversized
    prompt is one oversized step)."""
    n = len(r.seq) - r.cached
    if not chunked or wants_prompt_logits(r):  # prompt logprobs: one row for the prompt
        return n if first or n <= budget_left else 0
    limit = budget_left
    if threshold and len(r.seq) > threshold:
        limit = min(limit, threshold)
    return max(0, min(n, limit))
