"""Sampling: what a request asks for (`SamplingParams`) and how its next token is chosen.

``temperature == 0`` is ``argmax``, so a greedy request gives the same tokens whichever path it
takes. Otherwise: temperature scaling, then top-k, then min-p (tokens under ``min_p`` times the
likeliest one's probability dropped), then top-p (nucleus) on the sorted probabilities, then one draw from a ``torch.Generator`` owned by the request (`Sampler`). With a
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

__all__ = ["SamplingParams", "Sampler", "sample_rows", "rejection_sample", "SEED_RANGE", "MIN_TEMPERATURE", "VALUE_RANGES"]

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
# below it (but not 0) logits / temperature overflow float32: such a request is refused, not guessed at
MIN_TEMPERATURE = 1e-5
# the closed ranges of the logits processors' numbers (graphgen.runtime.engine.logits), as OpenAI/vLLM
VALUE_RANGES = {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
                "repetition_penalty": (0.01, 100.0), "logit_bias": (-100.0, 100.0)}


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the engine. Validated on construction (``ValueError`` names the field)."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 (or -1) = no limit
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p x the likeliest one (vLLM's)
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()  # stop strings (matched on detokenized text by the server; cut off)
    stop_token_ids: tuple[int, ...] = ()  # the token is emitted, then the request stops
    ignore_eos: bool = False  # the model's EOS does not stop the request (load generators use it)
    # structured output: a grammar.StructuredOutput (llguidance grammar + tokenizer folder), or None
    structured: Optional[object] = None
    # ---- logprobs and logits processing (graphgen.runtime.engine.logits) ----
    logprobs: Optional[int] = None  # per generated token: its logprob and the top-k (k = logprobs, 0: none)
    prompt_logprobs: Optional[int] = None  # per prompt token: its logprob and the top-k (skips the pool lookup)
    presence_penalty: float = 0.0  # [-2, 2]: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # [0.01, 100]: prompt + generated tokens' logits divided (>0) / multiplied
    logit_bias: tuple = ()  # ((token_id, bias in [-100, 100]), ...)
    min_tokens: int = 0  # stop tokens (and EOS) are masked until this many tokens were generated
    bad_words: tuple = ()  # token-id sequences: the last token of one is masked when the rest was just generated
    allowed_token_ids: Optional[tuple] = None  # only these may be sampled
    # the LoRA adapter, by the name it is served under (docs/lora.md; None: the base model). vLLM passes a
    # LoRARequest beside the params; here it rides with them, so forks, copies and P/D carry it unchanged
    lora: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        t = float(self.temperature)
        if not (t == 0.0 or MIN_TEMPERATURE <= t <= 100.0) or math.isnan(t):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100]")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be a number in [0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError("top_k must be an integer >= -1 (-1 or 0: no limit)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if self.structured is not None and type(self.structured).__name__ != "StructuredOutput":
            raise ValueError("structured must be a StructuredOutput")
        _check_processing(self)

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor applies (graphgen.runtime.engine.logits)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words or self.allowed_token_ids is not None)

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_processing(p: "SamplingParams") -> None:
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        if v is not None and (not _int(v) or v < 0):
            raise ValueError(f"{name} must be None or an integer >= 0")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        lo, hi = VALUE_RANGES[name]
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= float(v) <= hi:
            raise ValueError(f"{name} must be a number in [{lo}, {hi}]")
    for pair in p.logit_bias:
        if not (isinstance(pair, tuple) and len(pair) == 2 and _int(pair[0]) and pair[0] >= 0
                and isinstance(pair[1], (int, float)) and not isinstance(pair[1], bool)
                and VALUE_RANGES["logit_bias"][0] <= float(pair[1]) <= VALUE_RANGES["logit_bias"][1]):
            raise ValueError("logit_bias must be (token_id >= 0, bias in [-100, 100]) pairs")
    if not _int(p.min_tokens) or p.min_tokens < 0:
        raise ValueError("min_tokens must be an integer >= 0")
    if any(not isinstance(w, tuple) or not w or any(not _int(t) or t < 0 for t in w) for w in p.bad_words):
        raise ValueError("bad_words must be non-empty token-id sequences")
    a = p.allowed_token_ids
    if a is not None and (not isinstance(a, tuple) or not a or any(not _int(t) or t < 0 for t in a)):
        raise ValueError("allowed_token_ids must be a non-empty sequence of token ids")


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
        if self.params.greedy:
            return int(torch.argmax(logits.detach().reshape(-1)))
        return int(torch.multinomial(self._weights(logits), 1, generator=self.generator))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a draw samples from (temperature, top-k, min-p, top-p applied), ``[V]`` float32,
        summing to 1: speculative decoding's rejection sampling compares the target's with the draft's."""
        w = self._weights(logits)
        return w / w.sum()

    def _weights(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        row = logits.detach().reshape(-1).float()
        scaled = row / float(p.temperature)
        if not bool(torch.isfinite(scaled).all()):  # a temperature so small it overflows float32: its limit
            scaled = torch.full_like(row, float("-inf"))
            scaled[torch.argmax(row)] = 0.0
        row = scaled
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.min_p > 0.0:  # as vLLM, before top-p: a share of the likeliest token's probability
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the tokens ranked above each one
            sorted_p = sorted_p.masked_fill(before >= p.top_p, 0.0)  # the top token always stays
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return probs


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


def rejection_sample(target: torch.Tensor, draft: torch.Tensor, drafts: Sequence[int],
                     generator: Optional[torch.Generator]) -> tuple[list[int], int]:
    """Speculative sampling (Leviathan et al., arXiv 2211.17192, Algorithm 1): ``target`` ``[K+1, V]``
    the target's distributions at the verify row's positions, ``draft`` ``[K, V]`` the distributions
    the ``K`` drafts were drawn from. Draft ``x`` at position i is accepted with probability
    ``min(1, p_i(x) / q_i(x))``; the first rejected one is replaced by a draw from
    ``norm(max(0, p_i - q_i))`` and ends the row; when all are accepted a bonus token is drawn from
    ``p_K``. Each emitted token is then distributed exactly as ``p`` (the paper's Theorem).
    Returns ``(emitted tokens, drafts accepted)``."""
    out: list[int] = []
    for i, x in enumerate(int(d) for d in drafts):
        p, q = target[i], draft[i]
        u = float(torch.rand((), generator=generator))
        if u * float(q[x]) < float(p[x]):  # u < p/q, without dividing by a q that may be 0
            out.append(x)
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        # p == q everywhere but at x, in rounding: a rejection there has no residual mass left
        dist = residual / total if total > 0 else p
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out, i
    out.append(int(torch.multinomial(target[len(out)], 1, generator=generator)))
    return out, len(out) - 1
