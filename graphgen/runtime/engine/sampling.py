"""Sampling: what a request asks for (`SamplingParams`) and how its next token is chosen.

``temperature == 0`` is ``argmax``, so a greedy request gives the same tokens whichever path it
takes. Otherwise: temperature scaling, then top-k, then top-p (nucleus) on the sorted
probabilities, then one draw from a ``torch.Generator`` owned by the request (`Sampler`). With a
``seed`` the generator is seeded with it, so the same request gives the same tokens (the draws
depend only on the seed and the logits, not on other requests or thread timing) — and every rank of
a tensor-parallel engine, which samples the same logits with its own copy of the sampler, draws the
same token. `sample_rows` samples a step's rows: one ``argmax`` over the greedy rows, each other row
with its own sampler; a row whose sampling fails numerically falls back to greedy for that row only
(counted), so one request's extreme parameters never fail the others in its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["SamplingParams", "Sampler", "sample_rows", "MAX_SEED"]

MAX_SEED = 2 ** 63 - 1  # torch.Generator.manual_seed takes a signed 64-bit int


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the engine. Validated on construction (``ValueError`` names the field)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 (or -1) = no limit
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()  # stop strings (matched on detokenized text by the server; cut off)
    stop_token_ids: tuple[int, ...] = ()  # the token is emitted, then the request stops
    ignore_eos: bool = False  # the model's EOS does not stop the request (load generators use it)
    # structured output: a grammar.StructuredOutput (llguidance grammar + tokenizer folder), or None
    structured: Optional[object] = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        t = float(self.temperature)
        if not (t == 0.0 or 1e-6 <= t <= 100.0) or math.isnan(t):
            # below 1e-6 the scaled logits overflow to inf: greedy is what such a request means
            raise ValueError("temperature must be 0 (greedy) or in [1e-06, 100]")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError("top_k must be an integer >= -1 (-1 or 0: no limit)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, {MAX_SEED}]")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.structured is not None and type(self.structured).__name__ != "StructuredOutput":
            raise ValueError("structured must be a StructuredOutput")

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0


class Sampler:
    """One per sampled request: holds the request's random generator so its draws are reproducible."""

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


def sample_rows(logits: torch.Tensor, samplers: Sequence[Optional[Sampler]]) -> tuple[list[int], int]:
    """Row i's next token (``samplers[i]`` None: greedy). Returns ``(tokens, fallbacks)``: rows whose
    sampler raised (logits that are not finite, say) took the argmax instead, so a request's failure
    stays its own."""
    tokens = logits.argmax(-1).tolist()
    fallbacks = 0
    for i, s in enumerate(samplers):
        if s is None or s.params.greedy:
            continue
        try:
            tokens[i] = s(logits[i])
        except (RuntimeError, ValueError):
            fallbacks += 1
    return tokens, fallbacks
