"""Structured output: a per-request grammar applied as a logits mask before sampling (llguidance).

A request's `SamplingParams.structured` is a `StructuredOutput`: a llguidance grammar (the JSON
text ``llguidance.LLMatcher.grammar_from_json_schema`` / ``grammar_from_lark`` give; the server
builds it from ``response_format`` or a forced tool call) and the folder of the Hugging Face
tokenizer its tokens are spelled in. Both are plain strings, so the params travel to every rank of
a tensor-parallel engine unchanged; each rank builds its own matcher from them and advances it with
the same sampled token (every rank samples the same gathered logits), so every rank's matcher is in
the same state at every step.

`guided_sample(logits, requests, sample)` is the engine's one call: for each row whose request has a
grammar it computes the allowed-token bitmask (`allowed_tokens`), sets every other logit to ``-inf`` (on a copy: the
raw logits stay for whoever keeps them), samples all rows with ``sample`` (greedy rows take the
argmax of the masked row, sampled rows draw from it), then advances each matcher with its token.
The matcher is made at the request's first sampled token and lives on the request: a copy of the
grammar's compiled prototype (`compiled_matcher`, cached by grammar text, tokenizer and width), so a
server that compiled the grammar before submitting the request (off its engine loop; llguidance
drops the GIL while it compiles) leaves only the copy to the step. When the grammar is complete
only EOS is allowed. A matcher in error (it should not happen: every token is
drawn from the mask) stops masking that request alone; its error is logged, not raised.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

__all__ = ["StructuredOutput", "guided_sample", "tokenizer_for", "compiled_matcher", "warm_up_grammars",
           "allowed_tokens"]

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


_COMPILED: "collections.OrderedDict" = collections.OrderedDict()
_COMPILED_MAX = 64
_COMPILED_LOCK = threading.Lock()


def compiled_matcher(spec: StructuredOutput, n_vocab: int):
    """The grammar's matcher in its start state, compiled once per (grammar, tokenizer, width) and
    kept (least recently used out past 64); callers take ``deep_copy()``. Any thread may call it.
    A grammar that does not compile is a ``ValueError`` naming llguidance's error."""
    import llguidance

    key = (spec.grammar, spec.tokenizer_dir, n_vocab)
    with _COMPILED_LOCK:
        proto = _COMPILED.get(key)
        if proto is not None:
            _COMPILED.move_to_end(key)
            return proto
    proto = llguidance.LLMatcher(tokenizer_for(spec.tokenizer_dir, n_vocab), spec.grammar)
    if proto.is_error():
        raise ValueError(f"grammar: {proto.get_error()}")
    with _COMPILED_LOCK:
        _COMPILED[key] = proto
        while len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    return proto


def warm_up_grammars(tokenizer_dir: str, n_vocab: int) -> None:
    """Load llguidance and index the tokenizer (the first grammar's fixed cost) now."""
    tokenizer_for(tokenizer_dir, n_vocab)


def allowed_tokens(bitmask: bytes, n_vocab: int) -> torch.Tensor:
    """llguidance's next-token bitmask (little-endian 32-bit words: token ``32 j + i`` allowed when
    bit ``i`` of word ``j`` is set, so bit ``k`` of the byte stream, low bit first, is token ``k``) as
    a ``[n_vocab]`` bool tensor, by numpy's ``unpackbits``. Not ``llguidance.torch``'s helper: it is a
    ``torch.compile`` kernel, whose first call compiled for seconds inside the engine's step (and
    whose import loads Dynamo)."""
    import numpy as np

    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), count=n_vocab, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


class _Guide:
    def __init__(self, spec: StructuredOutput, n_vocab: int):
        self.matcher = compiled_matcher(spec, n_vocab).deep_copy()
        self.n_vocab = n_vocab
        self.failed = False

    def mask(self, row: torch.Tensor) -> None:
        row.masked_fill_(~allowed_tokens(self.matcher.compute_bitmask(), self.n_vocab), float("-inf"))

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
