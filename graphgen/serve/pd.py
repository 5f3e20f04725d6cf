"""Prefill/decode disaggregation over the shared pool: a server's role and the KV handoff (docs/pd.md).

* ``prefill``: a request runs as ``max_tokens: 1`` (its sampled token is dropped: D recomputes the
  last position), with the prompt's handed-off blocks (every full block but one holding the last
  token) leased in the pool *before* the request is submitted; the answer waits until every one of
  them is visible in the pool (the commit-visible rule: a block is visible only once its save's
  event was recorded and its put returned) and carries ``kv_transfer_params`` — the blocks' hash
  chain, the cache layout fingerprint and the lease. ``POST /v1/kv/release`` ends a lease early.
  ``n`` / ``best_of`` > 1: the prompt is prefilled once, the answer has ``n`` empty choices and one
  handoff; D serves the copies as forks of the first (sharing its blocks), as any server does.
* ``decode``: a request with ``kv_transfer_params`` is checked against this server's own hashing
  of the prompt and its layout; a match is admitted by the engine's ordinary pool lookup (a
  leading run, each value checksummed by the pool: a corrupt one is a miss), a mismatch is counted
  and recomputed. Whatever was not loaded is recomputed, counted. Without the field: as ``both``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from fastapi.responses import StreamingResponse

from .engine_api import CacheNaming
from .errors import ApiError

log = logging.getLogger("graphgen.serve.pd")
ROLES = ("prefill", "decode", "both")
FIELD = "kv_transfer_params"
VISIBLE_POLL_S = 0.005      # the first pause between visibility polls; each next one 1.5x longer,
VISIBLE_POLL_MAX_S = 0.05   # up to this: a long prompt's puts take a while, and every poll is a pool call


@dataclass(frozen=True)
class Handoff:
    """``kv_transfer_params``: what P hands D (the wire format of docs/pd.md)."""

    block_hashes: tuple[str, ...]
    num_blocks: int
    layout: str
    lease_id: str
    lease_expires_ms: int
    shards: tuple[str, ...] = ()  # several ranks: every KV shard the lease covers ("r0of2", ...); (): one
    # P decodes speculatively (--speculative mtp): its blocks hold the MTP layer's KV, under keys naming each
    # block's successor token (`CacheNaming.lookahead`); only a speculative D looks those up
    lookahead: bool = False

    def body(self) -> dict:
        out = {"block_hashes": list(self.block_hashes), "num_blocks": self.num_blocks, "layout": self.layout,
               "lease_id": self.lease_id, "lease_expires_ms": self.lease_expires_ms}
        if self.shards:  # vLLM's shape, extended only where P has several ranks (docs/pd.md)
            out["shards"] = list(self.shards)
        if self.lookahead:  # ... or decodes speculatively
            out["lookahead"] = True
        return out

    @classmethod
    def parse(cls, value) -> Optional["Handoff"]:
        """From a request body's field (None when absent or null); a 400 naming the bad part."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ApiError(f"'{FIELD}' must be an object", param=FIELD, code="invalid_type")

        def want(name, ok, what):
            v = value.get(name)
            if not ok(v):
                raise ApiError(f"'{FIELD}.{name}' must be {what}", param=f"{FIELD}.{name}", code="invalid_type")
            return v

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        hashes = want("block_hashes", lambda v: isinstance(v, list) and all(isinstance(h, str) for h in v),
                      "a list of strings")
        n = want("num_blocks", lambda v: is_int(v) and v == len(hashes), "an integer equal to len(block_hashes)")
        shards = value.get("shards", [])
        if not (isinstance(shards, list) and all(isinstance(s, str) for s in shards)):
            raise ApiError(f"'{FIELD}.shards' must be a list of strings", param=f"{FIELD}.shards",
                           code="invalid_type")
        lookahead = value.get("lookahead", False)
        if not isinstance(lookahead, bool):
            raise ApiError(f"'{FIELD}.lookahead' must be a boolean", param=f"{FIELD}.lookahead", code="invalid_type")
        return cls(tuple(hashes), n, want("layout", lambda v: isinstance(v, str), "a string"),
                   want("lease_id", lambda v: isinstance(v, str), "a string"),
                   want("lease_expires_ms", is_int, "an integer >= 0"), tuple(shards), lookahead)


class PD:
    """A server's role and its handoff counters (registered on the server's metrics)."""

    def __init__(self, role: str, pool, naming: CacheNaming, registry, *, lease_timeout_s: float = 30.0,
                 visible_timeout_s: float = 10.0, saves_pending: Callable[[], int] = lambda: 0):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role, self.pool, self.naming = role, pool, naming
        self.lease_timeout_s, self.visible_timeout_s = lease_timeout_s, visible_timeout_s
        self.saves_pending = saves_pending
        self._warned_lookahead = False
        self.handoffs = Counter("graphgen_pd_handoffs", "KV handoffs: made (P), accepted / mismatched (D).",
                                ["result"], registry=registry)
        self.blocks = Counter("graphgen_pd_handoff_blocks", "Handed-off blocks: loaded or recomputed (D), "
                              "handed off or not visible in time (P).", ["result"], registry=registry)
        self.releases = Counter("graphgen_pd_lease_releases", "POST /v1/kv/release: released or unknown.",
                                ["result"], registry=registry)
        registry.register(self)

    @classmethod
    def for_engine(cls, engine, role: str, registry, lease_timeout_s: float = 30.0) -> Optional["PD"]:
        """The role over a `ServingEngine`'s pool and block naming, through its P/D methods; None
        when the engine cannot hand blocks over (ranks on the host pool, DP groups)."""
        naming = engine.kv_naming()
        if naming is None:
            return None
        return cls(role, engine.kv_pool(), naming, registry, lease_timeout_s=lease_timeout_s,
                   saves_pending=engine.saves_in_flight)

    def collect(self):  # the pool's live leases, read at scrape time
        g = GaugeMetricFamily("graphgen_pd_leases", "Pool leases live now (handed-off blocks pinned).")
        try:
            g.add_metric([], self.pool.leases())
        except Exception:  # noqa: BLE001 - a pool that is down has no answer: report none
            g.add_metric([], 0)
        yield g

    # ---- P ------------------------------------------------------------------------------------
    @staticmethod
    def prefill_params(params):
        """The request as P runs it: one token (never forced longer by ``min_tokens``)."""
        kw = {"max_tokens": 1}
        if getattr(params, "min_tokens", 0):
            kw["min_tokens"] = 0
        return dataclasses.replace(params, **kw)

    def lease(self, prompt: Sequence[int], salt: str = ""):
        """Lease the prompt's handed-off blocks, every KV shard's (one list of keys per shard; before its
        prefill: none is evicted once visible); ``salt``: its LoRA adapter's (`CacheNaming.salt_of`), so the
        keys are the ones its prefill saves. One lease covers every rank's part of the blocks."""
        keys = self.naming.handoff_keys(prompt, salt)
        return keys, self.pool.pin([k for shard in keys for k in shard], self.lease_timeout_s)

    async def wait_visible(self, keys: Sequence[Sequence[str]]) -> int:
        """Until every key is visible in the pool; the leading run visible when the saves are over
        (no commit pending) or ``visible_timeout_s`` passed first. Each poll runs off the event loop,
        but the pauses do not hold a thread: many prefills waiting at once would otherwise take
        every worker of the server's thread pool, which also parses and tokenizes requests."""
        deadline = time.monotonic() + self.visible_timeout_s
        idle, pause = 0, VISIBLE_POLL_S
        while True:
            run = await asyncio.to_thread(self._visible_run, keys)
            if run == len(keys[0]) or time.monotonic() > deadline:
                return run
            idle = idle + 1 if self.saves_pending() == 0 else 0
            if idle > 3:  # no commit in flight for several polls: the missing blocks never come
                return run
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, VISIBLE_POLL_MAX_S)

    def _visible_run(self, keys: Sequence[Sequence[str]]) -> int:
        """The leading run of blocks visible in every shard (a block is handed off once all its parts are)."""
        try:
            return min(self.pool.leading_run(list(shard)) if shard else 0 for shard in keys)
        except Exception:  # noqa: BLE001 - a pool that cannot answer hands off nothing
            return 0

    async def finish_prefill(self, prompt: Sequence[int], keys, lease, body: dict, n: int = 1, salt: str = "") -> dict:
        """P's answer: the generated token dropped, ``kv_transfer_params`` added; ``n`` (empty)
        choices for a request of ``n`` choices, all from its one prefill."""
        run = await self.wait_visible(keys)
        self.handoffs.labels(result="made").inc()
        self.blocks.labels(result="handed_off").inc(run)
        self.blocks.labels(result="not_visible").inc(len(keys[0]) - run)
        digests = self.naming.digests(prompt, salt)[:run]
        for c in body["choices"]:  # the token D recomputes: nothing of it is returned
            c["token_ids"], c["finish_reason"], c["logprobs"] = [], "length", None
            if "message" in c:
                c["message"] = {"role": "assistant", "content": ""}
            else:
                c["text"] = ""
        body["choices"] = [dict(body["choices"][0], index=i) for i in range(n)]
        u = body["usage"]
        u["completion_tokens"], u["total_tokens"] = 0, u["prompt_tokens"]
        body[FIELD] = Handoff(tuple(digests), run, self.naming.layout, lease.lease_id, lease.expires_ms,
                              tuple(self.naming.shards), self.naming.lookahead).body()
        return body

    def release(self, lease_id: str) -> bool:
        ok = bool(self.pool.release(lease_id))
        self.releases.labels(result="released" if ok else "unknown").inc()
        return ok

    # ---- D ------------------------------------------------------------------------------------
    def accept(self, prompt: Sequence[int], h: Handoff, salt: str = "") -> bool:
        """Does the handoff name this prompt's blocks in this cache's layout and KV shards, keyed as this engine
        keys them (with or without successors: speculative or not), under the request's adapter (``salt``)?
        (Counted.)"""
        ok = (h.layout == self.naming.layout and tuple(h.shards) == tuple(self.naming.shards)
              and h.lookahead == self.naming.lookahead
              and h.num_blocks <= self.naming.handed_off(prompt)
              and list(h.block_hashes) == self.naming.digests(prompt, salt)[:h.num_blocks])
        self.handoffs.labels(result="accepted" if ok else "mismatch").inc()
        if not ok:
            self.blocks.labels(result="recomputed").inc(h.num_blocks)
            if h.lookahead != self.naming.lookahead and not self._warned_lookahead:
                self._warned_lookahead = True  # a deployment's mistake, not a request's: said once
                log.warning("a handoff from a prefill instance %s --speculative mtp reached this decode instance, "
                            "which runs %s it: its blocks are keyed %s successor tokens and cannot be loaded here, "
                            "so every such prompt is recomputed (run P and D both with --speculative mtp, or both "
                            "without; docs/pd.md)", *(("with", "without", "with") if h.lookahead
                                                      else ("without", "with", "without")))
        return ok

    def loaded(self, h: Handoff, cached_tokens: int) -> None:
        """After D's prefill: how many handed-off blocks came from the pool; the rest was recomputed."""
        got = min(h.num_blocks, cached_tokens // self.naming.block_size)
        self.blocks.labels(result="loaded").inc(got)
        self.blocks.labels(result="recomputed").inc(h.num_blocks - got)


async def serve_with_role(pd: Optional[PD], serve, request, parsed, chat: bool, handoff: Optional[Handoff]):
    """``serve(request, parsed, chat)`` (the app's own) under P/D: P leases, runs one token and
    hands off; D checks a handoff and counts the blocks it loaded; otherwise as ``both``."""
    if pd is None or (pd.role != "prefill" and handoff is None):
        return await serve(request, parsed, chat)
    if len(parsed.prompts) != 1:
        raise ApiError("a P/D handoff covers one prompt (send a list of prompts to a decode or both instance)",
                       param=FIELD if handoff is not None else "prompt", code="unsupported_value")
    prompt = parsed.prompts[0]
    salt = pd.naming.salt_of(getattr(parsed.params, "lora", None))  # the adapter's blocks (docs/lora.md)
    if pd.role != "prefill":  # D: a handoff that names other blocks is not admitted (recomputed)
        if not await asyncio.to_thread(pd.accept, prompt, handoff, salt):
            return await serve(request, parsed, chat)
        out = await serve(request, parsed, chat)
        if isinstance(out, StreamingResponse):
            out.body_iterator = _counted(pd, out.body_iterator, handoff, out.choices)
        elif isinstance(out, dict):
            pd.loaded(handoff, out["usage"]["prompt_tokens_details"]["cached_tokens"])
        return out
    # n / best_of > 1: one prefill of the prompt (D forks its copies from the handed-off blocks)
    n = parsed.fan.n
    parsed = dataclasses.replace(parsed, params=pd.prefill_params(parsed.params), stream=False,
                                 fan=dataclasses.replace(parsed.fan, n=1, best_of=1))
    keys, lease = await asyncio.to_thread(pd.lease, prompt, salt)
    try:
        out = await serve(request, parsed, chat)
        if isinstance(out, dict):
            return await pd.finish_prefill(prompt, keys, lease, out, n, salt)
    except BaseException:
        pd.release(lease.lease_id)  # nothing handed off: nobody else will release it
        raise
    pd.release(lease.lease_id)  # the client went away
    return out


async def _counted(pd: PD, stream, handoff: Handoff, choices: dict):
    async for chunk in stream:
        yield chunk
    pd.loaded(handoff, max((c.cached for c in choices.values()), default=0))
