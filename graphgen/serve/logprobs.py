"""Logprobs in OpenAI's response shapes, from the engine's entries (`RequestOutput.logprobs` /
``prompt_logprobs``: ``(token id, logprob, ((id, logprob), ...top-k))``, ``None`` for a prompt's
first token).

- completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; each
  ``top_logprobs`` entry is ``{token: logprob}`` of the top-k plus the chosen token (as vLLM), and
  ``None`` for a prompt's first token; ``text_offset`` counts characters from the start of the
  returned text (the echoed prompt, when echo);
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
  (exactly the top-k).

Token strings are each id decoded alone (``token_id:N`` without a tokenizer); ``-inf`` (a token
masked by ``logit_bias`` / ``allowed_token_ids``) is sent as ``-9999.0``, as vLLM does (JSON has no
infinity). Decoding runs where the server detokenizes (off the event loop).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

__all__ = ["LogprobFormatter", "cumulative"]

NEG = -9999.0


def _f(x: float) -> float:
    return x if math.isfinite(x) else NEG


def cumulative(entries: Sequence) -> float:
    """Sum of the chosen tokens' logprobs (best_of ranks choices by it)."""
    return sum(e[1] for e in entries if e is not None)


class LogprobFormatter:
    def __init__(self, tokenizer=None):
        self.tok = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, t: int) -> str:
        s = self._cache.get(t)
        if s is None:
            s = self.tok.decode([t]) if self.tok is not None else f"token_id:{t}"
            if len(self._cache) < 65536:
                self._cache[t] = s
        return s

    def completion(self, ids: Sequence[int], entries: Sequence[Optional[tuple]], offset: int = 0) -> dict:
        """``ids[i]`` with its entry (None: no logprob, a prompt's first token); ``offset``: the
        text offset of the first token."""
        tokens, lps, tops, offs = [], [], [], []
        for t, e in zip(ids, entries):
            s = self.token(t)
            tokens.append(s)
            offs.append(offset)
            offset += len(s)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_f(e[1]))
            top: dict = {}
            for i, v in e[2]:  # best first: a token text shared by several ids keeps its best logprob
                top.setdefault(self.token(i), _f(v))
            top.setdefault(s, _f(e[1]))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def chat(self, entries: Sequence[tuple]) -> dict:
        def one(t, v):
            s = self.token(t)
            return {"token": s, "logprob": _f(v), "bytes": list(s.encode("utf-8"))}

        return {"content": [dict(one(e[0], e[1]), top_logprobs=[one(i, v) for i, v in e[2]])
                            for e in entries if e is not None]}
