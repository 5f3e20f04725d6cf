"""Sampling one step: the rows' logits of a `StepOutput` become its tokens, each request with its own
`SamplingParams` (the engine samples; a runner that samples on its device fills the same fields).

Per row of the plan: a verify row (speculative decoding: a decode row with drafts) gets the tokens
its drafts earned (`MtpDrafter.verify`); every other row that samples gets one token from its last
logits position — after its logits processors (penalties, bias, masks: `logits.process_rows`),
under its grammar when it has one (`grammar.guided_sample`) — with its logprobs when asked; a
prefill row that returned every prompt position's logits gets its prompt logprobs. With
``collect_logits`` the sampled rows' logits are kept (what ``--logits`` and the tests compare).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch

from .grammar import guided_sample
from .logits import process_rows, prompt_logprobs, token_logprobs
from .request import StepPlan
from .sampling import sample_rows
from .step_output import StepOutput

__all__ = ["sample_step"]


def sample_step(plan: StepPlan, output: StepOutput, *, drafter: Any = None, collect_logits: bool = False) -> StepOutput:
    """``output`` with its token fields filled from its logits (see the module doc)."""
    rows, row_logits = plan.rows, output.logits
    tokens: list = [None] * len(rows)
    verify = [i for i, row in enumerate(rows) if row.samples and row.decode and row.num_tokens > 1]
    for i in verify:
        tokens[i] = drafter.verify(rows[i], row_logits[i])
    sampling = [i for i, row in enumerate(rows) if row.samples and i not in verify]
    lps: list = [None] * len(rows)
    last: Optional[torch.Tensor] = None
    fallbacks = 0
    if sampling:
        requests = [rows[i].request for i in sampling]
        last, fallbacks = process_rows(torch.stack([row_logits[i][-1] for i in sampling]), requests)
        # structured output (engine/grammar.py): grammar rows masked, then sampled, then advanced
        sampled, guided = guided_sample(last, requests, sample_rows)
        fallbacks += guided
        for i, tok in zip(sampling, sampled):
            tokens[i] = int(tok)
        for i, lp in zip(sampling, token_logprobs(last, sampled, [rows[i].sampling.logprobs for i in sampling])):
            lps[i] = lp
    kept: Optional[list] = None
    if collect_logits and (last is not None or verify):
        kept = [None] * len(rows)
        for j, i in enumerate(sampling):
            kept[i] = last[j] if last is not None else None  # (sampling is non-empty: last is set)
        for i in verify:
            kept[i] = row_logits[i]
    return replace(output, tokens=tuple(tokens), logprobs=tuple(lps), prompt_logprobs=_prompt_logprobs(plan, row_logits),
                   kept_logits=None if kept is None else tuple(kept), sampling_fallbacks=fallbacks)


def _prompt_logprobs(plan: StepPlan, row_logits) -> tuple:
    """Per row: the prompt logprobs of a prefill row that returned every prompt position's logits."""
    out: list = [None] * len(plan.rows)
    for i, row in enumerate(plan.rows):
        k = row.sampling.prompt_logprobs
        if k is not None and plan.phase == "prefill" and row.start == 0 and row.samples \
                and len(row.logits_positions) == row.num_tokens == len(row.request.prompt):
            out[i] = prompt_logprobs(row_logits[i], row.token_ids, k)
    return tuple(out)
