"""Structured output: a per-request grammar applied as a logits mask before sampling (llguidance).

A request's `SamplingParams.structured` is a `StructuredOutput`: a llguidance grammar (the JSON
text ``llguidance.LLMatcher.grammar_from_json_schema`` / ``grammar_from_lark`` give; the server
builds it from ``response_format`` or a forced tool call) and the folder of the Hugging Face
tokenizer its tokens are spelled in. Both are plain strings, so the params travel to every rank of
a tensor-parallel engine unchanged; each rank builds its own matcher from them and advances it with
the same sampled token (every rank samples the same gathered logits), so every rank's matcher is in
the same state at every step.

`guided_sample(logits, requests, sample)` is the engine's one call: for each row whose request has a
grammar it computes the allowed-token bitmask, sets every other logit to ``-inf`` (on a copy: the
raw logits stay for whoever keeps them), samples all rows with ``sample`` (greedy rows take the
argmax of the masked row, sampled rows draw from it), then advances each matcher with its token.
The matcher is made at the request's first sampled token and lives on the request. When the
grammar is complete only EOS is allowed. A matcher in error (it should not happen: every token is
drawn from the mask) stops masking that request alone; its error is logged, not raised.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

__all__ = ["StructuredOutput", "guided_sample", "tokenizer_for"]

log = logging.getLogger("graphgen.runtime.grammar")


@dataclass(frozen=True)
class StructuredOutput:
    grammar: str  # a llguidance grammar (JSON text)
    tokenizer_dir: str  # the Hugging Face tokenizer folder (the checkpoint's)

    def __post_init__(self):
        if not isinstance(self.grammar, str) or not self.grammar:
            raise ValueError("structured grammar must be a non-empty string")
        if not isinstance(self.tokenizer_dir, str) or not self.tokenizer_dir:
            raise ValueError("structured tokenizer_dir must be a folder path")


@functools.lru_cache(maxsize=8)
def tokenizer_for(tokenizer_dir: str, n_vocab: int):
    """The llguidance tokenizer of a Hugging Face tokenizer folder, for logits ``n_vocab`` wide
    (built once per folder and width: it indexes every token's bytes)."""
    import llguidance.hf
    from transformers import AutoTokenizer

    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), n_vocab=n_vocab)


class _Guide:
    def __init__(self, spec: StructuredOutput, n_vocab: int):
        import llguidance

        self.matcher = llguidance.LLMatcher(tokenizer_for(spec.tokenizer_dir, n_vocab), spec.grammar)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")
        self.n_vocab = n_vocab
        self.failed = False

    def mask(self, row: torch.Tensor) -> None:
        import llguidance.torch as lt

        bits = lt.allocate_token_bitmask(1, self.n_vocab)
        lt.fill_next_token_bitmask(self.matcher, bits, 0)
        lt.apply_token_bitmask_inplace(row, bits)

    def advance(self, token: int) -> None:
        if self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(int(token)) or self.matcher.is_error():
            self.failed = True
            log.warning("structured output: token %d refused by the grammar (%s); unmasked from here",
                        token, self.matcher.get_error())


def _guide(request, n_vocab: int) -> Optional[_Guide]:
    spec = getattr(request.sampling, "structured", None)
    if spec is None:
        return None
    g = getattr(request, "_guide", None)
    if g is None:
        try:  # the server validated the grammar; a failure here stays this request's (unmasked)
            g = _Guide(spec, n_vocab)
        except Exception as e:
            log.warning("structured output: no matcher for request %r: %s", request.req_id, e)
            g = _Guide.__new__(_Guide)
            g.failed = True
        request._guide = g
    return None if g.failed else g


def guided_sample(logits: torch.Tensor, requests: Sequence, sample: Callable) -> tuple[list[int], int]:
    """``sample(logits, samplers)`` over the rows of ``logits`` (one per request), each row with a
    grammar masked first and its matcher advanced with the token after. Returns ``sample``'s answer."""
    guides = [_guide(r, logits.shape[-1]) for r in requests]
    if any(g is not None for g in guides):
        logits = logits.clone()
        for i, g in enumerate(guides):
            if g is not None:
                try:
                    g.mask(logits[i])
                except Exception as e:  # this request's matcher alone: unmasked from here, logged
                    g.failed = True
                    guides[i] = None
                    log.warning("structured output: mask failed for request %r: %s", requests[i].req_id, e)
    tokens, fallbacks = sample(logits, [r.sampler for r in requests])
    for g, t in zip(guides, tokens):
        if g is not None:
            g.advance(t)
    return tokens, fallbacks
