"""What runs before a route: the ASGI gate (API key, body-size limit, access log, HTTP counts),
the streamed body read with its limit, and the parse gate test hook."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Sequence

from fastapi import Request

from ..netutil import bearer_authorized, is_api_path
from .errors import ApiError
from .metrics import ServerMetrics

__all__ = ["Gate", "read_body", "parse_gate", "ROUTES", "DEFAULT_MAX_REQUEST_BYTES"]

access_log = logging.getLogger("graphgen.serve.access")
DEFAULT_MAX_REQUEST_BYTES = 8 << 20
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/kv/release")


def _json_response(status: int, body: dict, headers: Sequence[tuple[bytes, bytes]] = ()):
    """(start, body) ASGI messages of a JSON answer sent by the middleware itself."""
    data = json.dumps(body).encode()
    return ({"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                         *headers]},
            {"type": "http.response.body", "body": data})


class Gate:
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


def parse_gate(raw: bytes) -> bytes:
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
