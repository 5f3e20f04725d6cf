"""The FastAPI app: OpenAI-compatible routes over an :class:`EngineLoop`.

``create_app(engine, tokenizer=...)`` returns an app whose lifespan starts the engine loop and, on
shutdown (uvicorn's answer to SIGTERM, after it stopped accepting and let open requests finish),
stops it: running requests get ``drain_timeout_s`` to finish, the rest are aborted, pending saves
are committed, the trace is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import time
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .logprobs import LogprobFormatter, cumulative
from .sampling_fields import FanOut
from .stops import find_stop, holdback
from .tools import ChatOutput
from ..netutil import bearer_authorized, is_api_path
from ..trace import NULL, TraceRecorder
from .engine_api import RequestOutput, ServingEngine
from .loop import EngineLoop
from .metrics import CONTENT_TYPE, ServerMetrics
from .pd import FIELD as KV_FIELD, Handoff, serve_with_role
from .protocol import SSE_DONE, ApiError, Context, Parsed, parse_chat, parse_completion, parse_json, sse, usage

log = logging.getLogger("graphgen.serve")
access_log = logging.getLogger("graphgen.serve.access")
DISCONNECT_POLL_S = 0.25
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/kv/release")


def _json_response(status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()):
    """(start, body) ASGI messages of a JSON answer sent by the middleware itself."""
    data = json.dumps(body).encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                         *headers]},
            {"type": "http.response.body", "body": data})


class _Gate:
    """Pure ASGI middleware (streams and disconnects pass through untouched): the API key on every
    ``/v1/*`` route (constant-time compare against every key; ``/health`` and ``/metrics`` stay
    open), ``Content-Length`` over the limit refused with a 413 before the body is read, and one
    access-log line (``info``) and one HTTP-status count per response."""

    def __init__(self, app, metrics: ServerMetrics, api_keys: Sequence[str], max_request_bytes: int):
        self.app, self.metrics, self.max_bytes = app, metrics, max_request_bytes
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        path, method = scope.get("path", ""), scope.get("method", "")
        status = {"code": 0}

        async def counted_send(msg):
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        try:
            headers = dict(scope.get("headers") or ())
            refuse = None
            if self.keys and is_api_path(path) and not bearer_authorized(headers.get(b"authorization", b""), self.keys):
                refuse = _json_response(401, {"error": {
                    "message": "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
                    [(b"www-authenticate", b"Bearer")])
            else:
                length = headers.get(b"content-length")
                if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
                    refuse = _json_response(413, _too_large(self.max_bytes).body(), [(b"connection", b"close")])
            if refuse is not None:
                self.metrics.bad_requests.inc()
                for msg in refuse:
                    await counted_send(msg)
                return
            await self.app(scope, receive, counted_send)
        finally:
            route = path if path in ROUTES else "other"
            code = status["code"] or 500
            self.metrics.http_response(route, method, code)
            if access_log.isEnabledFor(logging.INFO):
                client = scope.get("client") or ("-", 0)
                access_log.info('%s:%s "%s %s" %d %.1fms', client[0], client[1], method, path, code,
                                (time.perf_counter() - t0) * 1e3)


# Test hook (tests/serve/test_serve_safety.py): with GRAPHGEN_SERVE_PARSE_GATE=FILE, a request body
# containing the bytes "parse-gate" makes its parsing thread create FILE.entered and wait (at most
# 60 s) for FILE: a test holds a parse open and shows the event loop still answers /health.
_PARSE_GATE = os.environ.get("GRAPHGEN_SERVE_PARSE_GATE")


def _gate(raw: bytes) -> bytes:
    if _PARSE_GATE and b"parse-gate" in raw[:256]:
        open(_PARSE_GATE + ".entered", "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(_PARSE_GATE) and time.monotonic() < deadline:
            time.sleep(0.01)
    return raw


def _too_large(limit: int) -> ApiError:
    return ApiError(f"the request body exceeds {limit} bytes (--max-request-bytes)", status=413,
                    code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, counted as it streams in (a chunked body has no Content-Length): a 413 as soon as it
    passes ``limit`` bytes."""
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class _Choice:
    """One prompt's output: its tokens, and the text already sent (stop strings held back)."""

    def __init__(self, index: int, prompt_len: int, stops, tokenizer, fan: FanOut = FanOut(),
                 prompt=(), copy: int = 0, fmt: Optional[LogprobFormatter] = None,
                 chat: Optional[dict] = None):
        self.index, self.prompt_len, self.stops, self.tok = index, prompt_len, stops, tokenizer
        self.fan, self.prompt, self.copy, self.fmt = fan, tuple(prompt), copy, fmt or LogprobFormatter(tokenizer)
        self.lps: list = []  # per generated token: the engine's logprob entry (when asked)
        self.prompt_lps: Optional[tuple] = None  # echo with logprobs: per prompt token
        self.echo_text: Optional[str] = None  # echo: the prompt's text (decoded at the first output)
        self.new_lps: list = []  # entries of the last feed's tokens (streaming)
        self.offset = 0  # text offset of the next streamed token (completions logprobs)
        self.chat = ChatOutput(**chat) if chat else None  # tool calls / reasoning (serve/tools.py)
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.finish_reason: Optional[str] = None
        self.cached = 0
        self.error: Optional[str] = None

    def feed(self, o: RequestOutput) -> tuple[str, list[int], bool]:
        """Returns (new text, new token ids, stopped by a stop string). Detokenizes: the server calls
        it off the event loop (``asyncio.to_thread``)."""
        new = () if self.fan.drop_generated else tuple(o.new_token_ids)  # max_tokens 0 (echo)
        self.tokens.extend(new)
        self.new_lps = [] if self.fan.drop_generated else list(o.logprobs or ())
        self.lps.extend(self.new_lps)
        if o.prompt_logprobs is not None:
            self.prompt_lps = o.prompt_logprobs
        if self.fan.echo and self.echo_text is None:
            self.echo_text = self.tok.decode(list(self.prompt)) if self.tok is not None else ""
        self.cached = max(self.cached, o.num_cached_tokens)
        stopped = False
        if self.tok is not None:
            text = self.tok.decode(self.tokens, skip_special_tokens=True)  # EOS is not text (as vLLM)
            cut = find_stop(text, self.stops) if self.stops and len(self.tokens) > self.fan.min_tokens else -1
            if cut >= 0:
                text, stopped = text[:cut], True
            upto = len(text) if (stopped or o.finished) else len(text) - holdback(text, self.stops)
            self.text = text
        else:
            upto = 0
        delta = self.text[self.sent:max(self.sent, upto)]
        self.sent = max(self.sent, upto)
        if stopped:
            self.finish_reason = "stop"
        elif o.finished:
            self.finish_reason = o.finish_reason
            self.error = o.error
        return delta, list(new), stopped

    # ---- logprobs (issue 16; shapes in logprobs.py) ----
    def _echoed(self, ids, entries):
        return [*self.prompt, *ids], [*(self.prompt_lps or (None,) * len(self.prompt)), *entries]

    def full_logprobs(self, chat: bool) -> Optional[dict]:
        if self.fan.logprobs is None:
            return None
        if chat:
            return self.fmt.chat(self.lps)
        if self.fan.echo:
            return self.fmt.completion(*self._echoed(self.tokens, self.lps))
        return self.fmt.completion(self.tokens, self.lps)

    def chunk_logprobs(self, new_ids: list, first: bool, chat: bool) -> Optional[dict]:
        """The logprobs of a streamed chunk: its new tokens (and the echoed prompt in the first)."""
        if self.fan.logprobs is None:
            return None
        if chat:
            return self.fmt.chat(self.new_lps)
        ids, entries = list(new_ids), list(self.new_lps)
        if first and self.fan.echo:
            ids, entries = self._echoed(ids, entries)
        out = self.fmt.completion(ids, entries, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out


def create_app(engine: ServingEngine, *, tokenizer=None, trace: TraceRecorder = NULL,
               drain_timeout_s: float = 30.0, api_keys: Sequence[str] = (),
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tokenizer_dir=None,
               chat_setup=None, max_logprobs: int = 20, pd_factory=None) -> FastAPI:
    """``api_keys``: when given, every ``/v1/*`` request must send one (``Authorization: Bearer``).
    ``app.state.drain()`` (called by ``run_server`` on SIGTERM, from a thread) stops accepting —
    ``/health`` answers 503 from then on — and drains the engine loop while the socket still
    answers; the lifespan's shutdown is then only the rest (the trace). ``pd_factory(metrics)``: P/D (serve/pd.py)."""
    metrics = ServerMetrics(engine.model_name)
    pd = pd_factory(metrics) if pd_factory is not None else None
    loop = EngineLoop(engine, metrics, trace)
    ctx = Context(engine.model_name, engine.vocab_size, engine.max_model_len, tokenizer, max_logprobs=max_logprobs)
    ctx.tokenizer_dir = str(tokenizer_dir) if tokenizer_dir is not None and tokenizer is not None else None
    ctx.chat_setup = chat_setup  # serve/tools.py ChatSetup (tool-call / reasoning parsers), or None
    ctx.refusal = getattr(engine, "refusal", None)  # the engine's own limits (speculative decoding)
    ids = itertools.count()
    state = {"accepting": False}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(loop.start)  # returns once the gauges hold the engine's first stats
        state["accepting"] = True
        try:
            yield
        finally:
            state["accepting"] = False
            await asyncio.to_thread(loop.stop, drain_timeout_s)
            trace.close()

    app = FastAPI(title="graphgen", lifespan=lifespan)
    app.state.loop, app.state.metrics = loop, metrics
    app.add_middleware(_Gate, metrics=metrics, api_keys=list(api_keys), max_request_bytes=max_request_bytes)

    def drain() -> None:
        state["accepting"] = False
        loop.stop(drain_timeout_s)

    app.state.drain = drain

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        metrics.bad_requests.inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health():
        if loop.alive and state["accepting"]:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "created": 0,
                                            "owned_by": "graphgen", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # JSON parsing, validation and tokenization run off the event loop: /health and other
    # requests are answered while a large prompt is tokenized
    def _parse(raw: bytes, parse):  # the request, and its P/D handoff (serve/pd.py) if any
        body = parse_json(_gate(raw))
        return parse(body, ctx), Handoff.parse(body.get(KV_FIELD))

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await read_body(request, max_request_bytes)
        parsed, handoff = await asyncio.to_thread(_parse, raw, parse_completion)
        return await serve_with_role(pd, _serve, request, parsed, False, handoff)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await read_body(request, max_request_bytes)
        parsed, handoff = await asyncio.to_thread(_parse, raw, parse_chat)
        return await serve_with_role(pd, _serve, request, parsed, True, handoff)

    if pd is not None:  # POST /v1/kv/release
        pd.add_routes(app, lambda request: read_body(request, max_request_bytes))

    async def _serve(request: Request, parsed: Parsed, chat: bool):
        if not state["accepting"] or not loop.alive:
            raise ApiError("the server is shutting down", status=503, type="server_error", code="unavailable")
        aio = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        base = f"{'chatcmpl' if chat else 'cmpl'}-{os.getpid():x}{next(ids):06x}"
        fan, fmt = parsed.fan, LogprobFormatter(tokenizer)
        rids, choices, subs = [], {}, []  # n / best_of: best_of engine requests per prompt, forks of the first
        for i, p in enumerate(parsed.prompts):
            for j in range(fan.best_of):
                rid = f"{base}-{i}" if fan.best_of == 1 else f"{base}-{i}-{j}"
                rids.append(rid)
                choices[rid] = _Choice(i * fan.n + j, len(p), parsed.params.stop, tokenizer, fan, p, j, fmt,
                                       chat=parsed.chat if chat else None)
                params = parsed.params
                if j and params.seed is not None and not params.greedy:  # each copy its own draws
                    params = dataclasses.replace(params, seed=(params.seed + j) % (1 << 63))
                # copies after the first fork it: they share its prompt's KV blocks (one prefill)
                subs.append((rid, p, params, subs[-j][0] if j else None))

        def on_output(o: RequestOutput):
            aio.call_soon_threadsafe(q.put_nowait, o)

        for rid, p, params, parent in subs:
            loop.submit(rid, p, params, on_output, fork_of=parent)
        created = int(time.time())
        if parsed.stream:
            resp = StreamingResponse(_stream(q, base, rids, choices, parsed, chat, created),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            resp.choices = choices  # read by P/D's count once the stream ended
            return resp
        return await _collect(request, q, base, rids, choices, parsed, chat, created)

    def _usage(choices) -> dict:
        cs = list(choices.values())
        firsts = [c for c in cs if c.copy == 0]  # n / best_of copies share their prompt: counted once
        return usage(sum(c.prompt_len for c in firsts), sum(len(c.tokens) for c in cs), sum(c.cached for c in firsts))

    async def _take(o: RequestOutput, choices, open_ids: set):
        """Feed one output; returns (choice, delta, new ids, finished now) or None if stale."""
        if o.req_id not in open_ids:
            return None  # e.g. the abort that follows a stop-string cut
        c = choices[o.req_id]
        if tokenizer is not None:  # detokenization off the event loop
            delta, new_ids, stopped = await asyncio.to_thread(c.feed, o)
        else:
            delta, new_ids, stopped = c.feed(o)
        if stopped:
            loop.abort(o.req_id, forks=False)  # this choice only: its forks go on
        done = stopped or o.finished
        if done:
            open_ids.discard(o.req_id)
        return c, delta, new_ids, done

    async def _collect(request, q, base, rids, choices, parsed, chat, created):
        open_ids = set(rids)
        try:
            while open_ids:
                try:
                    o = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                await _take(o, choices, open_ids)
        finally:
            for rid in open_ids:  # client gone (or cancelled): free the engine's work
                loop.abort(rid)
        errs = [c for c in choices.values() if c.finish_reason in ("error", "abort")]
        if errs:
            e = errs[0]
            raise ApiError(f"the request could not be completed: {e.error or e.finish_reason}", status=503,
                           type="server_error", code=e.finish_reason)
        out = []
        fan = parsed.fan
        kept = list(choices.values())
        if fan.best_of > fan.n:  # per prompt, the n copies with the highest cumulative logprob
            kept = []
            for i in range(len(parsed.prompts)):
                group = [choices[rid] for rid in rids[i * fan.best_of:(i + 1) * fan.best_of]]
                group.sort(key=lambda c: -cumulative(c.lps))
                for rank, c in enumerate(group[:fan.n]):
                    c.index = i * fan.n + rank
                    kept.append(c)
        for c in sorted(kept, key=lambda c: c.index):
            lp = await asyncio.to_thread(c.full_logprobs, chat) if fan.logprobs is not None else None
            if chat and c.chat is not None:  # reasoning / tool calls parsed out of the text
                msg, called = c.chat.message(c.text)
                out.append({"index": c.index, "message": msg, "logprobs": lp, "token_ids": c.tokens,
                            "finish_reason": "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason})
            elif chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                            "finish_reason": c.finish_reason, "logprobs": lp, "token_ids": c.tokens})
            else:
                text = (c.echo_text or "") + c.text if fan.echo else c.text
                out.append({"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": lp,
                            "token_ids": c.tokens})
        return {"id": base, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": parsed.model, "choices": out, "usage": _usage(choices)}

    async def _stream(q, base, rids, choices, parsed, chat, created):
        open_ids = set(rids)
        obj = "chat.completion.chunk" if chat else "text_completion"
        first = set(rids)
        failed = False
        try:
            while open_ids:
                got = await _take(await q.get(), choices, open_ids)
                if got is None:
                    continue
                c, delta, new_ids, done = got
                if c.finish_reason in ("error", "abort") and c.error:
                    # cut (engine error, drain timeout): the error event is the stream's last, then [DONE]
                    failed = True
                    yield sse({"error": {"message": f"the request could not be completed: {c.error}",
                                         "type": "server_error", "param": None, "code": c.finish_reason}})
                    continue
                is_first = rids[c.index] in first
                if not (delta or new_ids or done or (is_first and c.fan.echo)):
                    continue
                first.discard(rids[c.index])
                lp = None
                if c.fan.logprobs is not None:
                    lp = await asyncio.to_thread(c.chunk_logprobs, new_ids, is_first, chat)
                finish = c.finish_reason if done else None
                if chat:
                    if c.chat is not None:  # reasoning / tool-call deltas (serve/tools.py)
                        d = await asyncio.to_thread(c.chat.delta, c.text[:c.sent], done)
                        if done and c.chat.calls_sent and finish == "stop":
                            finish = "tool_calls"
                    else:
                        d = {"content": delta}
                    if is_first:
                        d["role"] = "assistant"
                    ch = {"index": c.index, "delta": d, "finish_reason": finish,
                          "logprobs": lp, "token_ids": new_ids}
                else:
                    if is_first and c.fan.echo:
                        delta = (c.echo_text or "") + delta
                    ch = {"index": c.index, "text": delta, "finish_reason": c.finish_reason if done else None,
                          "logprobs": lp, "token_ids": new_ids}
                yield sse({"id": base, "object": obj, "created": created, "model": parsed.model, "choices": [ch]})
            if parsed.include_usage and not failed:
                yield sse({"id": base, "object": obj, "created": created, "model": parsed.model, "choices": [],
                           "usage": _usage(choices)})
            yield SSE_DONE
        finally:
            for rid in open_ids:  # the client went away mid-stream: abort (frees its blocks)
                loop.abort(rid)

    return app
