"""The engine-loop thread: the only thread that calls the :class:`ServingEngine`.

HTTP handlers (asyncio) hand it requests and aborts through a thread-safe inbox; it runs engine
steps while there is work and hands every :class:`RequestOutput` to the request's callback (which
the server turns into an ``asyncio.Queue`` put on its event loop). It also times TTFT and
inter-token latency (from the request's arrival at the server) and refreshes the metrics.

An engine that ends (`RankFailure`: a rank or a node lost, in one sentence) is not a crash: the requests
in flight get the sentence as their error, ``on_engine_end(sentence, in_flight)`` is told it (``graphgen
serve --nnodes``: print it, exit 2), else it is logged on one line; no traceback, and no shutdown of an
engine whose ranks are gone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from ..runtime import RankFailure, SamplingParams
from ..trace import NULL, TRACK_SERVER, TraceRecorder
from .engine_api import RequestOutput, ServingEngine
from .metrics import ServerMetrics

log = logging.getLogger("graphgen.serve")


# ---- the inbox's messages (typed, one handler each: `EngineLoop._HANDLERS`) ------------------------------
@dataclass(frozen=True)
class AddRequest:
    """A request (or one copy of a request's ``n``) to add to the engine."""
    req_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    arrived: float                  # perf_counter at the server: TTFT and the phases count from here
    fork_of: Optional[str] = None   # a copy of this request shares its prompt's blocks
    copy: int = 0


@dataclass(frozen=True)
class AbortRequest:
    """End a request early. ``forks=False``: only this request (one choice cut at a stop string), not
    its forks; ``reason``: the finish the client saw, counted in the metrics (``stop`` for a stop string)."""
    req_id: str
    forks: bool = True
    reason: str = "abort"


@dataclass(frozen=True)
class StopLoop:
    """Drain until ``deadline`` (perf_counter), then abort the rest and end the thread."""
    deadline: float


InboxMessage = Union[AddRequest, AbortRequest, StopLoop]


@dataclass
class _Track:
    on_output: Callable[[RequestOutput], None]
    arrived: float
    last: Optional[float] = None
    tokens: int = field(default=0)
    first: Optional[float] = None  # its first token
    scheduled: Optional[float] = None  # start of the engine step that gave its first token
    prompt_len: int = 0


class EngineLoop:
    def __init__(self, engine: ServingEngine, metrics: ServerMetrics, trace: TraceRecorder = NULL,
                 idle_poll_s: float = 0.05):
        self.engine = engine
        self.metrics = metrics
        self.trace = trace
        self.idle_poll_s = idle_poll_s
        self._inbox: queue.Queue = queue.Queue()
        self._tracks: dict[str, _Track] = {}
        self._stop_deadline: Optional[float] = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._ready = threading.Event()
        self.error: Optional[BaseException] = None
        # told the sentence of an engine that ended (RankFailure) and how many requests it failed
        self.on_engine_end: Optional[Callable[[str, int], None]] = None

    # ---- called from any thread ------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> None:
        """Start the thread; returns once it has read the engine's first stats (the gauges are set
        before the server accepts a request, not at the first step)."""
        self._thread.start()
        self._ready.wait(timeout_s)

    def submit(self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               on_output: Callable[[RequestOutput], None], fork_of: Optional[str] = None, copy: int = 0) -> None:
        self._inbox.put(AddRequest(req_id, tuple(prompt_ids), params, on_output, time.perf_counter(), fork_of, copy))

    def abort(self, req_id: str, forks: bool = True, reason: str = "abort") -> None:
        """``forks=False``: only this request (one choice cut at a stop string), not its forks.
        ``reason``: the finish the client saw, counted in the metrics (``stop`` for a stop string)."""
        self._inbox.put(AbortRequest(req_id, forks, reason))

    def stop(self, drain_timeout_s: float = 30.0, join_timeout_s: float = 120.0) -> None:
        """Let running requests finish for up to ``drain_timeout_s``, abort the rest, commit every
        pending save (``engine.shutdown``), and end the thread."""
        self._inbox.put(StopLoop(time.perf_counter() + drain_timeout_s))
        self._thread.join(join_timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        ended = False
        try:
            try:
                stats = self.engine.stats()
                self.metrics.set_num_blocks(stats.free_blocks)  # nothing in use yet: all of them
                self.metrics.update_stats(stats)
            finally:
                self._ready.set()
            while True:
                self._take_inbox(block=not self.engine.has_work())
                if self._stop_deadline is not None:
                    if not self.engine.has_work():
                        break
                    if time.perf_counter() > self._stop_deadline:
                        for rid in list(self._tracks):  # cut: the client is told why
                            self._abort(rid, error="the server is shutting down (drain timeout)")
                        break
                if self.engine.has_work():
                    self._step()
                self._refresh()
        except RankFailure as e:  # the engine ended and says why in one sentence: answer, tell, no traceback
            ended = True
            self._engine_ended(e)
        except BaseException as e:  # never expected: fail what is in flight, keep the reason
            log.exception("engine loop died")
            self.error = e
            for rid in list(self._tracks):
                self._finish(rid, RequestOutput(rid, (), True, "error", error=f"engine loop died: {e}"))
        finally:
            if not ended:  # an ended engine has nothing left to commit, and its ranks answer nothing
                try:
                    self.engine.shutdown()
                finally:
                    self._refresh()

    def _engine_ended(self, e: RankFailure) -> None:
        self.error, sentence, in_flight = e, str(e), len(self._tracks)
        for rid in list(self._tracks):
            self._finish(rid, RequestOutput(rid, (), True, "error", error=sentence))
        if self.on_engine_end is not None:
            self.on_engine_end(sentence, in_flight)
        else:
            log.error("the engine ended: %s", sentence)

    def _take_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=self.idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, msg: InboxMessage) -> None:
        self._HANDLERS[type(msg)](self, msg)

    def _add(self, msg: AddRequest) -> None:
        rid, ids = msg.req_id, list(msg.prompt_ids)
        if self._stop_deadline is not None:
            msg.on_output(RequestOutput(rid, (), True, "abort", error="server is shutting down"))
            return
        try:
            self.engine.add_request(rid, ids, msg.params, fork_of=msg.fork_of, copy=msg.copy)
        except ValueError as e:  # the server validates first; this is the engine's own check
            msg.on_output(RequestOutput(rid, (), True, "error", num_prompt_tokens=len(ids), error=str(e)))
            return
        self._tracks[rid] = _Track(msg.on_output, msg.arrived, prompt_len=len(ids))

    def _abort_msg(self, msg: AbortRequest) -> None:
        self._abort(msg.req_id, forks=msg.forks, reason=msg.reason)

    def _stop_msg(self, msg: StopLoop) -> None:
        self._stop_deadline = msg.deadline

    # message type -> its handler (SGLang's TypeBasedDispatcher, as a table): a new message is a
    # dataclass above and one row here
    _HANDLERS: dict[type, Callable[[Any, Any], None]] = {
        AddRequest: _add, AbortRequest: _abort_msg, StopLoop: _stop_msg,
    }

    def _abort(self, rid: str, error: Optional[str] = None, forks: bool = True, reason: str = "abort") -> None:
        if rid in self._tracks:
            self.engine.abort(rid, forks)
            self._finish(rid, RequestOutput(rid, (), True, reason, error=error))

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outs = self.engine.step()
        except RankFailure:  # not this step's failure: the engine ended (`_run`)
            raise
        except Exception as e:  # a failed step fails its requests, not the server
            log.exception("engine step failed")
            for rid in list(self._tracks):
                self.engine.abort(rid)
                self._finish(rid, RequestOutput(rid, (), True, "error", error=f"engine step failed: {e}"))
            return
        now = time.perf_counter()
        for o in outs:
            t = self._tracks.get(o.req_id)
            if t is None:
                continue
            for _ in o.new_token_ids:
                if t.last is None:
                    t.first, t.scheduled = now, started
                    self.metrics.ttft.observe(now - t.arrived)
                else:
                    self.metrics.itl.observe(now - t.last)
                t.last = now
                t.tokens += 1
            if o.finished:
                self._finish(o.req_id, o)
            else:
                self._send(t, o)

    def _finish(self, rid: str, o: RequestOutput) -> None:
        t = self._tracks.pop(rid, None)
        if t is None:
            return
        now = time.perf_counter()
        m = self.metrics
        m.finished(o.finish_reason or "unknown")
        m.e2e.observe(now - t.arrived)
        if t.first is not None:  # vLLM's phases: waiting, prefill (to the first token), decode
            m.queue.observe(max(0.0, t.scheduled - t.arrived))
            m.prefill.observe(t.first - t.scheduled)
            m.decode.observe(now - t.first)
            m.inference.observe(now - t.scheduled)
        m.prompt_tokens.observe(t.prompt_len)
        m.generation_tokens.observe(t.tokens)
        self.trace.complete(TRACK_SERVER, "request", t.arrived, now, req=rid, tokens=t.tokens,
                            finish_reason=o.finish_reason)
        self._send(t, o)

    @staticmethod
    def _send(t: _Track, o: RequestOutput) -> None:
        try:
            t.on_output(o)
        except Exception:  # the client's event loop is gone: nothing to tell
            log.debug("dropping output for %s", o.req_id, exc_info=True)

    def _refresh(self) -> None:
        self.metrics.update_stats(self.engine.stats())
        for name, sec in self.engine.take_timings():
            self.metrics.observe_timing(name, sec)
