"""The FastAPI app: OpenAI-compatible routes over an :class:`EngineLoop`.

``create_app(engine, tokenizer=...)`` builds one `AppState` (serve/state.py) and an app whose routes
are the module-level handlers below, each reading that state from ``request.app.state.serving``.
Its lifespan starts the engine loop (and the grammar worker) and, on shutdown (uvicorn's answer to
SIGTERM, after it stopped accepting and let open requests finish), stops it: running requests get
``drain_timeout_s`` to finish, the rest are aborted, pending saves are committed, the trace is
written. The request flow itself is serve/respond.py; P/D's part serve/pd.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..trace import NULL, TraceRecorder
from .engine_api import ServingEngine
from .errors import ApiError
from .gate import DEFAULT_MAX_REQUEST_BYTES, Gate, parse_gate, read_body
from .grammar_worker import GrammarWorker
from .loop import EngineLoop
from .metrics import CONTENT_TYPE, ServerMetrics
from .pd import FIELD as KV_FIELD, PD, Handoff, serve_with_role
from .chat_request import parse_chat
from .protocol import Context, parse_completion, parse_json
from .respond import serve
from .state import AppState

__all__ = ["create_app", "AppState"]


def _st(request: Request) -> AppState:
    return request.app.state.serving


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    st: AppState = app.state.serving
    st.grammars.start()  # the grammar library loads on its own thread meanwhile
    await asyncio.to_thread(st.loop.start)  # returns once the gauges hold the engine's first stats
    st.accepting = True
    try:
        yield
    finally:
        st.accepting = False
        await asyncio.to_thread(st.loop.stop, st.drain_timeout_s)
        st.grammars.stop()
        st.trace.close()


async def api_error(request: Request, e: ApiError):
    _st(request).metrics.bad_requests.inc()
    return JSONResponse(e.body(), status_code=e.status)


async def health(request: Request):
    st = _st(request)
    if st.loop.alive and st.accepting:
        return {"status": "ok"}
    return JSONResponse({"status": "unavailable"}, status_code=503)


async def models(request: Request):
    st = _st(request)
    e = st.engine
    base = {"id": e.model_name, "object": "model", "created": 0, "owned_by": "graphgen", "root": e.model_name,
            "parent": None, "max_model_len": e.max_model_len}
    # each LoRA adapter is a model of its own, its parent the base (vLLM's /v1/models)
    loras = [dict(base, id=name, root=path, parent=e.model_name) for name, path in st.ctx.lora_paths.items()]
    return {"object": "list", "data": [base, *loras]}


async def prom(request: Request):
    return Response(_st(request).metrics.render(), media_type=CONTENT_TYPE)


def _parse(raw: bytes, parse, ctx: Context):
    """The request and its P/D handoff (serve/pd.py), if any: JSON parsing, validation and
    tokenization, run off the event loop (/health and other requests are answered meanwhile)."""
    body = parse_json(parse_gate(raw))
    return parse(body, ctx), Handoff.parse(body.get(KV_FIELD))


async def _route(request: Request, parse, chat: bool):
    st = _st(request)
    raw = await read_body(request, st.max_request_bytes)
    parsed, handoff = await asyncio.to_thread(_parse, raw, parse, st.ctx)
    return await serve_with_role(st.pd, lambda *a: serve(st, *a), request, parsed, chat, handoff)


async def completions(request: Request):
    return await _route(request, parse_completion, False)


async def chat_completions(request: Request):
    return await _route(request, parse_chat, True)


async def kv_release(request: Request):
    """``POST /v1/kv/release {"lease_id"}``: ends a P/D lease early (D has loaded the blocks)."""
    st = _st(request)
    lease_id = parse_json(await read_body(request, st.max_request_bytes)).get("lease_id")
    if not isinstance(lease_id, str) or not lease_id:
        raise ApiError("'lease_id' must be a non-empty string", param="lease_id", code="invalid_type")
    return {"lease_id": lease_id, "released": st.pd.release(lease_id)}


def create_app(engine: ServingEngine, *, tokenizer=None, trace: TraceRecorder = NULL,
               drain_timeout_s: float = 30.0, api_keys: Sequence[str] = (),
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tokenizer_dir=None,
               chat_setup=None, max_logprobs: int = 20, role: str = "both",
               kv_lease_timeout_s: float = 30.0) -> FastAPI:
    """``api_keys``: when given, every ``/v1/*`` request must send one (``Authorization: Bearer``).
    ``app.state.drain()`` (called by ``run_server`` on SIGTERM, from a thread) stops accepting —
    ``/health`` answers 503 from then on — and drains the engine loop while the socket still
    answers; the lifespan's shutdown is then only the rest (the trace). ``role``: P/D (serve/pd.py),
    through the engine's P/D methods (none for ranks on the host pool or DP groups)."""
    metrics = ServerMetrics(engine.model_name)
    ctx = Context(engine.model_name, engine.vocab_size, engine.max_model_len, tokenizer, max_logprobs=max_logprobs)
    ctx.tokenizer_dir = str(tokenizer_dir) if tokenizer_dir is not None and tokenizer is not None else None
    ctx.chat_setup = chat_setup  # serve/tools.py ChatSetup (tool-call / reasoning parsers), or None
    ctx.refusal = getattr(engine, "refusal", None)  # the engine's own limits (speculative decoding)
    ctx.lora_paths = dict(getattr(engine, "lora_paths", {}) or {})  # served adapter name -> its folder
    ctx.lora_names = tuple(ctx.lora_paths)
    st = AppState(engine=engine, loop=EngineLoop(engine, metrics, trace), metrics=metrics, ctx=ctx,
                  grammars=GrammarWorker(ctx.tokenizer_dir, engine.vocab_size), tokenizer=tokenizer, trace=trace,
                  drain_timeout_s=drain_timeout_s, max_request_bytes=max_request_bytes,
                  pd=PD.for_engine(engine, role, metrics.registry, kv_lease_timeout_s))
    app = FastAPI(title="graphgen", lifespan=_lifespan)
    app.state.serving, app.state.loop, app.state.metrics, app.state.drain = st, st.loop, metrics, st.drain
    app.add_middleware(Gate, metrics=metrics, api_keys=list(api_keys), max_request_bytes=max_request_bytes)
    app.add_exception_handler(ApiError, api_error)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/metrics", prom, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    if st.pd is not None:
        app.add_api_route("/v1/kv/release", kv_release, methods=["POST"])
    return app
