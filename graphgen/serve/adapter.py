"""``SequentialEngineAdapter``: the serving interface on today's ``Engine`` (no continuous batching).

Every step runs sequences of batch size 1 — at most one prefill (the oldest waiting request, when
fewer than ``max_num_seqs`` run) and then one decode step for each running request, in arrival
order. A request's tokens are therefore exactly what ``Engine.generate([prompt])`` gives it alone
(same graphs, same shapes; greedy = the engine's ``argmax``), whatever else is in flight, and a
new request waits at most one round of decodes for its prefill.

This adapter drives the engine one step at a time through a few of its internals (``_Seq``,
``_lookup_and_load``, ``_prefill``, ``_decode``, ``alloc.free``, ``_reap``, ``_pending``, ``stats``,
``modules``, ``rt``). That coupling is deliberate and confined here: the continuous-batching
scheduler replaces this file, not the server. It also wraps the engine's generated modules and the
runtime's ``kv_save`` to time saves and commits and to emit trace spans (hooks ``forward``,
``save``, ``host``; see :mod:`graphgen.trace`) without changing the engine.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from ..runtime.engine import Engine, RequestResult, _Seq
from ..runtime.kvcache import OutOfBlocks
from ..runtime.sampling import Sampler, SamplingParams, StopChecker
from ..trace import NULL, TRACK_FORWARD, TRACK_HOST, TRACK_SAVE, TRACK_SCHEDULER, TraceRecorder
from .engine_api import EngineStats, RequestOutput

log = logging.getLogger("graphgen.serve")


@dataclass
class _Req:
    req_id: str
    seq: _Seq
    sampler: Sampler
    stopper: StopChecker
    prefilled: bool = False


class _TimedModule:
    """A generated module whose ``run`` and ``host`` are timed and traced (same behaviour)."""

    def __init__(self, mod, variant: str, adapter: "SequentialEngineAdapter"):
        self._mod, self._variant, self._adapter = mod, variant, adapter
        self.EVENTS, self.HOST_EVENT = mod.EVENTS, mod.HOST_EVENT

    def __getattr__(self, name):
        return getattr(self._mod, name)

    def run(self, rt, W, b, kv, staging, ev):
        start = time.perf_counter()
        self._adapter._fwd_start[id(ev)] = start
        try:
            return self._mod.run(rt, W, b, kv, staging, ev)
        finally:
            self._adapter.trace.complete(TRACK_FORWARD, f"forward:{self._variant}", start, time.perf_counter(),
                                         tokens=int(b.input_ids.numel()), seqs=int(b.seq_lens.numel()))

    def host(self, rt, ev, commit):
        a = self._adapter
        fwd_start = a._fwd_start.pop(id(ev), None)

        def timed_commit():
            saved = time.perf_counter()
            commit()
            done = time.perf_counter()
            a.trace.complete(TRACK_HOST, "commit", saved, done)
            if fwd_start is not None:
                a._timings.append(("save", saved - fwd_start))
            a._timings.append(("commit", done - saved))

        return self._mod.host(rt, ev, timed_commit)


class SequentialEngineAdapter:
    def __init__(self, engine: Engine, *, max_num_seqs: int = 16, eos_token_id: Optional[int] = None,
                 trace: TraceRecorder = NULL, model_name: Optional[str] = None):
        self.engine = engine
        self.trace = trace
        self.max_num_seqs = max_num_seqs
        self.eos_token_id = eos_token_id
        spec = engine.spec
        self.model_name = model_name or spec.name
        self.vocab_size = spec.dims.vocab_size
        # one sequence must fit in the device blocks, and in the model's positions
        self.max_model_len = min(engine.alloc.num_blocks * engine.block_size,
                                 getattr(spec.dims, "max_position_embeddings", None) or 1 << 30)
        engine.collect_logits = True  # the adapter samples from the logits itself
        self._fwd_start: dict[int, float] = {}
        self._timings: collections.deque = collections.deque()
        engine.modules = {v: _TimedModule(m, v, self) for v, m in engine.modules.items()}
        if trace.enabled:
            self._trace_saves(engine.rt)
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: dict[str, _Req] = {}
        self._totals = collections.Counter()

    def _trace_saves(self, rt) -> None:
        inner = rt.kv_save  # bound method; an instance attribute shadows it for kv_save_layers too

        def kv_save(cache, block_ids, staging):
            with self.trace.span(TRACK_SAVE, "kv_save", blocks=int(len(block_ids)), thread=threading.current_thread().name):
                inner(cache, block_ids, staging)
        rt.kv_save = kv_save

    # ---- the interface ------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        prompt = [int(t) for t in prompt_ids]
        if not prompt or any(t < 0 or t >= self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be a non-empty list of ints in [0, {self.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds {self.max_model_len}")
        seq = _Seq(RequestResult(prompt=prompt), time.perf_counter())
        self._waiting.append(_Req(req_id, seq, Sampler(params), StopChecker(params, self.eos_token_id)))

    def abort(self, req_id: str) -> None:
        for r in list(self._waiting):
            if r.req_id == req_id:
                self._waiting.remove(r)
        r = self._running.pop(req_id, None)
        if r is not None:
            self._free(r)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[RequestOutput]:
        out: list[RequestOutput] = []
        with self.trace.span(TRACK_SCHEDULER, "step", waiting=len(self._waiting), running=len(self._running)):
            decodes = list(self._running.values())
            if self._waiting and len(self._running) < self.max_num_seqs:
                self._admit(self._waiting[0], out)
            for r in decodes:
                if r.req_id in self._running:
                    self._decode_one(r, out)
        return out

    def stats(self) -> EngineStats:
        self.engine._reap()
        s = self.engine.stats
        return EngineStats(running=len(self._running), waiting=len(self._waiting),
                           saves_pending=len(self.engine._pending),
                           free_blocks=self.engine.alloc.num_free, prefix_hit_tokens=self._totals["hit"],
                           prompt_tokens=self._totals["prompt"], generation_tokens=self._totals["gen"],
                           puts=s["puts"], put_failures=s["put_failures"], save_failures=s["save_failures"],
                           pool_errors=s["pool_errors"])

    def take_timings(self) -> list[tuple[str, float]]:
        out = []
        while self._timings:
            out.append(self._timings.popleft())
        return out

    def shutdown(self) -> None:
        for r in list(self._running.values()):
            self.abort(r.req_id)
        self._waiting.clear()
        self.engine.close()  # drains: every pending save is committed (or failed) first

    # ---- internals ----------------------------------------------------------------------------
    def _admit(self, r: _Req, out: list) -> None:
        eng, s = self.engine, r.seq
        try:
            with self.trace.span(TRACK_SCHEDULER, "schedule", req=r.req_id):
                eng._lookup_and_load(s)
            eng._prefill([s], s.hit_blocks > 0)
        except OutOfBlocks as e:
            self._free(r)
            s.cached, s.hit_blocks, s.result.hit_tokens = 0, 0, 0
            s.result.tokens.clear()
            s.result.step_logits.clear()
            if self._running:  # others hold blocks: retry once some finish
                return
            self._waiting.popleft()
            out.append(RequestOutput(r.req_id, (), True, "error", 0, len(s.prompt), error=f"out of KV blocks: {e}"))
            return
        self._waiting.popleft()
        self._running[r.req_id] = r
        r.prefilled = True
        self._totals["prompt"] += len(s.prompt)
        self._totals["hit"] += s.result.hit_tokens
        self._emit(r, out)

    def _decode_one(self, r: _Req, out: list) -> None:
        try:
            self.engine._decode([r.seq])
        except OutOfBlocks as e:
            self._running.pop(r.req_id, None)
            self._free(r)
            out.append(RequestOutput(r.req_id, (), True, "error", r.seq.result.hit_tokens, len(r.seq.prompt),
                                     error=f"out of KV blocks: {e}"))
            return
        self._emit(r, out)

    def _emit(self, r: _Req, out: list) -> None:
        res = r.seq.result
        row = res.step_logits.pop()
        res.step_logits.clear()
        tok = r.sampler(row)
        res.tokens[-1] = tok  # the next decode feeds tokens[-1]: the sampled token, not the argmax
        self._totals["gen"] += 1
        reason = r.stopper.check(res.tokens)
        if reason is not None:
            self._running.pop(r.req_id, None)
            self._free(r)
        out.append(RequestOutput(r.req_id, (tok,), reason is not None, reason, res.hit_tokens, len(res.prompt)))

    def _free(self, r: _Req) -> None:
        self.engine.alloc.free(r.seq.table)  # pinned blocks stay out of the free list until committed
        r.seq.table = []
        self.engine._reap()
