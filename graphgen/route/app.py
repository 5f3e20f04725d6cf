"""The P/D router: an OpenAI-compatible front over prefill and decode instances (docs/pd.md).

Per request (completions or chat): a prefill instance chosen by the policy gets the body with
``max_tokens: 1`` and ``stream: false``; its ``kv_transfer_params`` go into the body a decode
instance gets, whose answer (streamed or not) is passed through untouched. Once D answered (its
first bytes: D's prefill has loaded the blocks), the router releases the lease on P
(``POST /v1/kv/release``). A prefill that cannot be reached, times out or fails with a 5xx costs
a recompute, not the request: the body goes to D as it came (counted). A P's 4xx is the client's
error and is returned as is, but a backend's 401/403 refuses the router's own ``backend_api_key``:
a 502 naming the flag (never the key). No decode instance up: a 503 at once. Health: ``GET /health`` of
every backend each ``health_interval_s``: a refused check marks it down at once, a timed-out one
only after three in a row (a loaded host's busy backend is not gone); a backend that fails a request
is marked down until its next good check. A decode instance that fails before the client got anything (a 503:
its engine ended, a rank lost; a stream whose first event is an error, or that breaks before it) while another
is up: the request goes to the next one, with the same handoff (counted). Without prefill instances it only
balances the decode ones (each serving as ``both``): a data-parallel front.

``create_router`` builds one `RouterState` and an app whose routes are the module-level handlers
below, each reading that state from ``request.app.state.router``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..balance import Backend, Pool, prefix_key
from ..netutil import bearer_authorized, is_api_path

log = logging.getLogger("graphgen.route")
KV_FIELD = "kv_transfer_params"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _error(status: int, message: str, code: str, type_: str = "server_error", param=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


AUTH_REFUSED = (401, 403)


def _key_refused(kind: str, url: str) -> JSONResponse:
    """A backend refused the router's own credentials: the router is misconfigured, not the client
    (whose key the router already checked) — a 502 that names the flag, never the key."""
    return _error(502, f"the {kind} instance {url} refused the router's credentials: check "
                       "--backend-api-key (or $GRAPHGEN_BACKEND_API_KEY)", "backend_auth_failed")


class _Metrics:
    def __init__(self, prefill: Pool, decode: Pool):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("graphgen_route_requests", "Requests routed, by outcome.", ["outcome"], registry=r)
        self.prefill_fallbacks = Counter("graphgen_route_prefill_fallbacks",
                                         "Requests sent to decode without a handoff (prefill failed).", registry=r)
        self.backend_errors = Counter("graphgen_route_backend_errors", "Requests a backend could not take.",
                                      ["kind"], registry=r)
        self.releases = Counter("graphgen_route_lease_releases", "Leases released on P after D answered.",
                                ["result"], registry=r)
        self.prefill_s = Histogram("graphgen_route_prefill_seconds", "Prefill round trip.", buckets=_BUCKETS,
                                   registry=r)
        self.first_byte_s = Histogram("graphgen_route_time_to_first_byte_seconds",
                                      "Request arrival to decode's first body bytes.", buckets=_BUCKETS, registry=r)
        self.pools = {"prefill": prefill, "decode": decode}
        r.register(self)

    def collect(self):
        up = GaugeMetricFamily("graphgen_route_backends_healthy", "Backends whose last health check passed.",
                               labels=["kind"])
        inflight = GaugeMetricFamily("graphgen_route_backend_inflight", "Requests in flight per backend.",
                                     labels=["kind", "url"])
        for kind, pool in self.pools.items():
            up.add_metric([kind], sum(b.healthy for b in pool.backends))
            for b in pool.backends:
                inflight.add_metric([kind, b.url], b.inflight)
        yield up
        yield inflight


def prefill_body(body: dict) -> dict:
    """What P gets: one token, no stream (vLLM's proxy contract); ``min_tokens`` could force more."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", KV_FIELD)}
    out["max_tokens"], out["stream"] = 1, False
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def one_handoff(body: dict) -> bool:
    """Whether P can hand this request off: one prompt (a handoff covers one prompt's blocks; ``n`` /
    ``best_of`` copies are D's forks of it). A list of prompts goes straight to D, served as ``both``."""
    p = body.get("prompt")
    return "messages" in body or isinstance(p, str) or (isinstance(p, list) and all(
        isinstance(t, int) for t in p))


@dataclass
class RouterState:
    prefill: Pool
    decode: Pool
    metrics: _Metrics
    keys: list  # the API keys clients must send (bytes), or none
    headers: dict  # what the router sends its backends (their API key)
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0  # one check's limit (a timed-out check is "slow", Backend.checked)
    prefill_timeout_s: float = 120.0
    decode_timeout_s: float = 600.0
    http: Any = None  # the aiohttp session (opened by the lifespan)
    tasks: set = field(default_factory=set)  # the lease releases in flight (an unreferenced task may be collected)


def _st(request: Request) -> RouterState:
    return request.app.state.router


async def _check(st: RouterState, b: Backend) -> None:
    try:
        async with st.http.get(b.url + "/health", timeout=aiohttp.ClientTimeout(total=st.health_timeout_s)) as r:
            b.checked(r.status == 200)
    except asyncio.TimeoutError:  # slow, not gone: down only after a few in a row (Backend.checked)
        b.checked(None)
    except (aiohttp.ClientError, OSError):
        b.checked(False)


async def _check_all(st: RouterState) -> None:
    await asyncio.gather(*(_check(st, b) for b in st.prefill.backends + st.decode.backends))


async def _health_loop(st: RouterState) -> None:
    while True:
        await asyncio.sleep(st.health_interval_s)
        await _check_all(st)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    st: RouterState = app.state.router
    st.http = aiohttp.ClientSession(headers=st.headers, timeout=aiohttp.ClientTimeout(total=None))
    await _check_all(st)  # before the first request: who is up
    task = asyncio.create_task(_health_loop(st))
    try:
        yield
    finally:
        task.cancel()
        await st.http.close()


async def auth(request: Request, call_next):
    keys = _st(request).keys
    if keys and is_api_path(request.url.path):
        if not bearer_authorized(request.headers.get("authorization", "").encode(), keys):
            return _error(401, "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                          "invalid_api_key", "invalid_request_error")
    return await call_next(request)


async def health(request: Request):
    st = _st(request)
    up = bool(st.decode.healthy())
    return JSONResponse({"status": "ok" if up else "unavailable", "prefill": len(st.prefill.healthy()),
                         "decode": len(st.decode.healthy())}, status_code=200 if up else 503)


async def prom(request: Request):
    return Response(generate_latest(_st(request).metrics.registry), media_type=CONTENT_TYPE)


async def models(request: Request):
    st = _st(request)
    for b in st.decode.healthy() + st.prefill.healthy():
        try:
            async with st.http.get(b.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status in AUTH_REFUSED:
                    return _key_refused("prefill" if b in st.prefill.backends else "decode", b.url)
                return JSONResponse(await r.json(), status_code=r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            b.healthy = False
    return _error(503, "no backend is up", "unavailable")


async def completions(request: Request):
    return await route(_st(request), request, "/v1/completions")


async def chat(request: Request):
    return await route(_st(request), request, "/v1/chat/completions")


async def run_prefill(st: RouterState, path: str, body: dict) -> tuple[Optional[dict], Optional[Response], Optional[Backend]]:
    """(kv_transfer_params, None, P) on success, (None, P's 4xx answer, P) for a bad request,
    (None, None, None) when no prefill could be done: one P is tried, a failed prefill costs D's
    recompute, not a second prefill."""
    p = st.prefill.pick(prefix_key(body))
    if p is None:
        return None, None, None
    t0 = time.perf_counter()
    p.begin()
    try:
        async with st.http.post(p.url + path, json=prefill_body(body),
                                timeout=aiohttp.ClientTimeout(total=st.prefill_timeout_s)) as r:
            data = await r.read()
            if r.status in AUTH_REFUSED:
                st.metrics.backend_errors.labels(kind="prefill_auth").inc()
                return None, _key_refused("prefill", p.url), p
            if 400 <= r.status < 500:
                return None, Response(data, status_code=r.status, media_type="application/json"), p
            if r.status == 200:
                st.metrics.prefill_s.observe(time.perf_counter() - t0)
                return json.loads(data).get(KV_FIELD), None, p
            st.metrics.backend_errors.labels(kind=f"prefill_{r.status}").inc()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
        log.warning("prefill %s failed: %r", p.url, e)
        p.healthy = False
        p.failures += 1
        st.metrics.backend_errors.labels(kind="prefill_unreachable").inc()
    finally:
        p.end()
    return None, None, None


async def _release(st: RouterState, p: Backend, params: dict) -> None:
    try:
        async with st.http.post(p.url + "/v1/kv/release", json={"lease_id": params.get("lease_id")},
                                timeout=aiohttp.ClientTimeout(total=10)) as r:
            await r.read()
            if r.status != 200:
                raise aiohttp.ClientError(f"HTTP {r.status}")
        st.metrics.releases.labels(result="ok").inc()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:  # the lease expires on its own
        log.warning("lease release on %s failed (it expires at its timeout): %r", p.url, e)
        st.metrics.releases.labels(result="failed").inc()


def release_later(st: RouterState, p: Backend, params: dict) -> None:
    t = asyncio.create_task(_release(st, p, params))
    st.tasks.add(t)
    t.add_done_callback(st.tasks.discard)


def _body(raw: bytes):
    """The request body as a JSON object, or the router's own 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        return None, _error(400, f"the request body is not valid JSON: {e}"[:300], "invalid_json", "invalid_request_error")
    if not isinstance(body, dict):
        return None, _error(400, "the request body must be a JSON object", "invalid_json", "invalid_request_error")
    return body, None


async def route(st: RouterState, request: Request, path: str):
    t0 = time.perf_counter()
    body, bad = _body(await request.body())
    if bad is not None:
        return bad
    if not st.decode.healthy():
        st.metrics.requests.labels(outcome="no_decode").inc()
        return _error(503, "no decode instance is up", "unavailable")
    direct = not one_handoff(body)
    params, answer, p = (None, None, None) if direct else await run_prefill(st, path, body)
    if answer is not None:
        st.metrics.requests.labels(outcome="bad_request" if answer.status_code < 500 else "backend_auth").inc()
        return answer
    if params is None and st.prefill.backends and not direct:  # no --prefill: D serves as `both`
        st.metrics.prefill_fallbacks.inc()
    dbody = {k: v for k, v in body.items() if k != KV_FIELD}  # only P's handoff reaches D
    if params:
        dbody[KV_FIELD] = params
    # P's lease is released once D's first body bytes came (its prefill ran, so the blocks are
    # loaded), not at its headers: a streaming D sends those before its prefill
    done = (lambda: release_later(st, p, params)) if params and p is not None else (lambda: None)
    return await _to_decode(st, path, body, dbody, done, t0)


async def _to_decode(st: RouterState, path: str, body: dict, dbody: dict, done, t0: float):
    """D's answer, passed through (the next D while none has answered, or one failed before sending anything);
    ``done()`` once D's first bytes came (or every D failed)."""
    tried: list[Backend] = []
    while (d := st.decode.pick(prefix_key(body), tried)) is not None:
        tried.append(d)
        d.begin()
        try:
            r = await st.http.post(d.url + path, json=dbody, timeout=aiohttp.ClientTimeout(total=st.decode_timeout_s))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            d.end()
            log.warning("decode %s failed: %r", d.url, e)
            d.healthy = False
            d.failures += 1
            st.metrics.backend_errors.labels(kind="decode_unreachable").inc()
            continue  # nothing was sent to the client yet: the next D
        if r.status in AUTH_REFUSED:
            r.release()
            d.end()
            done()
            st.metrics.backend_errors.labels(kind="decode_auth").inc()
            st.metrics.requests.labels(outcome="backend_auth").inc()
            return _key_refused("decode", d.url)
        ctype = r.headers.get("content-type", "application/json")
        if ctype.startswith("text/event-stream"):
            head, broken = await _first_event(r)  # D's first event (after its prefill), before the client sees any
            if (broken or _is_error_event(head)) and st.decode.healthy(tried):
                r.close()
                d.end()
                _decode_failed(st, d, "before its first event")
                continue
            st.metrics.requests.labels(outcome="ok" if r.status == 200 else f"decode_{r.status}").inc()
            return StreamingResponse(_relay(st, r, d, done, t0, head, broken), status_code=r.status,
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            data: Optional[bytes] = await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            data = None  # D died while answering
        finally:
            r.release()
            d.end()
        if (data is None or r.status == D_UNAVAILABLE) and st.decode.healthy(tried):
            _decode_failed(st, d, f"with {r.status}" if data is not None else "while answering")
            continue
        done()
        st.metrics.requests.labels(outcome="ok" if r.status == 200 else f"decode_{r.status}").inc()
        if data is None:
            return _error(502, f"the decode instance {d.url} failed while answering", "backend_failed")
        st.metrics.first_byte_s.observe(time.perf_counter() - t0)
        return Response(data, status_code=r.status, media_type=ctype)
    done()
    st.metrics.requests.labels(outcome="no_decode").inc()
    return _error(503, "no decode instance is up", "unavailable")


# A D answers 503 when it cannot serve the request at all (its engine ended: a rank lost; or it drains): nothing
# of the answer was produced, so another D serves it (by its own lookup of the handoff, or a recompute)
D_UNAVAILABLE = 503


def _decode_failed(st: RouterState, d: Backend, how: str) -> None:
    """D failed before the client got anything and another D is up: counted; the request goes to the next D.
    D is not marked down here (a D that lost its engine exits, and its health check says so)."""
    log.warning("decode %s failed %s: the request goes to another decode instance", d.url, how)
    d.failures += 1
    st.metrics.backend_errors.labels(kind="decode_failed").inc()


async def _first_event(r) -> tuple[bytes, bool]:
    """The bytes of D's stream up to the end of its first SSE event, and whether the stream ended or failed
    before that event was whole."""
    buf = b""
    try:
        while b"\n\n" not in buf:
            chunk = await r.content.readany()
            if not chunk:
                return buf, True
            buf += chunk
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return buf, True
    return buf, False


def _is_error_event(head: bytes) -> bool:
    """Is D's first SSE event an error (its engine ended before the first token)?"""
    line = head.split(b"\n\n", 1)[0]
    if not line.startswith(b"data: "):
        return False
    try:
        event = json.loads(line[6:])
    except ValueError:
        return False
    return isinstance(event, dict) and "error" in event


async def _relay(st: RouterState, r, d: Backend, first, t0: float, head: bytes = b"", broken: bool = False):
    """D's stream to the client: ``head`` (what `_first_event` read) first; ``broken``: D's stream ended or
    failed within it (the client gets the error event)."""
    try:
        if head:
            st.metrics.first_byte_s.observe(time.perf_counter() - t0)
            release, first = first, None
            release()
            yield head
        if broken:
            raise aiohttp.ClientPayloadError("the stream ended before its first event")
        async for chunk in r.content.iter_any():
            if first is not None:
                st.metrics.first_byte_s.observe(time.perf_counter() - t0)
                release, first = first, None
                release()
            yield chunk
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # D died mid-stream: say so, end the stream
        st.metrics.backend_errors.labels(kind="decode_stream").inc()
        yield ("data: " + json.dumps({"error": {"message": f"the decode instance failed: {e!r}",
                                                "type": "server_error", "param": None,
                                                "code": "backend_failed"}}) + "\n\ndata: [DONE]\n\n").encode()
    finally:
        r.close()  # a client that went away: D sees the disconnect and aborts
        d.end()
        if first is not None:  # D failed before its first bytes: the lease goes anyway
            first()


def create_router(prefill_urls: Sequence[str], decode_urls: Sequence[str], *, policy: str = "round_robin",
                  api_keys: Sequence[str] = (), backend_api_key: Optional[str] = None,
                  health_interval_s: float = 1.0, prefill_timeout_s: float = 120.0,
                  decode_timeout_s: float = 600.0) -> FastAPI:
    prefill, decode = Pool(prefill_urls, policy), Pool(decode_urls, policy)
    st = RouterState(prefill, decode, _Metrics(prefill, decode), [k.encode() for k in api_keys],
                     {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {},
                     health_interval_s, prefill_timeout_s, decode_timeout_s)
    app = FastAPI(title="graphgen route", lifespan=_lifespan)
    app.state.router, app.state.prefill, app.state.decode, app.state.metrics = st, prefill, decode, st.metrics
    app.middleware("http")(auth)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", prom, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    return app
