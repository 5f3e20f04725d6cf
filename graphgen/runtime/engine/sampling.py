"""Choosing the next token from a step's logits, and deciding when a request stops.

``temperature == 0`` is ``argmax`` — exactly what ``Engine`` does today, so a greedy request gives
the same tokens whichever path it takes. Otherwise: temperature scaling, then top-k, then top-p
(nucleus) on the sorted probabilities, then one draw from a ``torch.Generator`` owned by the
request. With a ``seed`` the generator is seeded with it, so the same request gives the same tokens
(the draws depend only on the seed and the logits, not on other requests or thread timing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["SamplingParams", "Sampler", "StopChecker", "find_stop", "holdback"]


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. Validated on construction (``ValueError`` names the field)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 (or -1) = no limit
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()  # stop strings (matched on detokenized text; the match is cut off)
    stop_token_ids: tuple[int, ...] = ()  # the token is emitted, then the request stops
    ignore_eos: bool = False  # the tokenizer's EOS does not stop the request (load generators use it)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise ValueError("temperature must be in [0, 100]")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError("top_k must be an integer >= -1 (-1 or 0: no limit)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError("seed must be an integer")

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0


class Sampler:
    """One per request: holds the request's random generator so its draws are reproducible."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator()
            # without a seed: a fresh seed per request (not reproducible, as OpenAI's API)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        row = logits.detach().reshape(-1).float()
        if p.greedy:
            return int(torch.argmax(row))
        scaled = row / float(p.temperature)
        if not bool(torch.isfinite(scaled).all()):  # a temperature so small it overflows float32: its limit
            scaled = torch.full_like(row, float("-inf"))
            scaled[torch.argmax(row)] = 0.0
        row = scaled
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the tokens ranked above each one
            sorted_p = sorted_p.masked_fill(before >= p.top_p, 0.0)  # the top token always stays
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


class StopChecker:
    """Token-level stops, applied by the engine: a stop token (``stop_token_ids`` or the tokenizer's
    EOS; the token is emitted, then the request stops) and ``max_tokens``. Stop *strings* need text,
    so the server matches them (:func:`find_stop`) and aborts the request when one appears."""

    def __init__(self, params: SamplingParams, eos_token_id: Optional[int] = None):
        self.params = params
        eos = {eos_token_id} if eos_token_id is not None and not params.ignore_eos else set()
        self.stop_ids = set(params.stop_token_ids) | eos

    def check(self, tokens: Sequence[int]) -> Optional[str]:
        """The finish reason (``"stop"`` / ``"length"``) when the request must stop after ``tokens``."""
        if tokens and tokens[-1] in self.stop_ids:
            return "stop"
        if len(tokens) >= self.params.max_tokens:
            return "length"
        return None


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest stop string in ``text``, or -1."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else -1


def holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` to hold back while streaming: the longest tail that
    is a proper prefix of some stop string (it may still become a stop), plus an undecodable tail."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    tail = len(text) - len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence decodes to U+FFFD
    return max(n, tail)
