"""Logits processing and logprobs: what happens to a step's logits between the runner and the sampler.

`process_rows` applies each request's own processors to its row of the step's sampled-position
logits, in vLLM's order: ``allowed_token_ids`` and ``bad_words`` masks, ``min_tokens`` (stop tokens
and EOS masked until enough tokens were generated), ``logit_bias``, then the repetition, frequency
and presence penalties (repetition over prompt + generated tokens, the other two over generated
tokens). A row whose processed logits would not be samplable (a NaN or +inf, or every token masked)
keeps its unprocessed logits (counted as a fallback): one request's parameters never fail another's.

`token_logprobs` gives, per sampled row, the log-softmax of those same processed logits (before
temperature, top-k and top-p: the distribution the request's parameters define, as vLLM's
``processed_logprobs``): the chosen token's logprob and the top-k. `prompt_logprobs` gives, for a
prefill row that returned logits at every position, each prompt token's logprob under the logits of
the position before it (raw logits: no processors apply to the prompt) and the top-k.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["process_rows", "token_logprobs", "prompt_logprobs", "TokenLogprob"]

# one position: (token id, its logprob, ((id, logprob), ...) the top-k, best first)
TokenLogprob = tuple


def _process_one(row: torch.Tensor, r) -> torch.Tensor:
    p = r.sampling
    row = row.float().clone()
    vocab = row.numel()
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long)] = True
        row = row.masked_fill(~keep, float("-inf"))
    gen = r.tokens
    for w in p.bad_words:
        if w[-1] < vocab and (len(w) == 1 or list(w[:-1]) == gen[len(gen) - len(w) + 1:]):
            row[w[-1]] = float("-inf")
    if len(gen) < p.min_tokens and r.stop_token_ids:
        ids = [t for t in r.stop_token_ids if t < vocab]
        if ids:
            row[torch.tensor(ids, dtype=torch.long)] = float("-inf")
    for t, b in p.logit_bias:
        if t < vocab:
            row[t] += float(b)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(r.prompt + gen, dtype=torch.long)] = True
        rp = float(p.repetition_penalty)
        row = torch.where(seen, torch.where(row > 0, row / rp, row * rp), row)
    if gen and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(gen, dtype=torch.long), minlength=vocab)[:vocab].float()
        row = row - float(p.frequency_penalty) * counts - float(p.presence_penalty) * (counts > 0).float()
    return row


def process_rows(logits: torch.Tensor, requests: Sequence) -> tuple[torch.Tensor, int]:
    """``logits[i]`` processed for ``requests[i]`` (a new tensor when any row is processed; the
    input otherwise). Returns ``(logits, fallbacks)``."""
    todo = [i for i, r in enumerate(requests) if r.sampling.processes_logits]
    if not todo:
        return logits, 0
    out = logits.float().clone()
    fallbacks = 0
    for i in todo:
        try:
            row = _process_one(out[i], requests[i])
            if torch.isnan(row).any() or torch.isposinf(row).any() or not torch.isfinite(row).any():
                raise ValueError("processed logits are not samplable")
            out[i] = row
        except (RuntimeError, ValueError, IndexError):
            fallbacks += 1  # this row keeps its unprocessed logits
    return out, fallbacks


def _top(lp: torch.Tensor, k: int) -> tuple:
    if k <= 0:
        return ()
    v, ix = torch.topk(lp, min(k, lp.numel()))
    return tuple(zip(ix.tolist(), v.tolist()))


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], ks: Sequence[Optional[int]]) -> list:
    """Per row: ``None`` (k None) or ``(token, logprob, top-k)`` from ``log_softmax(logits[i])``."""
    out: list = [None] * len(ks)
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    for j, i in enumerate(rows):
        out[i] = (int(tokens[i]), float(lp[j, tokens[i]]), _top(lp[j], ks[i]))
    return out


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], k: int) -> tuple:
    """``logits``: one row per prompt position (``[len(prompt), vocab]``). Position 0 has no logprob
    (None); position j's comes from row j - 1."""
    n = len(prompt)
    lp = torch.log_softmax(logits[:n - 1].float(), dim=-1)
    nxt = torch.tensor(prompt[1:], dtype=torch.long)
    chosen = lp.gather(1, nxt[:, None])[:, 0].tolist()
    tops = [()] * (n - 1)
    if k > 0:
        v, ix = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
        tops = [tuple(zip(a, b)) for a, b in zip(ix.tolist(), v.tolist())]
    return (None, *((int(t), c, tp) for t, c, tp in zip(prompt[1:], chosen, tops)))
