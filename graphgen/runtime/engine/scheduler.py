"""The scheduler: which requests run in the next step, with which variant, in which KV blocks.

It is per step: ``add`` queues requests, ``schedule()`` returns the next `StepPlan` (or None when
nothing can run now: per request, the tokens it feeds, its positions, block table, the blocks it
loads and saves and the logits it needs; no tensors), ``finalize(plan)`` completes a plan made ahead
just before it runs, and ``update(plan, tokens)`` takes that step's sampled tokens back. Requests move
``waiting -> prefill (admitted) -> running -> finished`` and back to ``waiting`` when preempted.

Policy (continuous batching; see docs/runtime.md):

* **Admission.** Waiting requests are admitted in arrival order while fewer than ``max_num_seqs``
  are admitted or running and the admitted prefill tokens fit ``max_num_batched_tokens``:
  the pool prefix is looked up and loaded through the loader.
* **Prefill first.** If any admitted request awaits its prefill, the step is a prefill of the
  variant of the oldest one (no history: ``mempool_prefill``; with a loaded prefix or an earlier
  chunk in the cache: ``splitfuse``), holding every admitted request of that variant, in order,
  while the step's tokens fit the budget. Prefills never preempt: one whose blocks cannot be had
  waits.
* **Chunked prefill** (``chunked_prefill``, on by default). A prompt longer than what is left of
  the step's budget (or than ``long_prefill_token_threshold`` when set: a prompt longer than it
  gets at most that many tokens per step) runs in chunks, one per step: chunk k > 0 is a
  prefill with history (its history is the earlier chunks' KV, already in the device cache);
  only the last chunk samples. Each chunk saves the full blocks it completes (a block that
  straddles two chunks is saved by the step that completes it). **Decode first, then chunks**:
  while a prompt is mid-way, every chunk step is followed by a decode step of the running
  requests, so a long prompt arriving delays a decode by at most one chunk. Without chunking
  the first request of a step always goes whole (a prompt over the budget is one oversized step).
* **Decode** every running request whose next input is known or pending (at most one step
  ahead) and that still needs a token, oldest first, up to the budget.
* **Preemption.** When a decode needs a block and none is free (after ``reclaim``: waiting for
  the oldest pending commit), the newest request not in a step in flight is preempted: its blocks
  are freed and it goes back to the head of the waiting queue; its generated tokens are kept and
  its next prefill recomputes prompt + tokens (pool hits included). A request that cannot fit
  even alone finishes with ``"error"`` (`OutOfBlocks` in ``error``).

* **Forks** (``n`` / ``best_of``: ``add(child, fork_of=parent)``). A child of a parent with the
  same prompt is *held* until the parent's prefill step that covers its first
  ``(len(prompt) - 1) // block_size`` blocks (the shared blocks: full, and never the one holding
  the last prompt token) has landed; then it takes one reference on each of them
  (``BlockAllocator.share``) and is admitted with those positions cached: its prefill computes
  only the rest of the prompt (1 to ``block_size`` tokens, recomputed per child rather than
  copied: no cache copy exists in any runner) as a prefill with history, and samples its first
  token from its own logits with its own sampler. The prompt runs once (the ``prefills`` count),
  the tails once per child. Children forked bypass ``max_num_seqs`` (a group is admitted together).
  A parent aborted or failed before that releases its held children as ordinary requests (the
  engine aborts them first when the parent's abort covers its forks); a child preempted later
  drops its references and is recomputed as an ordinary request (pool hits included).

* **Write policies** (``pool.policy``; the blocks a step would save, prefill or decode):
  ``write_through`` saves them with the step that fills them; ``write_through_selective`` the
  same, but a block only once its key has been computed ``pool.min_uses`` times (a count per key
  in an LRU map of at most ``USES_CAPACITY`` keys: a key pushed out starts again at 0);
  ``write_back`` saves none when filled: the step's blocks are marked dirty when it lands, and a
  dirty block is saved when its last holder frees it (finish, abort, preemption) — pinned by that
  save (``save_blocks``, the connector's ``save_filled``) before it is freed, so it is never reused
  before its commit.

* **Device prefix cache** (``pool.device_cache``, off by default; needs ``prefix_cache`` and a
  prefill variant with history). A released request's full blocks whose KV has landed stay on the
  device in a `DevicePrefixCache` (one reference of its own, LRU by key). Admission takes the
  leading run of a prompt's keys found there first (shared, no load: ``device_hit_blocks``), then
  looks the pool up for the rest. When an allocation finds no free block, the least recently used
  cached blocks nobody else holds are evicted first (written back first under ``write_back``).

Block accounting: a request's ``table`` lists its device blocks (refcount 1 each, taken from the
shared `BlockAllocator`, plus a forked child's shared references); they go back when it finishes,
is aborted or preempted — once no step in flight still writes them — and a shared block returns
to the free list only when its last holder drops it. Blocks whose save is still in flight stay
pinned by the connector, so freeing never waits for a save.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from dataclasses import replace
from typing import Callable, Optional, Protocol, Sequence

from ..core.kvcache import BlockAllocator, OutOfBlocks
from .device_cache import DevicePrefixCache
from .request import PENDING, Request, RowPlan, StepPlan

__all__ = ["Scheduler", "PrefixSource", "DEFAULT_MAX_NUM_SEQS", "DEFAULT_MAX_NUM_BATCHED_TOKENS"]

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
USES_CAPACITY = 1 << 16  # write_through_selective: keys whose computations are counted (LRU)


class PrefixSource(Protocol):
    """The connector's scheduler side (see `graphgen.runtime.engine.kv_load.KVLoader`)."""

    def block_keys(self, prompt: Sequence[int]) -> list[str]: ...
    def lookup(self, keys: Sequence[str]) -> int: ...
    def load(self, keys: Sequence[str]) -> list: ...  # the leading blocks fetched, one staging each


def _wants_prompt_logits(r: Request) -> bool:
    """A request asking for prompt logprobs whose first token is not sampled yet."""
    return r.sampling.prompt_logprobs is not None and not r.result.tokens


def _prefill_logits_positions(r: Request, start: int, end: int) -> tuple[int, ...]:
    """Its last position's logits; every position's for a prompt-logprobs request's first prefill
    (such a request is never chunked: its prompt is one row)."""
    if start == 0 and _wants_prompt_logits(r):
        return tuple(range(end))
    return (end - start - 1,)


class Scheduler:
    def __init__(self, spec, alloc: BlockAllocator, loader: PrefixSource, *,
                 reclaim: Callable[[], bool] = lambda: False,
                 save_blocks: Callable[[list, list], None] = lambda ids, keys: None,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, chunked_prefill: bool = True,
                 long_prefill_token_threshold: int = 0):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: off)")
        self.spec = spec
        self.block_size = spec.kv_cache.block_size
        self.alloc = alloc
        self.loader = loader
        self.reclaim = reclaim  # release pinned blocks (True if it may have); False: nothing to wait for
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # chunks are prefills with history: without such a variant a prompt always runs whole
        self.chunked_prefill = chunked_prefill and self.variant_for("prefill", True) is not None
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self._chunk_turn = False  # the last step left a prompt mid-way: a decode step goes next
        self.prefix_cache = "prefix_cache" in spec.features
        self.save_decode = spec.pool.save_decode and spec.pool.write != "off"
        self.policy = spec.pool.policy
        self.min_uses = spec.pool.min_uses
        self.save_blocks = save_blocks  # (block ids, keys): pin now, commit (write-back saves)
        self._uses: OrderedDict[str, int] = OrderedDict()  # selective: key -> times computed
        self._dirty: dict[int, str] = {}  # write_back: block id -> key, filled and not saved yet
        self.device_cache = (DevicePrefixCache(alloc, self._write_back)
                             if spec.pool.device_cache and self.prefix_cache
                             and self.variant_for("prefill", True) is not None else None)
        self.waiting: deque[Request] = deque()  # added or preempted, not admitted
        self.prefill: list[Request] = []        # admitted (prefix loaded), awaiting their prefill
        self.running: list[Request] = []        # prefill scheduled; decoding, in arrival order
        self.failed: list[Request] = []         # finished with "error" since the last take_failed()
        self.deferred: list[Request] = []       # finished, blocks still written by a step in flight
        self.held: list[Request] = []           # forks waiting for their parent's prompt blocks
        self.num_preemptions = 0
        # prompt prefills begun (a forked child's tail not counted), children forked, prefill tokens
        self.counts = {"prefills": 0, "forks": 0, "prefill_tokens": 0, "device_hit_blocks": 0}

    # ---- queues -----------------------------------------------------------------------------
    def add(self, request: Request, fork_of: Optional[Request] = None) -> None:
        """Queue ``request``; with ``fork_of`` (a live request with the same prompt) it shares that
        parent's prompt blocks once they are computed (see Forks above). A fork that cannot share
        (the parent is finished, the prompt fits in one block, no prefill variant with history, or
        it asks for prompt logprobs: its prefill must compute every position) is queued as usual."""
        if fork_of is not None and self._can_fork(request, fork_of):
            request.fork_parent = fork_of
            if fork_of in self.running and fork_of.result.tokens:
                self._fork(fork_of, [request])  # the parent's prefill has landed: share now
            else:
                self.held.append(request)
            return
        self.waiting.append(request)

    def _can_fork(self, r: Request, parent: Request) -> bool:
        return (not parent.finished and parent.prompt == r.prompt and self._shared_blocks(parent) > 0
                and self.variant_for("prefill", True) is not None
                and not _wants_prompt_logits(r) and not _wants_prompt_logits(parent))

    def _shared_blocks(self, parent: Request) -> int:
        """The parent's leading blocks a fork shares: full prompt blocks, the last prompt token excluded."""
        return (len(parent.prompt) - 1) // self.block_size

    def _fork(self, parent: Request, children: list[Request]) -> None:
        """``children`` take a reference on the parent's shared blocks (their KV is in the cache) and
        are admitted ahead of the other prefills, those positions cached."""
        n = self._shared_blocks(parent)
        ids = parent.table[:n]
        for c in children:
            self.alloc.share(ids)
            c.fork_parent, c.table, c.shared_blocks, c.cached = None, list(ids), n, n * self.block_size
            c.keys, c.hit_blocks, c.loaded, c.computed, c.device_blocks = None, 0, [], n * self.block_size, 0
        self.prefill[0:0] = children
        self.counts["forks"] += len(children)

    def _unhold(self, parent: Request) -> list[Request]:
        """The children still held for ``parent``, no longer held."""
        kids = [c for c in self.held if c.fork_parent is parent]
        for c in kids:
            self.held.remove(c)
            c.fork_parent = None
        return kids

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefill or self.running or self.held)

    def requests(self) -> list[Request]:
        return [*self.waiting, *self.prefill, *self.running, *self.held]

    def abort(self, r: Request, reason: str = "abort") -> None:
        """Finish ``r`` now. Its blocks go back at once, or — while a step in flight still writes
        them — when that step is updated (`update` / `finalize`). Pins keep in-flight saves safe."""
        if r.finished:
            return
        for q in (self.waiting, self.prefill, self.running, self.held):
            if r in q:
                q.remove(r)
        r.fork_parent = None
        self.waiting.extend(self._unhold(r))  # its prompt blocks will never come: they run alone
        r.result.finish_reason = reason
        self._maybe_release(r)

    def abort_all(self) -> None:
        """Drop every request and give its blocks back (after an error: no step is in flight)."""
        for r in [*self.requests(), *self.deferred]:
            r.in_steps = 0
            self.abort(r)
            self._maybe_release(r)
        if self.device_cache is not None:
            self.device_cache.clear()  # written back first under write_back

    def take_failed(self) -> list[Request]:
        out, self.failed = self.failed, []
        return out

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
    def schedule(self) -> Optional[StepPlan]:
        self._admit_waiting()
        if self._chunk_turn:  # decode first while a prompt is mid-way: one chunk between decodes
            plan = self._schedule_decode() or self._schedule_prefill()
        else:
            plan = self._schedule_prefill() or self._schedule_decode()
        if plan is not None:
            self._chunk_turn = plan.phase == "prefill" and not all(row.samples for row in plan.rows)
        return plan

    def finalize(self, plan: StepPlan) -> Optional[StepPlan]:
        """Just before a plan made ahead runs: drop the rows of requests that finished or were
        aborted since (their blocks go back), and fill in the decode tokens sampled since. None
        when no row is left."""
        rows = []
        for row in plan.rows:
            r = row.request
            if r.finished:
                r.in_steps -= 1
                self._maybe_release(r)
                continue
            if row.pending:  # a decode row: the token at its position was sampled by the last step
                row = replace(row, token_ids=tuple(r.seq[p] if t == PENDING else t
                                                   for p, t in zip(row.positions, row.token_ids)))
            rows.append(row)
        return plan.keep(rows) if rows else None

    def update(self, plan: StepPlan, tokens: Sequence[Optional[int]], logits=None) -> list[Request]:
        """Take the step's tokens (one per row; None for a row that does not sample); returns the
        requests that finished (their blocks are freed). ``logits``: per row, the sampled position's
        logits, kept when the caller collects them."""
        now = time.perf_counter()
        done = []
        for i, row in enumerate(plan.rows):
            r = row.request
            r.in_steps -= 1
            r.computed = max(r.computed, row.seq_len)  # the step ran: its KV is in the cache
            if r.finished:  # aborted while the step ran: its row is dropped
                self._maybe_release(r)
                continue
            if self.policy == "write_back" and plan.saves and plan.phase == "prefill":
                keys = self._keys(r)  # its KV is written now: dirty until the block leaves the device
                self._dirty.update((row.block_table[j], keys[j]) for j in self._completed(r, *row.chunk))
            if row.seq_len >= self._shared_blocks(r) * self.block_size and any(
                    c.fork_parent is r for c in self.held):
                self._fork(r, self._unhold(r))  # the shared blocks' KV is written: the forks take them
            tok = tokens[i]
            if tok is None:
                continue
            r.result.tokens.append(int(tok))
            if logits is not None:
                r.result.step_logits.append(logits[i].detach().float().clone())
            if len(r.result.tokens) == 1:
                r.result.ttft_ms = (now - r.t0) * 1e3
            reason = "stop" if tok in r.stop_token_ids else "length" if len(r.tokens) >= r.max_new_tokens else None
            if reason is not None:
                self.abort(r, reason)
                done.append(r)
        return done

    def decode_saves(self, plan: StepPlan) -> tuple[list[int], list[str]]:
        """``pool.save_decode``: the blocks the decode rows of ``plan`` (a step that has landed, its
        tokens finalized) filled, and their pool keys — a block ``j`` is filled by the row whose
        positions hold its last slot. Empty for a prefill step (it saves through its variant)."""
        pairs: list[tuple[int, str]] = []
        if not self.save_decode or plan.phase != "decode":
            return [], []
        for row in plan.rows:
            r = row.request
            filled = range(row.start // self.block_size, row.seq_len // self.block_size)
            if r.finished or not filled:
                continue
            seq_keys = self.loader.block_keys(r.seq[:row.seq_len])  # the chain through its last token
            pairs += [(row.block_table[j], seq_keys[j]) for j in filled]
        if self.policy == "write_back":
            self._dirty.update(pairs)  # the step has landed: saved when the block leaves
            return [], []
        pairs = self._selected(pairs)
        for row in plan.rows:
            row.request.result.saved_blocks += sum(1 for b, _ in pairs if b in row.block_table)
        return [b for b, _ in pairs], [k for _, k in pairs]

    def _selected(self, pairs: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """The (block, key) pairs a filling step saves: all (write_through), those whose key has now
        been computed ``min_uses`` times (write_through_selective, counting this time), none
        (write_back: saved when the block leaves the device)."""
        if self.policy == "write_back":
            return []
        if self.policy != "write_through_selective":
            return pairs
        out = []
        for b, k in pairs:
            n = self._uses.pop(k, 0) + 1
            self._uses[k] = n  # most recently used last
            if n >= self.min_uses:
                out.append((b, k))
        while len(self._uses) > USES_CAPACITY:
            self._uses.popitem(last=False)
        return out

    def _completed(self, r: Request, start: int, end: int) -> range:
        """The full blocks a prefill row of ``r`` over ``[start, end)`` completes and saves: from the
        first one not loaded nor saved by an earlier chunk (a fork: none of its prompt's blocks,
        its parent saves them)."""
        first = max(r.hit_blocks, start // self.block_size)
        if r.shared_blocks:
            first = max(first, len(r.prompt) // self.block_size)
        return range(first, end // self.block_size)

    # ---- internals: admission and prefill ---------------------------------------------------
    def _admit_waiting(self) -> None:
        pending = sum(len(r.seq) - r.cached for r in self.prefill)
        while (self.waiting and len(self.prefill) + len(self.running) < self.max_num_seqs
               and (not self.prefill or pending < self.max_num_batched_tokens)):
            r = self.waiting.popleft()
            self.prefill.append(r)  # before loading: an abort then frees what the load allocated
            self._admit(r)
            pending += len(r.seq) - r.cached

    def _admit(self, r: Request) -> None:
        """Look the sequence's prefix up in the pool and load the leading run of hits. At most
        ``(len-1)//block_size`` blocks: the last token is always computed (its logits)."""
        seq = r.seq
        r.keys, r.cached, r.hit_blocks, r.loaded, r.computed, r.device_blocks = None, 0, 0, [], 0, 0
        max_blocks = (len(seq) - 1) // self.block_size
        if _wants_prompt_logits(r):
            return  # every prompt position's logits are needed: no pool lookup (the prefill still saves)
        if not self.prefix_cache or max_blocks == 0 or self.variant_for("prefill", True) is None:
            return
        keys = self._keys(r)[:max_blocks]
        if self.device_cache is not None:  # device hits first: shared, nothing to load
            r.table.extend(self.device_cache.leading(keys))
            r.device_blocks = len(r.table)
            r.computed = r.device_blocks * self.block_size
            self.counts["device_hit_blocks"] += r.device_blocks
        dev = r.device_blocks
        run = self.loader.lookup(keys[dev:]) if dev < len(keys) else 0
        if run:
            try:
                r.table.extend(self._alloc(run))
            except OutOfBlocks:
                run = 0  # no room to load into: recompute (the prefill may still find blocks later)
        if run:
            r.loaded = list(self.loader.load(keys[dev:dev + run]))
            if len(r.loaded) < run:  # the rest of the run is recomputed into fresh blocks
                self.alloc.free(r.table[dev + len(r.loaded):])
                del r.table[dev + len(r.loaded):]
        r.hit_blocks = dev + len(r.loaded)
        if r.hit_blocks == 0:
            return
        r.cached = r.hit_blocks * self.block_size
        if not r.result.tokens and not r.result.preemptions:
            r.result.hit_tokens = r.cached

    def _keys(self, r: Request) -> list[str]:
        if r.keys is None:
            r.keys = self.loader.block_keys(r.seq)
        return r.keys

    def _schedule_prefill(self) -> Optional[StepPlan]:
        if not self.prefill:
            return None
        history = self.prefill[0].cached > 0  # a loaded prefix or an earlier chunk: with history
        chosen, tokens = [], 0
        for r in [r for r in self.prefill if (r.cached > 0) == history]:
            n = self._chunk_tokens(r, self.max_num_batched_tokens - tokens, first=not chosen)
            if n == 0:
                break
            if not self._try_blocks(r, r.cached + n):
                if (not chosen and not self.running and not self.deferred
                        and not any(o.in_steps for o in self.prefill)):  # no chunk in flight either
                    self._cannot_fit(r, r.cached + n)  # nothing else holds blocks that will come back
                    return self._schedule_prefill()
                break
            chosen.append((r, n))
            tokens += n
        if not chosen:
            return None
        for r, n in chosen:
            if r.cached + n == len(r.seq):  # its last chunk: it decodes from the next step on
                self.prefill.remove(r)
                self.running.append(r)  # before building: an abort then frees their blocks
        return self._prefill_step(chosen, history)

    def _chunk_tokens(self, r: Request, budget_left: int, first: bool) -> int:
        """How many of ``r``'s remaining prompt tokens this step computes (0: none, the step is
        full). Chunked: at most what is left of the budget and, for a prompt longer than
        ``long_prefill_token_threshold``, at most that; whole otherwise (the first request of a
        step always goes: an oversized prompt is one oversized step)."""
        n = len(r.seq) - r.cached
        if not self.chunked_prefill or _wants_prompt_logits(r):  # prompt logprobs: one row for the prompt
            return n if first or n <= budget_left else 0
        limit = budget_left
        if self.long_prefill_token_threshold and len(r.seq) > self.long_prefill_token_threshold:
            limit = min(limit, self.long_prefill_token_threshold)
        return max(0, min(n, limit))

    def _cannot_fit(self, r: Request, num_tokens: int) -> None:
        """Every other admitted request gives its blocks back; if ``r`` still does not fit it is
        failed (it can never run in this cache)."""
        for other in [o for o in self.prefill if o is not r][::-1]:
            self._preempt(other)
        if self._try_blocks(r, num_tokens):
            return
        err = None
        try:
            self._alloc(math.ceil(num_tokens / self.block_size) - len(r.table))
        except OutOfBlocks as e:
            err = e
        r.error = err
        self.abort(r, "error")
        self.failed.append(r)

    def _prefill_step(self, chosen: list[tuple[Request, int]], history: bool) -> StepPlan:
        variant = self.variant_for("prefill", history)
        saves = self.spec.variant_saves(self.spec.variants[variant])
        rows = []
        for r, n in chosen:
            if r.cached == r.hit_blocks * self.block_size and not r.shared_blocks:
                self.counts["prefills"] += 1  # its first chunk (a fork's tail is not a prompt prefill)
            self.counts["prefill_tokens"] += n
            rows.append(self._prefill_row(r, r.cached, r.cached + n, saves))
            r.loaded = []  # the plan carries them now
            if not r.result.variant:
                r.result.variant = variant
            r.cached += n
            r.in_steps += 1
        return StepPlan(variant, "prefill", tuple(rows), saves)

    def _prefill_row(self, r: Request, start: int, end: int, saves: bool) -> RowPlan:
        """``r`` computes positions ``[start, end)`` (its whole prompt or one chunk of it): it loads
        its pool blocks with its first chunk, saves the full blocks this chunk completes (from the
        first one not loaded or saved by an earlier chunk) and samples only with its last chunk."""
        seq = r.seq
        save_ids, save_keys = (), ()
        if saves:
            keys = self._keys(r)
            picked = self._selected([(r.table[j], keys[j]) for j in self._completed(r, start, end)])
            save_ids = tuple(b for b, _ in picked)
            save_keys = tuple(k for _, k in picked)
            r.result.saved_blocks += len(picked)
        last = end == len(seq)
        loads = len(r.loaded)  # non-empty only before its first chunk is planned
        return RowPlan(r, tuple(seq[start:end]), start, tuple(r.table),
                       load_block_ids=tuple(r.table[r.device_blocks:r.device_blocks + loads]), loaded=tuple(r.loaded),
                       save_block_ids=save_ids, save_keys=save_keys,
                       logits_positions=_prefill_logits_positions(r, start, end) if last else (), samples=last)

    # ---- internals: decode and preemption ---------------------------------------------------
    def _schedule_decode(self) -> Optional[StepPlan]:
        chosen: list[Request] = []
        for r in list(self.running):
            if len(chosen) >= self.max_num_batched_tokens:
                break
            if r not in self.running or r.in_steps > 1 or len(r.tokens) + r.in_steps >= r.max_new_tokens:
                continue  # preempted meanwhile, or its last token is already on its way
            while not self._try_blocks(r, r.cached + 1):
                victim = self._victim(exclude=chosen)
                if victim is None:
                    break
                self._preempt(victim)
                if victim is r:
                    break
            else:
                chosen.append(r)
        if not chosen:
            return None
        rows = []
        for r in chosen:
            p = r.cached
            # PENDING: sampled by the step in flight, filled in by finalize
            rows.append(RowPlan(r, (r.seq[p] if p < len(r.seq) else PENDING,), p, tuple(r.table),
                                logits_positions=(0,)))
            r.cached = p + 1
            r.in_steps += 1
        return StepPlan(self.variant_for("decode", False), "decode", tuple(rows), False)

    def _victim(self, exclude: list[Request]) -> Optional[Request]:
        """The newest request holding blocks that no step in flight uses: admitted ones first
        (they are newer than every running one), then running ones."""
        for r in [*self.prefill[::-1], *self.running[::-1]]:
            if r.table and r.in_steps == 0 and r not in exclude:
                return r
        return None

    def _preempt(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
            r.result.preemptions += 1
            self.num_preemptions += 1
        else:
            if r.cached > r.hit_blocks * self.block_size:  # mid-prompt: its chunks are recomputed
                r.result.preemptions += 1
                self.num_preemptions += 1
            self.prefill.remove(r)
        self._release(r)
        r.cached, r.hit_blocks, r.keys, r.loaded, r.shared_blocks = 0, 0, None, [], 0
        r.computed = r.device_blocks = 0
        self.waiting.appendleft(r)  # preempted newest first: the oldest ends up at the head

    # ---- internals: blocks ------------------------------------------------------------------
    def _alloc(self, n: int) -> list[int]:
        while True:
            try:
                return self.alloc.alloc(n)
            except OutOfBlocks:
                if self.device_cache is not None and self.device_cache.evict(n - self.alloc.num_free):
                    continue  # cached blocks nobody uses went back (or wait, pinned, for a write-back)
                if not self.reclaim():  # nothing in flight would ever give blocks back
                    raise

    def _try_blocks(self, r: Request, num_tokens: int) -> bool:
        need = math.ceil(num_tokens / self.block_size) - len(r.table)
        if need > 0:
            try:
                r.table.extend(self._alloc(need))
            except OutOfBlocks:
                return False
        return True

    def _release(self, r: Request) -> None:
        if r.table:
            r.loaded = []  # loaded blocks its prefill never took (preempted, aborted) are dropped
            if self.device_cache is not None:  # its landed full blocks stay on the device
                full = min(r.computed // self.block_size, len(r.table))
                keys = self.loader.block_keys(r.seq[:full * self.block_size]) if full else []
                for j in range(full):
                    self.device_cache.insert(r.table[j], keys[j])
            if self._dirty:  # write_back: its dirty blocks it holds last are saved (and pinned) first
                out = [(b, self._dirty.pop(b)) for b in r.table
                       if b in self._dirty and self.alloc.refcount(b) == 1]
                if out:
                    self.save_blocks([b for b, _ in out], [k for _, k in out])
            self.alloc.free(r.table)  # pinned blocks stay out of the free list until committed
            r.table = []

    def _write_back(self, block_id: int, key: str) -> None:
        """A block leaving the device cache: saved first when it is dirty (write_back)."""
        if self._dirty.pop(block_id, None) is not None:
            self.save_blocks([block_id], [key])

    def _maybe_release(self, r: Request) -> None:
        if r.in_steps > 0:
            if r.table and r not in self.deferred:
                self.deferred.append(r)
            return
        if r in self.deferred:
            self.deferred.remove(r)
        self._release(r)
