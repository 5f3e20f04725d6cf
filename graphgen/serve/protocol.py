"""OpenAI request parsing and validation: user input becomes a :class:`Parsed` or an :class:`ApiError`.

Every rule here answers bad input with a 400 naming the field (``param``), the way OpenAI's API does.
Every field of OpenAI's and vLLM's APIs is listed in serve/fields.py as supported, refused (a 400
naming it, `check_refused`) or ignored with a reason; fields outside both APIs are ignored (as vLLM).
Logprobs, echo, ``n``/``best_of``, penalties, ``logit_bias``, ``min_tokens``, ``bad_words`` and
``allowed_token_ids`` are parsed by `sampling_fields`; chat's fields by serve/chat_request.py;
``response_format`` by serve/structured.py.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..runtime import MIN_TEMPERATURE, SEED_RANGE, SamplingParams  # one home: the engine's rules
from .errors import ApiError  # noqa: F401  (re-exported: the routes and tests import it from here)
from .fields import check_refused
from .sampling_fields import DEFAULT_MAX_LOGPROBS, FanOut, FieldError, parse_fields, zero_max_tokens

MAX_STOP = 1024  # OpenAI's cap is 4; vLLM has none (lm-eval's code tasks send 5): a bound on the matching work
MAX_JSON_DEPTH = 64  # nesting of objects/arrays in a request body (deeper: a 400, before json.loads)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM's
DEFAULT_COMPLETION_TOKENS = 16  # completions without max_tokens (OpenAI's default); chat: up to the context


@dataclass(frozen=True)
class TextRules:
    include_stop: bool = False  # include_stop_str_in_output: a stop string stays at the end
    skip_special: bool = True  # skip_special_tokens: special tokens (EOS) are not text


@dataclass(frozen=True)
class Parsed:
    prompts: tuple[tuple[int, ...], ...]  # one engine request per prompt
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage
    model: str
    chat: Optional[dict] = None  # chat output parsing (serve/chat_output.py ChatOutput's arguments), or None
    fan: FanOut = FanOut()  # n / best_of / echo / logprobs (sampling_fields)
    grammar_field: Optional[str] = None  # the field that asked for params.structured (its 400s name it)
    text: TextRules = TextRules()  # how token ids become the returned text


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = re.compile(rb"[^\[\]{}]+")
_INNERMOST = re.compile(rb"\[\]|\{\}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_depth_exceeds(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the arrays/objects of ``raw`` nest deeper than ``limit`` (strings skipped), without
    recursion: the brackets alone, innermost pairs removed once per level (C-speed regex passes).
    Unbalanced brackets are left for ``json.loads`` to report."""
    s = _NOT_BRACKETS.sub(b"", _STRINGS.sub(b"", raw))
    for _ in range(limit):
        if not s:
            return False
        t = _INNERMOST.sub(b"", s)
        if t == s:
            return False  # unbalanced: not JSON (json.loads says where)
        s = t
    return bool(s) and _INNERMOST.search(s) is not None


def _surrogate_path(v, path: str = "") -> Optional[str]:
    """The path (``messages[0].content``) of the first string holding a lone UTF-16 surrogate (JSON
    allows the escape ``\\ud800``; UTF-8, the tokenizer and the response encoder do not)."""
    stack = [(v, path)]
    while stack:
        x, p = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return p or "body"
        elif isinstance(x, dict):
            for k, y in x.items():
                if _surrogate_path(k, "") is not None:
                    return (p + "." if p else "") + "<key>"
                stack.append((y, f"{p}.{k}" if p else k))
        elif isinstance(x, list):
            stack.extend((y, f"{p}[{i}]") for i, y in enumerate(x) if isinstance(y, (str, dict, list)))
    return None


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400: not UTF-8 / not JSON, nested deeper than
    ``MAX_JSON_DEPTH``, a lone surrogate in a string, numbers too long to parse."""
    if json_depth_exceeds(raw):
        raise ApiError(f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError("the request body nests too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}"[:300], code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        where = _surrogate_path(body)
        if where is not None:
            raise ApiError(f"'{where}' holds a lone UTF-16 surrogate (not valid Unicode text)", param=where,
                           code="invalid_encoding")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _get(body, name, check, what, default):
    v = body.get(name)
    if v is None:
        return default
    if not check(v):
        raise ApiError(f"'{name}' must be {what}, got {json.dumps(v)[:80]}", param=name, code="invalid_type")
    return v


class Context:
    """What validation needs to know about the model and the tokenizer."""

    def __init__(self, model_name: str, vocab_size: int, max_model_len: int, tokenizer=None,
                 max_logprobs: int = DEFAULT_MAX_LOGPROBS):
        self.model_name, self.vocab_size, self.max_model_len, self.tokenizer = model_name, vocab_size, max_model_len, tokenizer
        self.tokenizer_dir = None  # the tokenizer's folder (structured output's grammars are spelled in it)
        self.chat_setup = None  # serve/tools.py ChatSetup: the tool-call and reasoning parsers (None: off)
        self.max_logprobs = max_logprobs  # --max-logprobs: logprobs / top_logprobs at most (prompt ones too)
        # params -> (field, sentence) when the engine cannot run them (speculative decoding), or None
        self.refusal = None
        self.lora_paths: dict[str, str] = {}
        self.lora_names: tuple[str, ...] = ()  # the LoRA adapters served (--lora-modules): each is a "model"

    def encode(self, text: str, param: str, add_special: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(f"'{param}' is text but the checkpoint folder has no tokenizer: send token ids",
                           param=param, code="no_tokenizer")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special))
        except Exception as e:  # e.g. text the tokenizer cannot take: the request's fault, not the server's
            raise ApiError(f"'{param}' could not be tokenized: {e}"[:300], param=param, code="invalid_value") from None


def _number(body, name, default: float) -> float:
    """A finite number (int or float; huge ints that overflow a float are a 400 too)."""
    v = _get(body, name, _is_num, "a number", default)
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise ApiError(f"'{name}' must be a finite number", param=name, code="invalid_value")
    return f


def _flag(body, name: str, default: bool) -> bool:
    return _get(body, name, lambda v: isinstance(v, bool), "a boolean", default)


@dataclass(frozen=True)
class Common:
    """The fields both routes share."""

    kw: dict  # SamplingParams keyword arguments (max_tokens None when not given)
    stream: bool
    include_usage: bool  # stream_options.include_usage
    model: str
    fan: FanOut
    text: TextRules
    add_special: bool  # add_special_tokens: the tokenizer's own specials (BOS) around text prompts


def _common(body: dict, ctx: Context, chat: bool = False) -> Common:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model", code="invalid_type")
    if model not in (None, ctx.model_name, *ctx.lora_names):
        served = ", ".join(f"'{m}'" for m in (ctx.model_name, *ctx.lora_names))
        raise ApiError(f"the model '{model}' does not exist; this server serves {served}",
                       param="model", code="model_not_found", status=404)
    check_refused(body, "chat" if chat else "completions")
    if "max_completion_tokens" in body and body.get("max_tokens") is None:
        body = dict(body, max_tokens=body["max_completion_tokens"])
    # ---- issue 16: logprobs, echo, n/best_of, penalties, logit_bias, ... (sampling_fields.py) ----
    body, zero = zero_max_tokens(body, chat)
    try:
        fields = parse_fields(body, ctx, chat=chat, stream=body.get("stream") is True, drop_generated=zero)
    except FieldError as e:
        raise ApiError(str(e), param=e.param, code=e.code) from None
    # ---- end issue 16 ----
    max_tokens = _get(body, "max_tokens", _is_int, "an integer", None)
    if max_tokens is not None and max_tokens <= 0:
        raise ApiError(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens", code="invalid_value")
    if max_tokens is not None and max_tokens >= ctx.max_model_len:  # no prompt leaves room for it
        raise ApiError(f"'max_tokens' ({str(max_tokens)[:20]}) must be less than this model's maximum context "
                       f"length, {ctx.max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0)
    if 0 < temperature < MIN_TEMPERATURE:
        raise ApiError(f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {temperature}",
                       param="temperature", code="invalid_value")
    top_p = _number(body, "top_p", 1.0)
    min_p = _number(body, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise ApiError(f"'min_p' must be in [0, 1], got {min_p}", param="min_p", code="invalid_value")
    top_k = _get(body, "top_k", _is_int, "an integer", 0)
    if top_k > 1 << 31:
        top_k = 0  # more than any vocabulary: no limit
    seed = _get(body, "seed", _is_int, "an integer", None)
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ApiError(f"'seed' must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]", param="seed", code="invalid_value")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError("'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stop) > MAX_STOP:
        raise ApiError(f"'stop' takes at most {MAX_STOP} strings", param="stop", code="invalid_value")
    if stop and ctx.tokenizer is None:
        raise ApiError("'stop' strings need a tokenizer in the checkpoint folder", param="stop", code="no_tokenizer")
    stop_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                    "a list of integers", [])
    if any(not 0 <= t < ctx.vocab_size for t in stop_ids):
        raise ApiError(f"'stop_token_ids' must be token ids in [0, {ctx.vocab_size})", param="stop_token_ids",
                       code="invalid_token_id")
    stream = _flag(body, "stream", False)
    ignore_eos = _flag(body, "ignore_eos", False)  # vLLM's extension
    opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = bool(opts.get("include_usage", False))
    text = TextRules(_flag(body, "include_stop_str_in_output", False), _flag(body, "skip_special_tokens", True))
    add_special = _flag(body, "add_special_tokens", False)
    kw = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
              stop=tuple(s for s in stop if s), stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos,
              **fields.params)
    # ---- structured output (serve/structured.py): response_format -> a grammar for the engine's mask
    from .structured import response_format_grammar, structured

    kw["structured"] = structured(response_format_grammar(body.get("response_format")), ctx.tokenizer_dir,
                                  "response_format")
    # ----
    lora = model if model in ctx.lora_names and model != ctx.model_name else None
    if lora is not None:
        kw["lora"] = lora  # the request runs under that adapter (docs/lora.md)
    check_engine(kw, ctx, fields.fan)
    return Common(kw, stream, include_usage, lora or ctx.model_name, fields.fan, text, add_special)


def check_engine(kw: dict, ctx: Context, fan: FanOut) -> None:
    """Every field checked against the engine's own rules before any tokenization: a 400 naming the
    field the client sent (e.g. what speculative decoding cannot run)."""
    params = _params(dict(kw, max_tokens=1))
    why = ctx.refusal(params) if ctx.refusal is not None else None
    if why is not None:
        param, sentence = why
        if param == "logprobs" and fan.logprobs is None:  # asked for by best_of > n, not the client
            param, sentence = "best_of", "best_of > n (it ranks choices by logprobs) " + sentence.split(" ", 1)[1]
        raise ApiError(sentence, param=param, code="unsupported_value")


def _params(kw: dict) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise ApiError(str(e), param=field, code="invalid_value") from None


def _check_ids(ids: list, ctx: Context, param: str, max_tokens: int) -> tuple[int, ...]:
    if not ids:
        raise ApiError(f"'{param}' is empty", param=param, code="invalid_value")
    bad = [t for t in ids if not _is_int(t) or t < 0 or t >= ctx.vocab_size]
    if bad:
        raise ApiError(f"'{param}' has token ids outside [0, {ctx.vocab_size}): {bad[:5]}", param=param,
                       code="invalid_token_id")
    if len(ids) + max_tokens > ctx.max_model_len:
        raise ApiError(f"this model's maximum context length is {ctx.max_model_len} tokens; the prompt has "
                       f"{len(ids)} and max_tokens asks for {max_tokens}", param=param, code="context_length_exceeded")
    return tuple(ids)


def parse_completion(body: dict, ctx: Context) -> Parsed:
    c = _common(body, ctx)
    if c.kw["max_tokens"] is None:
        c.kw["max_tokens"] = DEFAULT_COMPLETION_TOKENS
    params = _params(c.kw)
    p = body.get("prompt")
    if isinstance(p, str):
        raw = [ctx.encode(p, "prompt", c.add_special)]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        raw = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        raw = [ctx.encode(x, "prompt", c.add_special) for x in p]
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        raw = p
    else:
        raise ApiError("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                       param="prompt", code="invalid_type")
    prompts = tuple(_check_ids(ids, ctx, "prompt", params.max_tokens) for ids in raw)
    return Parsed(prompts, params, c.stream, c.include_usage, c.model, fan=c.fan, text=c.text,
                  grammar_field="response_format" if params.structured is not None else None)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
