"""One request, from its validated form (`Parsed`) to the answer: engine requests fanned out (``n`` /
``best_of`` copies fork the first), outputs fed to their `Choice` (serve/choice.py) off the event
loop, and either one JSON body (`collect`) or an SSE stream (`stream`). A client that goes away
aborts what is left; a choice cut at a stop string is aborted alone (its forks go on) and counted
as ``stop``.
"""

from __future__ import annotations

import asyncio
import os
import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .choice import Choice
from .engine_api import RequestOutput
from .errors import ApiError
from .logprobs import LogprobFormatter, cumulative
from .protocol import SSE_DONE, Parsed, sse, usage
from .state import AppState

__all__ = ["serve"]

DISCONNECT_POLL_S = 0.25


async def serve(st: AppState, request: Request, parsed: Parsed, chat: bool):
    """Submit ``parsed`` (once its grammar is compiled) and answer it, streamed or whole."""
    if not st.accepting or not st.loop.alive:
        raise ApiError("the server is shutting down", status=503, type="server_error", code="unavailable")
    await st.grammars.ready(parsed.params.structured, parsed.grammar_field or "response_format")
    aio = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    base = f"{'chatcmpl' if chat else 'cmpl'}-{os.getpid():x}{next(st.ids):06x}"
    rids, choices, subs = _fan_out(st, parsed, chat, base)

    def on_output(o: RequestOutput):
        aio.call_soon_threadsafe(q.put_nowait, o)

    for rid, prompt, parent, copy in subs:
        st.loop.submit(rid, prompt, parsed.params, on_output, fork_of=parent, copy=copy)
    created = int(time.time())
    if parsed.stream:
        resp = StreamingResponse(stream(st, q, base, rids, choices, parsed, chat, created),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        resp.choices = choices  # read by P/D's count once the stream ended
        return resp
    return await collect(st, request, q, base, rids, choices, parsed, chat, created)


def _fan_out(st: AppState, parsed: Parsed, chat: bool, base: str):
    """``best_of`` engine requests per prompt; copies after the first fork it (they share its
    prompt's KV blocks: one prefill). Returns (request ids, their choices, (id, prompt, parent, copy))."""
    fan, fmt = parsed.fan, LogprobFormatter(st.tokenizer)
    rids, choices, subs = [], {}, []
    for i, p in enumerate(parsed.prompts):
        for j in range(fan.best_of):
            rid = f"{base}-{i}" if fan.best_of == 1 else f"{base}-{i}-{j}"
            rids.append(rid)
            choices[rid] = Choice(i * fan.n + j, p, st.tokenizer, parsed.params.stop, fan, j, fmt,
                                  chat=parsed.chat if chat else None, rules=parsed.text)
            subs.append((rid, p, subs[-j][0] if j else None, j))
    return rids, choices, subs


def _usage(choices: dict) -> dict:
    cs = list(choices.values())
    firsts = [c for c in cs if c.copy == 0]  # n / best_of copies share their prompt: counted once
    return usage(sum(c.prompt_len for c in firsts), sum(len(c.tokens) for c in cs), sum(c.cached for c in firsts))


async def _take(st: AppState, o: RequestOutput, choices: dict, open_ids: set):
    """Feed one output; returns (choice, delta, new ids, finished now) or None if stale."""
    if o.req_id not in open_ids:
        return None  # e.g. the abort that follows a stop-string cut
    c = choices[o.req_id]
    if st.tokenizer is not None:  # detokenization off the event loop
        delta, new_ids, stopped = await asyncio.to_thread(c.feed, o)
    else:
        delta, new_ids, stopped = c.feed(o)
    if stopped:
        st.loop.abort(o.req_id, forks=False, reason="stop")  # this choice only: its forks go on
    done = stopped or o.finished
    if done:
        open_ids.discard(o.req_id)
    return c, delta, new_ids, done


async def collect(st: AppState, request: Request, q, base, rids, choices, parsed: Parsed, chat: bool, created):
    open_ids = set(rids)
    try:
        while open_ids:
            try:
                o = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            await _take(st, o, choices, open_ids)
    finally:
        for rid in open_ids:  # client gone (or cancelled): free the engine's work
            st.loop.abort(rid)
    errs = [c for c in choices.values() if c.finish_reason in ("error", "abort")]
    if errs:
        e = errs[0]
        raise ApiError(f"the request could not be completed: {e.error or e.finish_reason}", status=503,
                       type="server_error", code=e.finish_reason)
    out = [await _choice_body(c, chat, parsed) for c in _kept(choices, rids, parsed)]
    return {"id": base, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": parsed.model, "choices": out, "usage": _usage(choices)}


def _kept(choices: dict, rids: list, parsed: Parsed) -> list[Choice]:
    """The choices returned: per prompt, with ``best_of > n`` the ``n`` copies with the highest
    cumulative logprob (renumbered); in index order."""
    fan = parsed.fan
    if fan.best_of <= fan.n:
        return sorted(choices.values(), key=lambda c: c.index)
    kept = []
    for i in range(len(parsed.prompts)):
        group = [choices[rid] for rid in rids[i * fan.best_of:(i + 1) * fan.best_of]]
        group.sort(key=lambda c: -cumulative(c.lps))
        for rank, c in enumerate(group[:fan.n]):
            c.index = i * fan.n + rank
            kept.append(c)
    return kept


async def _choice_body(c: Choice, chat: bool, parsed: Parsed) -> dict:
    lp = await asyncio.to_thread(c.full_logprobs, chat) if parsed.fan.logprobs is not None else None
    body = {"index": c.index, "finish_reason": c.client_finish_reason(), "logprobs": lp, "token_ids": c.tokens}
    if chat:
        body["message"] = c.chat.message()[0] if c.chat is not None else {"role": "assistant", "content": c.text}
    else:
        body["text"] = (c.echo_text or "") + c.text if parsed.fan.echo else c.text
    return body


async def stream(st: AppState, q, base, rids, choices, parsed: Parsed, chat: bool, created):
    open_ids, first = set(rids), set(rids)
    head = {"id": base, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": parsed.model}
    failed = False
    try:
        while open_ids:
            got = await _take(st, await q.get(), choices, open_ids)
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
            ch = await _chunk(c, delta, new_ids, done, is_first, chat)
            yield sse({**head, "choices": [ch]})
        if parsed.include_usage and not failed:
            yield sse({**head, "choices": [], "usage": _usage(choices)})
        yield SSE_DONE
    finally:
        for rid in open_ids:  # the client went away mid-stream: abort (frees its blocks)
            st.loop.abort(rid)


async def _chunk(c: Choice, delta: str, new_ids: list, done: bool, is_first: bool, chat: bool) -> dict:
    lp = None
    if c.fan.logprobs is not None:
        lp = await asyncio.to_thread(c.chunk_logprobs, new_ids, is_first, chat)
    finish = c.client_finish_reason() if done else None
    if not chat:
        text = (c.echo_text or "") + delta if is_first and c.fan.echo else delta
        return {"index": c.index, "text": text, "finish_reason": finish, "logprobs": lp, "token_ids": new_ids}
    d = dict(c.chat_delta) if c.chat is not None else {"content": delta}
    if is_first:
        d["role"] = "assistant"
    return {"index": c.index, "delta": d, "finish_reason": finish, "logprobs": lp, "token_ids": new_ids}
