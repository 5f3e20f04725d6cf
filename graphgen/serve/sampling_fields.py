"""The request fields of issue 16 (logprobs, echo, n / best_of, penalties, logit_bias, min_tokens,
bad_words, allowed_token_ids), parsed and validated for `protocol` (a 400 naming the field).

`parse_fields` returns a `Fields`: the `SamplingParams` keyword arguments they set and the
`FanOut` the server needs to build and shape the answer (how many engine requests per prompt, which
to return, whether logprobs and the echoed prompt go into the response).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

from ..runtime import VALUE_RANGES  # the engine's ranges (one home)

__all__ = ["FanOut", "Fields", "FieldError", "parse_fields", "zero_max_tokens", "DEFAULT_MAX_LOGPROBS", "MAX_N"]

DEFAULT_MAX_LOGPROBS = 20  # vLLM's --max-logprobs default
MAX_N = 128  # n and best_of, at most (each is one engine request)


@dataclass(frozen=True)
class FanOut:
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # engine requests per prompt (the n with the highest cumulative logprob are returned)
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    logprobs: Optional[int] = None  # top-k in the response (None: "logprobs": null)
    drop_generated: bool = False  # max_tokens 0 with echo: the engine's one token is not returned
    min_tokens: int = 0  # stop strings are not matched before this many tokens


@dataclass(frozen=True)
class Fields:
    params: dict = field(default_factory=dict)
    fan: FanOut = FanOut()


class FieldError(ValueError):
    """A bad field: `protocol` answers it with a 400 naming ``param``."""

    def __init__(self, message: str, param: str, code: str):
        super().__init__(message)
        self.param, self.code = param, code


def _err(msg, name, code="invalid_value"):
    return FieldError(msg, name, code)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(body, name, default, lo, hi) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _err(f"'{name}' must be a number, got {json.dumps(v)[:80]}", name, "invalid_type")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not (math.isfinite(f) and lo <= f <= hi):
        raise _err(f"'{name}' must be a number in [{lo}, {hi}]", name)
    return f


def _count(body, name, default, lo, hi) -> int:
    v = body.get(name)
    if v is None:
        return default
    if not _int(v):
        raise _err(f"'{name}' must be an integer, got {json.dumps(v)[:80]}", name, "invalid_type")
    if not lo <= v <= hi:
        raise _err(f"'{name}' must be an integer in [{lo}, {hi}]", name)
    return v


def zero_max_tokens(body: dict, chat: bool) -> tuple[dict, bool]:
    """``max_tokens: 0`` with ``echo`` (completions): the engine runs one token, which is dropped."""
    if not chat and body.get("max_tokens") == 0 and _int(body.get("max_tokens")) and body.get("echo") is True:
        return dict(body, max_tokens=1), True
    return body, False


def parse_fields(body: dict, ctx, *, chat: bool, stream: bool, drop_generated: bool) -> Fields:
    vocab, max_lp = ctx.vocab_size, getattr(ctx, "max_logprobs", DEFAULT_MAX_LOGPROBS)
    n = _count(body, "n", 1, 1, MAX_N)
    best_of = _count(body, "best_of", n, 1, MAX_N)
    if best_of < n:
        raise _err(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    if stream and best_of > n:
        raise _err("'best_of' greater than 'n' cannot be streamed", "best_of")
    echo = False
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise _err("'logprobs' must be a boolean", "logprobs", "invalid_type")
        top = _count(body, "top_logprobs", None, 0, max_lp)
        if top is not None and not want:
            raise _err("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        k = (top or 0) if want else None
    else:
        k = _count(body, "logprobs", None, 0, max_lp)
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise _err("'echo' must be a boolean", "echo", "invalid_type")
        echo = bool(echo)
    p: dict = {}
    engine_k = k if k is not None else (0 if best_of > n else None)  # best_of ranks by cumulative logprob
    if engine_k is not None:
        p["logprobs"] = engine_k
    if echo and k is not None:
        p["prompt_logprobs"] = k
    p["presence_penalty"] = _num(body, "presence_penalty", 0.0, *VALUE_RANGES["presence_penalty"])
    p["frequency_penalty"] = _num(body, "frequency_penalty", 0.0, *VALUE_RANGES["frequency_penalty"])
    p["repetition_penalty"] = _num(body, "repetition_penalty", 1.0, *VALUE_RANGES["repetition_penalty"])
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _err("'logit_bias' must be an object of token id -> bias", "logit_bias", "invalid_type")
        pairs = []
        for key, v in bias.items():
            try:
                t = int(key)
            except (TypeError, ValueError):
                t = -1
            if not 0 <= t < vocab:
                raise _err(f"'logit_bias' keys must be token ids in [0, {vocab}), got {str(key)[:40]!r}",
                           "logit_bias", "invalid_token_id")
            pairs.append((t, _num({"logit_bias": v}, "logit_bias", 0.0, *VALUE_RANGES["logit_bias"])))
        p["logit_bias"] = tuple(pairs)
    mt = _count(body, "min_tokens", 0, 0, 1 << 31)
    if mt and _int(body.get("max_tokens")) and body["max_tokens"] >= 1 and mt > body["max_tokens"]:
        raise _err("'min_tokens' must not exceed 'max_tokens'", "min_tokens")
    p["min_tokens"] = mt
    bad = body.get("bad_words")
    if bad is not None:
        if not (isinstance(bad, list) and all(isinstance(w, str) and w for w in bad)):
            raise _err("'bad_words' must be a list of non-empty strings", "bad_words", "invalid_type")
        if bad and ctx.tokenizer is None:
            raise _err("'bad_words' need a tokenizer in the checkpoint folder", "bad_words", "no_tokenizer")
        p["bad_words"] = tuple(tuple(ids) for ids in (ctx.encode(w, "bad_words") for w in bad) if ids)
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if not (isinstance(allowed, list) and allowed and all(_int(t) and 0 <= t < vocab for t in allowed)):
            raise _err(f"'allowed_token_ids' must be a non-empty list of token ids in [0, {vocab})",
                       "allowed_token_ids", "invalid_token_id")
        p["allowed_token_ids"] = tuple(allowed)
    return Fields(p, FanOut(n=n, best_of=best_of, echo=echo, logprobs=k, drop_generated=drop_generated,
                            min_tokens=mt))
