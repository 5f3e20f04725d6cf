"""The P/D router: an OpenAI-compatible front over prefill and decode instances (docs/pd.md).

Per request (completions or chat): a prefill instance chosen by the policy gets the body with
``max_tokens: 1`` and ``stream: false``; its ``kv_transfer_params`` go into the body a decode
instance gets, whose answer (streamed or not) is passed through untouched. Once D answered (its
first bytes: D's prefill has loaded the blocks), the router releases the lease on P
(``POST /v1/kv/release``). A prefill that cannot be reached, times out or fails with a 5xx costs
a recompute, not the request: the body goes to D as it came (counted). A P's 4xx is the client's
error and is returned as is, but a backend's 401/403 refuses the router's own ``backend_api_key``:
a 502 naming the flag (never the key). No decode instance up: a 503 at once. Health: ``GET /health`` of
every backend each ``health_interval_s``; a backend that fails a request is marked down until its
next good check. Without prefill instances it only balances the decode ones (each serving as
``both``): a data-parallel front.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Optional, Sequence

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


def create_router(prefill_urls: Sequence[str], decode_urls: Sequence[str], *, policy: str = "round_robin",
                  api_keys: Sequence[str] = (), backend_api_key: Optional[str] = None,
                  health_interval_s: float = 1.0, prefill_timeout_s: float = 120.0,
                  decode_timeout_s: float = 600.0) -> FastAPI:
    prefill, decode = Pool(prefill_urls, policy), Pool(decode_urls, policy)
    metrics = _Metrics(prefill, decode)
    keys = [k.encode() for k in api_keys]
    headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
    state: dict = {}

    async def check(b: Backend) -> None:
        try:
            async with state["http"].get(b.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                b.healthy = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            b.healthy = False

    async def check_all() -> None:
        await asyncio.gather(*(check(b) for b in prefill.backends + decode.backends))

    async def health_loop() -> None:
        while True:
            await asyncio.sleep(health_interval_s)
            await check_all()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["http"] = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None))
        await check_all()  # before the first request: who is up
        task = asyncio.create_task(health_loop())
        try:
            yield
        finally:
            task.cancel()
            await state["http"].close()

    app = FastAPI(title="graphgen route", lifespan=lifespan)
    app.state.prefill, app.state.decode, app.state.metrics = prefill, decode, metrics

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if keys and is_api_path(request.url.path):
            if not bearer_authorized(request.headers.get("authorization", "").encode(), keys):
                return _error(401, "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                              "invalid_api_key", "invalid_request_error")
        return await call_next(request)

    @app.get("/health")
    async def health():
        up = bool(decode.healthy())
        return JSONResponse({"status": "ok" if up else "unavailable", "prefill": len(prefill.healthy()),
                             "decode": len(decode.healthy())}, status_code=200 if up else 503)

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        for b in decode.healthy() + prefill.healthy():
            try:
                async with state["http"].get(b.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status in AUTH_REFUSED:
                        return _key_refused("prefill" if b in prefill.backends else "decode", b.url)
                    return JSONResponse(await r.json(), status_code=r.status)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                b.healthy = False
        return _error(503, "no backend is up", "unavailable")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route(request, "/v1/chat/completions")

    async def run_prefill(path: str, body: dict) -> tuple[Optional[dict], Optional[Response], Optional[Backend]]:
        """(kv_transfer_params, None, P) on success, (None, P's 4xx answer, P) for a bad request,
        (None, None, None) when no prefill could be done: one P is tried, a failed prefill costs D's
        recompute, not a second prefill."""
        p = prefill.pick(prefix_key(body))
        if p is not None:
            t0 = time.perf_counter()
            p.begin()
            try:
                async with state["http"].post(p.url + path, json=prefill_body(body),
                                              timeout=aiohttp.ClientTimeout(total=prefill_timeout_s)) as r:
                    data = await r.read()
                    if r.status in AUTH_REFUSED:
                        metrics.backend_errors.labels(kind="prefill_auth").inc()
                        return None, _key_refused("prefill", p.url), p
                    if 400 <= r.status < 500:
                        return None, Response(data, status_code=r.status, media_type="application/json"), p
                    if r.status == 200:
                        metrics.prefill_s.observe(time.perf_counter() - t0)
                        return json.loads(data).get(KV_FIELD), None, p
                    metrics.backend_errors.labels(kind=f"prefill_{r.status}").inc()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                log.warning("prefill %s failed: %r", p.url, e)
                p.healthy = False
                p.failures += 1
                metrics.backend_errors.labels(kind="prefill_unreachable").inc()
            finally:
                p.end()
        return None, None, None

    async def release(p: Backend, params: dict) -> None:
        try:
            async with state["http"].post(p.url + "/v1/kv/release", json={"lease_id": params.get("lease_id")},
                                          timeout=aiohttp.ClientTimeout(total=10)) as r:
                await r.read()
                if r.status != 200:
                    raise aiohttp.ClientError(f"HTTP {r.status}")
            metrics.releases.labels(result="ok").inc()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:  # the lease expires on its own
            log.warning("lease release on %s failed (it expires at its timeout): %r", p.url, e)
            metrics.releases.labels(result="failed").inc()

    tasks: set = set()  # the releases in flight (a task nobody references may be collected)

    def release_later(p: Backend, params: dict) -> None:
        t = asyncio.create_task(release(p, params))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def route(request: Request, path: str):
        t0 = time.perf_counter()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"the request body is not valid JSON: {e}"[:300], "invalid_json", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "invalid_json", "invalid_request_error")
        if not decode.healthy():
            metrics.requests.labels(outcome="no_decode").inc()
            return _error(503, "no decode instance is up", "unavailable")
        direct = not one_handoff(body)
        params, answer, p = (None, None, None) if direct else await run_prefill(path, body)
        if answer is not None:
            metrics.requests.labels(outcome="bad_request" if answer.status_code < 500 else "backend_auth").inc()
            return answer
        if params is None and prefill.backends and not direct:  # no --prefill: D serves as `both`
            metrics.prefill_fallbacks.inc()
        dbody = {k: v for k, v in body.items() if k != KV_FIELD}  # only P's handoff reaches D
        if params:
            dbody[KV_FIELD] = params
        tried: list[Backend] = []
        while (d := decode.pick(prefix_key(body), tried)) is not None:
            tried.append(d)
            d.begin()
            try:
                r = await state["http"].post(d.url + path, json=dbody,
                                             timeout=aiohttp.ClientTimeout(total=decode_timeout_s))
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                d.end()
                log.warning("decode %s failed: %r", d.url, e)
                d.healthy = False
                d.failures += 1
                metrics.backend_errors.labels(kind="decode_unreachable").inc()
                continue  # nothing was sent to the client yet: the next D
            # P's lease is released once D's first body bytes came (its prefill ran, so the blocks are
            # loaded), not at its headers: a streaming D sends those before its prefill
            done = (lambda: release_later(p, params)) if params and p is not None else (lambda: None)
            if r.status in AUTH_REFUSED:
                r.release()
                d.end()
                done()
                metrics.backend_errors.labels(kind="decode_auth").inc()
                metrics.requests.labels(outcome="backend_auth").inc()
                return _key_refused("decode", d.url)
            metrics.requests.labels(outcome="ok" if r.status == 200 else f"decode_{r.status}").inc()
            ctype = r.headers.get("content-type", "application/json")
            if not ctype.startswith("text/event-stream"):
                try:
                    data = await r.read()
                finally:
                    r.release()
                    d.end()
                    done()
                metrics.first_byte_s.observe(time.perf_counter() - t0)
                return Response(data, status_code=r.status, media_type=ctype)
            return StreamingResponse(_relay(r, d, done, t0), status_code=r.status, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        if params and p is not None:
            release_later(p, params)
        metrics.requests.labels(outcome="no_decode").inc()
        return _error(503, "no decode instance is up", "unavailable")

    async def _relay(r, d: Backend, first, t0: float):
        try:
            async for chunk in r.content.iter_any():
                if first is not None:
                    metrics.first_byte_s.observe(time.perf_counter() - t0)
                    release, first = first, None
                    release()
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # D died mid-stream: say so, end the stream
            metrics.backend_errors.labels(kind="decode_stream").inc()
            yield ("data: " + json.dumps({"error": {"message": f"the decode instance failed: {e!r}",
                                                    "type": "server_error", "param": None,
                                                    "code": "backend_failed"}}) + "\n\ndata: [DONE]\n\n").encode()
        finally:
            r.close()  # a client that went away: D sees the disconnect and aborts
            d.end()
            if first is not None:  # D failed before its first bytes: the lease goes anyway
                first()

    return app
