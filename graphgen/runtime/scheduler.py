"""The scheduler: which requests run in the next step, with which variant, in which KV blocks.

It is per step: ``add`` queues requests, ``schedule()`` returns the next `ScheduledStep` (or None
when nothing is left) and ``update(step, output)`` takes that step's sampled tokens back. Requests
move ``waiting -> prefill -> running -> finished``; between any two steps requests can be added,
so continuous batching (a token budget, mixing prefills into a running batch, preempting the
newest request when blocks run out) is a change of *policy* in `schedule`, not of shape.

Today's policy (the one the engine always had): every waiting request is admitted at once (its
pool prefix looked up and loaded through the connector), then one prefill step for those without
history (``mempool_prefill``), one for those with history (``splitfuse``), then decode steps of
every running request together until each has its tokens.

Block accounting: a request's ``table`` lists its device blocks (refcount 1 each, taken from the
shared `BlockAllocator`); they go back when it finishes or is aborted. Blocks whose save is still in
flight stay pinned by the connector, so freeing never waits for a save. When the allocator is out
of blocks, ``reclaim()`` (the connector: wait for the oldest pending commit) is asked to release
pins before `OutOfBlocks` is raised.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol, Sequence

import torch

from .kvcache import BlockAllocator, OutOfBlocks, slot_mapping

__all__ = ["StepInputs", "RequestResult", "Request", "ScheduledStep", "StepOutput", "Scheduler"]


@dataclass
class StepInputs:
    """What the host fills before a graph runs (names match the IR's inputs)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_lens: torch.Tensor
    logits_indices: torch.Tensor
    save_block_ids: torch.Tensor


@dataclass
class RequestResult:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    hit_tokens: int = 0
    ttft_ms: float = 0.0
    variant: str = ""
    saved_blocks: int = 0  # blocks handed to the save (committed later, if the pool accepts them)
    step_logits: list = field(default_factory=list)  # per generated token, when collect_logits

    def to_json(self, with_logits: bool = False) -> dict:
        d = {"tokens": self.tokens, "hit_tokens": self.hit_tokens, "ttft_ms": round(self.ttft_ms, 3),
             "variant": self.variant}
        if with_logits:
            d["logits"] = [float(x) for x in self.step_logits[0].tolist()]
        return d


@dataclass(eq=False)  # identity: two requests with the same prompt are still two requests
class Request:
    """One request's scheduling state (its `RequestResult` is what the caller gets back)."""

    result: RequestResult
    max_new_tokens: int
    t0: float = field(default_factory=time.perf_counter)  # TTFT clock start
    table: list[int] = field(default_factory=list)  # device block ids, in position order
    cached: int = 0  # tokens whose KV is in the cache
    hit_blocks: int = 0  # leading blocks loaded from the pool
    keys: Optional[list[str]] = None  # pool keys of the prompt's full blocks, hashed once

    @property
    def prompt(self) -> list[int]:
        return self.result.prompt

    @property
    def finished(self) -> bool:
        return len(self.result.tokens) >= self.max_new_tokens


@dataclass(frozen=True)
class ScheduledStep:
    """One step: the variant to run, its requests (row i of the logits is request i) and inputs.

    ``save_block_ids[j]`` is saved under ``save_keys[j]``; ``saves`` says whether the variant has a
    save program at all (it may have one with zero blocks: a prompt shorter than a block)."""

    variant: str
    phase: str  # "prefill" | "decode"
    requests: tuple[Request, ...]
    inputs: StepInputs
    saves: bool
    save_block_ids: tuple[int, ...] = ()
    save_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepOutput:
    """What came out of a step, one entry per request: the sampled token, and its logits row when
    the caller collects them."""

    tokens: tuple[int, ...]
    logits: Optional[torch.Tensor] = None


class PrefixSource(Protocol):
    """The connector's scheduler-facing side (see `graphgen.runtime.connector.KVConnector`)."""

    def block_keys(self, prompt: Sequence[int]) -> list[str]: ...
    def lookup(self, keys: Sequence[str]) -> int: ...
    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> int: ...


class Scheduler:
    def __init__(self, spec, alloc: BlockAllocator, connector: PrefixSource, *,
                 reclaim: Callable[[], bool] = lambda: False):
        self.spec = spec
        self.block_size = spec.kv_cache.block_size
        self.alloc = alloc
        self.connector = connector
        self.reclaim = reclaim  # release pinned blocks (True if it may have); False: nothing to wait for
        self.prefix_cache = "prefix_cache" in spec.features
        self.waiting: deque[Request] = deque()  # added, not admitted yet
        self.prefill: list[Request] = []        # admitted (prefix loaded), awaiting their prefill
        self.in_flight: list[Request] = []      # in a prefill step that has not been updated yet
        self.running: list[Request] = []        # prefilled, decoding

    # ---- queues -----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefill or self.in_flight or self.running)

    def abort_all(self) -> None:
        """Drop every request and give its blocks back (pins keep in-flight saves safe)."""
        for r in (*self.waiting, *self.prefill, *self.in_flight, *self.running):
            self._release(r)
        for q in (self.waiting, self.prefill, self.in_flight, self.running):
            q.clear()

    # ---- variants ---------------------------------------------------------------------------
    def variant_for(self, phase: str, history: bool) -> Optional[str]:
        gran = self.spec.pool.granularity
        matches = [n for n, v in self.spec.variants.items()
                   if v.phase == phase and (v.history == history or phase == "decode")]
        for n in matches:
            if self.spec.variant_granularity(self.spec.variants[n]) == gran:
                return n
        return matches[0] if matches else None

    # ---- the step loop ----------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduledStep]:
        while self.waiting:
            r = self.waiting.popleft()
            self.prefill.append(r)  # before loading: an abort then frees what the load allocated
            self._admit(r)
        for history in (False, True):
            part = [r for r in self.prefill if (r.hit_blocks > 0) == history]
            if part:
                self.prefill = [r for r in self.prefill if r not in part]
                self.in_flight.extend(part)  # before building: an abort then frees their blocks
                return self._prefill_step(part, history)
        if self.running:
            return self._decode_step(list(self.running))
        return None

    def update(self, step: ScheduledStep, output: StepOutput) -> list[Request]:
        """Take the step's tokens; returns the requests that finished (their blocks are freed)."""
        now = time.perf_counter()
        for i, r in enumerate(step.requests):
            r.cached = int(step.inputs.seq_lens[i])
            r.result.tokens.append(output.tokens[i])
            if output.logits is not None:
                r.result.step_logits.append(output.logits[i].detach().float().clone())
            if step.phase == "prefill":
                r.result.ttft_ms = (now - r.t0) * 1e3
                self.in_flight.remove(r)
                self.running.append(r)
        done = [r for r in step.requests if r.finished]
        for r in done:
            self.running.remove(r)
            self._release(r)
        return done

    # ---- internals --------------------------------------------------------------------------
    def _keys(self, r: Request) -> list[str]:
        if r.keys is None:
            r.keys = self.connector.block_keys(r.prompt)
        return r.keys

    def _admit(self, r: Request) -> None:
        """Look the prompt's prefix up in the pool and load the leading run of hits. At most
        ``(len-1)//block_size`` blocks: the last prompt token is always computed (its logits)."""
        max_blocks = (len(r.prompt) - 1) // self.block_size
        if not self.prefix_cache or max_blocks == 0 or self.variant_for("prefill", True) is None:
            return
        keys = self._keys(r)[:max_blocks]
        run = self.connector.lookup(keys)
        if run == 0:
            return
        self._ensure_blocks(r, len(r.prompt))
        r.hit_blocks = self.connector.load(keys[:run], r.table[:run])
        r.cached = r.hit_blocks * self.block_size
        r.result.hit_tokens = r.cached

    def _alloc(self, n: int) -> list[int]:
        while True:
            try:
                return self.alloc.alloc(n)
            except OutOfBlocks:
                if not self.reclaim():  # nothing in flight would ever give blocks back
                    raise

    def _ensure_blocks(self, r: Request, num_tokens: int) -> None:
        need = math.ceil(num_tokens / self.block_size) - len(r.table)
        if need > 0:
            r.table.extend(self._alloc(need))

    def _release(self, r: Request) -> None:
        if r.table:
            self.alloc.free(r.table)  # pinned blocks stay out of the free list until committed
            r.table = []

    def _prefill_step(self, reqs: list[Request], history: bool) -> ScheduledStep:
        variant = self.variant_for("prefill", history)
        saves = self.spec.variant_saves(self.spec.variants[variant])
        ids, pos, slots, qlens, slens, save_ids, save_keys = [], [], [], [], [], [], []
        for r in reqs:
            n, start = len(r.prompt), r.cached
            self._ensure_blocks(r, n)
            ids.append(torch.tensor(r.prompt[start:], dtype=torch.long))
            pos.append(torch.arange(start, n, dtype=torch.long))
            slots.append(slot_mapping(r.table, start, n, self.block_size))
            qlens.append(n - start)
            slens.append(n)
            if saves:
                new_full = range(r.hit_blocks, n // self.block_size)  # the new full blocks
                keys = self._keys(r)
                save_ids.extend(r.table[j] for j in new_full)
                save_keys.extend(keys[j] for j in new_full)
                r.result.saved_blocks = len(new_full)
            r.result.variant = variant
        inputs = self._inputs(reqs, ids, pos, slots, qlens, slens, save_ids)
        return ScheduledStep(variant, "prefill", tuple(reqs), inputs, saves, tuple(save_ids), tuple(save_keys))

    def _decode_step(self, reqs: list[Request]) -> ScheduledStep:
        ids, pos, slots, slens = [], [], [], []
        for r in reqs:
            p = r.cached
            self._ensure_blocks(r, p + 1)
            ids.append(torch.tensor([r.result.tokens[-1]], dtype=torch.long))
            pos.append(torch.tensor([p], dtype=torch.long))
            slots.append(slot_mapping(r.table, p, p + 1, self.block_size))
            slens.append(p + 1)
        inputs = self._inputs(reqs, ids, pos, slots, [1] * len(reqs), slens, [])
        return ScheduledStep(self.variant_for("decode", False), "decode", tuple(reqs), inputs, False)

    @staticmethod
    def _inputs(reqs, ids, pos, slots, qlens, slens, save_ids) -> StepInputs:
        width = max(len(r.table) for r in reqs)
        tables = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            tables[i, :len(r.table)] = torch.tensor(r.table, dtype=torch.long)
        q = torch.tensor(qlens, dtype=torch.long)
        return StepInputs(
            input_ids=torch.cat(ids), positions=torch.cat(pos), slot_mapping=torch.cat(slots),
            block_tables=tables, seq_lens=torch.tensor(slens, dtype=torch.long), query_lens=q,
            logits_indices=torch.cumsum(q, 0) - 1, save_block_ids=torch.tensor(save_ids, dtype=torch.long))
