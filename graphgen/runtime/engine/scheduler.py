"""The scheduler: which requests run in the next step, with which variant, in which KV blocks.

It is per step: ``add`` queues requests, ``schedule()`` returns the next `StepPlan` (or None when
nothing can run now: per request, the tokens it feeds, its positions, block table, the blocks it
loads and saves and the logits it needs; plain data but for the loaded pool blocks, see
`graphgen.runtime.engine.request`), ``finalize(plan)`` completes a plan made ahead just before it runs
(tokens, the saves the runner makes from the cache), and ``update(plan, output)`` takes that step's
`StepOutput` back (its sampled tokens, and its `SaveReport`: the ledger ``saves``, and a row's blocks
count as saved only where the runner says it pinned them). It calls nothing of the runner or of the
connector's worker side (its scheduler side, `PrefixSource`, it does): what the runner must save rides in the plan. Requests move ``waiting -> prefill (admitted) -> running ->
finished`` and back to ``waiting`` when preempted.

Policy (continuous batching; see docs/runtime.md):

* **Admission.** Waiting requests are admitted in arrival order while fewer than ``max_num_seqs``
  are admitted or running and the admitted prefill tokens fit ``max_num_batched_tokens``:
  the pool prefix is looked up and loaded through the loader.
* **Mixed batches** (``chunked_prefill``, on by default): decode rows first (one token each,
  oldest first), then admitted prompts in what is left of the budget, in one forward of the
  history variant; a prompt longer than that (or than ``long_prefill_token_threshold``) runs in
  chunks, each saving the full blocks it completes; only the last chunk samples.
* **Without chunking** a step is one variant, prefill first (the oldest admitted request's
  variant, whole prompts; the first always goes, oversized or not). Prefills never preempt.
* **Decode** every running request whose next input is known or pending (at most one step
  ahead) and that still needs a token, oldest first, up to the budget.
* **Preemption.** When a decode needs a block and none is free (after waiting for the commits
  whose pins hold the next free ones, `BlockAllocator.wait_unpinned`, or for the step that frees
  blocks held for write-backs), the newest request not in a step in flight is preempted: its blocks
  are freed and it goes back to the head of the waiting queue; its generated tokens are kept and
  its next prefill recomputes prompt + tokens (pool hits included). A request that cannot fit
  even alone finishes with ``"error"`` (`OutOfBlocks` in ``error``).
* **Forks** (``add(child, fork_of=parent)``, `Forks`): held until the parent's prompt blocks
  landed, then shared and admitted ahead of other prefills (outside ``max_num_seqs``).
* **Saves, released blocks** (`BlockLife`: ``pool.policy``, ``save_decode``, ``device_cache``);
  device prefix hits are taken before the pool lookup; an allocation evicts cached blocks first.
* **Speculative decoding** (`spec_decode`): a decode row carries the drafts (a verify row), one step
  of a request in flight at most; ``update`` rolls ``cached`` back to the accepted prefix.

Block accounting: a request's ``table`` lists its device blocks (its own, refcount 1, and a fork's
shared references); they go back when it finishes, is aborted or preempted — once no step in
flight still writes them —, a shared block when its last holder drops it. Blocks with a save in
flight stay pinned by the connector, so freeing never waits for a save.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Optional, Protocol, Sequence

from ..core.kvcache import BlockAllocator
from ..pool.keys import successor_keys
from .block_life import BlockLife
from .chunking import chunk_tokens, prefill_logits_positions, wants_prompt_logits
from .forks import Forks
from .preemption import Preemption
from .request import PENDING, Request, RowPlan, StepPlan
from .step_output import SaveLedger, StepOutput

__all__ = ["Scheduler", "PrefixSource", "DEFAULT_MAX_NUM_SEQS", "DEFAULT_MAX_NUM_BATCHED_TOKENS"]

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


class PrefixSource(Protocol):
    """The connector's scheduler side (see `graphgen.runtime.engine.kv_load.KVLoader`)."""

    def block_keys(self, prompt: Sequence[int], salt: str = "") -> list[str]: ...
    def lookup(self, keys: Sequence[str]) -> int: ...
    def load(self, keys: Sequence[str]) -> Sequence: ...  # the leading blocks fetched, one staging each


class Scheduler(Preemption):
    def __init__(self, spec, alloc: BlockAllocator, loader: PrefixSource, *, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, chunked_prefill: bool = True,
                 long_prefill_token_threshold: int = 0, num_speculative_tokens: int = 0):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: off)")
        self.spec = spec
        self._step_adapters: set = set()  # the LoRA adapters (digests) of the step being planned's decode rows
        self.block_size = spec.kv_cache.block_size
        self.alloc = alloc
        self.loader = loader
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # chunks are prefills with history: without such a variant a prompt always runs whole
        self.chunked_prefill = chunked_prefill and self.variant_for("prefill", True) is not None
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.prefix_cache = "prefix_cache" in spec.features
        self.num_speculative_tokens = num_speculative_tokens
        self.blocks = BlockLife(spec, alloc, loader.block_keys, device_cache=(
            spec.pool.device_cache and self.prefix_cache and self.variant_for("prefill", True) is not None
            and not num_speculative_tokens))  # device blocks are keyed without their successor token
        self.blocks.save_decode &= not num_speculative_tokens  # a verify row's KV is final only in part
        self.device_cache = self.blocks.device_cache
        self.waiting: deque[Request] = deque()  # added or preempted, not admitted
        self.prefill: list[Request] = []        # admitted (prefix loaded), awaiting their prefill
        self.running: list[Request] = []        # prefill scheduled; decoding, in arrival order
        self.failed: list[Request] = []         # finished with "error" since the last take_failed()
        self.deferred: list[Request] = []       # finished, blocks still written by a step in flight
        self.forks = Forks(alloc, self.block_size)
        self.held = self.forks.held             # forks waiting for their parent's prompt blocks
        self.num_preemptions = 0
        self.saves = SaveLedger()  # every step's SaveReport, taken in `update`
        self.counts = {"prefills": 0, "forks": 0, "prefill_tokens": 0, "device_hit_blocks": 0}

    # ---- queues -----------------------------------------------------------------------------
    def add(self, request: Request, fork_of: Optional[Request] = None) -> None:
        """Queue ``request``; with ``fork_of`` it shares that parent's prompt blocks once computed,
        unless it cannot (`Forks.can_share`, no history variant, prompt logprobs): then as usual."""
        if (fork_of is not None and self.forks.can_share(request, fork_of) and not self.num_speculative_tokens
                and self.variant_for("prefill", True) is not None
                and not wants_prompt_logits(request) and not wants_prompt_logits(fork_of)):
            if fork_of in self.running and fork_of.result.tokens:
                self._admit_forks(fork_of, [request])  # the parent's prefill has landed: share now
            else:
                self.forks.hold(request, fork_of)
            return
        self.waiting.append(request)

    def _admit_forks(self, parent: Request, children: list[Request]) -> None:  # ahead of other prefills
        self.forks.share(parent, children)
        self.prefill[0:0] = children
        self.counts["forks"] += len(children)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefill or self.running or self.held or self.blocks.write_backs_pending)

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
        self.waiting.extend(self.forks.take(r))  # its prompt blocks will never come: they run alone
        r.result.finish_reason = reason
        self._maybe_release(r)

    def abort_all(self) -> None:
        """Drop every request and give its blocks back (after an error: no step is in flight)."""
        for r in [*self.requests(), *self.deferred]:
            r.in_steps = 0
            self.abort(r)
            self._maybe_release(r)
        self.blocks.drop_write_backs(pending=False)  # plans that never land (settled first, or failed)
        self.blocks.clear()  # the device prefix cache, written back (by the next step) under write_back

    def hold_for_draft(self, r: Request) -> None:
        """Speculative: ``r`` finishes on the token its prompt's step sampled (``max_tokens`` 1 — a P/D
        prefill — or a stop token). Its prompt's blocks are saved, with their MTP KV, only by the draft run
        after that step (spec_decode.py): its blocks stay until `let_go` (the drafter's, once it ran)."""
        r.save_hold = True
        r.in_steps += 1

    def let_go(self, r: Request) -> None:
        """The draft run `hold_for_draft` waited for has run (or is not needed): the blocks go back."""
        if r.save_hold:
            r.save_hold = False
            r.in_steps -= 1
            self._maybe_release(r)

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
        self._step_adapters = set()
        self._admit_waiting()
        if self.chunked_prefill:  # mixed batches: decode rows first, then chunks, in one forward
            plan = self._schedule_mixed()
        else:
            plan = self._schedule_prefill() or self._schedule_decode()  # one variant per step
        return plan if plan is not None or not self.blocks.write_backs_pending else StepPlan.no_forward()

    def finalize(self, plan: StepPlan) -> Optional[StepPlan]:
        """Just before a plan made ahead runs: drop the rows of requests that finished or were
        aborted since (their blocks go back), fill in the decode tokens sampled since, and add the
        saves the runner makes from the cache after the forward: the blocks its decode rows fill
        (`BlockLife.decode_saves`) and the write-backs pending (`BlockLife.take_write_backs`). None
        when nothing is left to run."""
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
            if row.decode and self.blocks.save_decode:
                ids, keys = self.blocks.decode_saves(row)
                row = replace(row, cache_save_block_ids=ids, cache_save_keys=keys)
            rows.append(row)
        ids, keys = self.blocks.take_write_backs()
        return replace(plan, rows=tuple(rows), write_back_ids=ids, write_back_keys=keys) if rows or ids else None

    def update(self, plan: StepPlan, output: StepOutput) -> list:
        """Take the step's `StepOutput` back: its tokens (per row: a token, a verify row's tuple, or None)
        and kept logits (``collect_logits``). Returns the tokens each row's request took (a verify
        row's tuple cut at the first that finishes it); a finished request's blocks are freed, and
        the write-back blocks the plan carried (pinned by their commits now) go back."""
        now = time.perf_counter()
        pinned = self.saves.take(output.saves)  # what the runner did with the plan's saves
        tokens = list(output.tokens) if output.tokens is not None else [None] * len(plan.rows)
        logits = output.kept_logits
        self.blocks.landed_decode(plan)  # write_back: what its decode rows filled is dirty now
        for i, row in enumerate(plan.rows):
            r = row.request
            r.in_steps -= 1
            verified = tokens[i] if isinstance(tokens[i], tuple) else None
            if verified is not None:  # a verify row: its KV is final up to the accepted prefix
                r.cached = row.start + len(verified)  # roll back: the rejected drafts' KV is overwritten
            r.computed = max(r.computed, row.seq_len if verified is None else r.cached)  # its KV is in the cache
            if r.finished:  # aborted while the step ran: its row is dropped
                self._maybe_release(r)
                continue
            r.result.saved_blocks += sum(b in pinned for b in row.cache_save_block_ids)  # as the runner reported
            if plan.saves and not row.decode:  # a prefill row (a decode row saves as in decode_saves)
                self.blocks.landed(row, self.blocks.completed(r, *row.chunk), self._keys(r))
            if kids := self.forks.ready(r, row.seq_len):
                self._admit_forks(r, kids)  # the shared blocks' KV is written: the forks take them
            if tokens[i] is None:
                continue
            toks = verified or (tokens[i],)
            # a verify row's logits: row j decided emitted token j (the rows past the emitted ones are dropped)
            kept = None if logits is None else logits[i][:len(toks)] if verified else logits[i].reshape(1, -1)
            taken, reason = r.take(toks, kept, now)
            if verified:  # a verify row's entry: the tokens taken (tokens may be a tuple otherwise)
                tokens[i] = taken
            if reason is not None:
                if self.num_speculative_tokens and not row.decode:
                    self.hold_for_draft(r)
                self.abort(r, reason)
        self.blocks.written_back(plan.write_back_ids)
        return tokens

    # ---- internals: admission and prefill ---------------------------------------------------
    def _admit_waiting(self) -> None:
        pending = sum(len(r.seq) - r.cached for r in self.prefill)
        while (self.waiting and len(self.prefill) + len(self.running) < self.max_num_seqs
               and (not self.prefill or pending < self.max_num_batched_tokens)):
            r = self.waiting.popleft()
            self.prefill.append(r)  # before loading: an abort then frees what the load allocated
            if not self._admit(r):  # its pool hits need blocks held for write-backs: the next step frees them
                self.prefill.remove(r)
                self.waiting.appendleft(r)
                return
            pending += len(r.seq) - r.cached

    def _admit(self, r: Request) -> bool:
        """Take the sequence's prefix: device prefix hits, then the leading run of pool hits loaded
        (`BlockLife.take_prefix`). At most ``(len-1)//block_size`` blocks: the last token is always
        computed (its logits). False: not now (`BlockLife.take_prefix`)."""
        seq = r.seq
        r.keys, r.cached, r.hit_blocks, r.loaded, r.computed, r.device_blocks = None, 0, 0, [], 0, 0
        max_blocks = (len(seq) - 1) // self.block_size
        if wants_prompt_logits(r):
            return True  # every prompt position's logits are needed: no pool lookup (the prefill still saves)
        if not self.prefix_cache or max_blocks == 0 or self.variant_for("prefill", True) is None:
            return True
        if not self.blocks.take_prefix(r, self._keys(r)[:max_blocks], self.loader, self._alloc):
            return False
        self.counts["device_hit_blocks"] += r.device_blocks
        r.hit_blocks = r.device_blocks + len(r.loaded)
        if r.hit_blocks:
            r.cached = r.hit_blocks * self.block_size
            if not r.result.tokens and not r.result.preemptions:
                r.result.hit_tokens = r.cached
        return True

    def _keys(self, r: Request) -> list[str]:
        if r.keys is None:
            r.keys = successor_keys(self.loader, r.seq, (len(r.seq) - 1) // self.block_size, r.lora_salt) \
                if self.num_speculative_tokens else self.loader.block_keys(r.seq, r.lora_salt)
        return r.keys

    def _schedule_prefill(self) -> Optional[StepPlan]:
        while self.prefill:  # a prefill-only step of the oldest admitted request's variant
            history = self.prefill[0].cached > 0  # a loaded prefix or an earlier chunk: with history
            chosen = self._choose_chunks(self.max_num_batched_tokens, history)
            if chosen is not None:
                return self._step(chosen, [], history) if chosen else None
        return None

    def _lora_fits(self, r: Request, adapters: set) -> bool:
        """Whether ``r`` joins a step whose rows run under ``adapters`` (digests; added to when it does):
        at most ``lora.max_loras`` distinct adapters per step (base-model rows: any number)."""
        if r.lora is None or r.lora.digest in adapters:
            return True
        if self.spec.lora is None or len(adapters) >= self.spec.lora.max_loras:
            return False
        adapters.add(r.lora.digest)
        return True

    def _schedule_mixed(self) -> Optional[StepPlan]:
        """Decode rows first (a verify row would take k+1 tokens), then chunks in what is left; no
        decode row: a prefill-only step; no room for a chunk: a decode step."""
        decodes = self._choose_decodes(self.max_num_batched_tokens)
        self._step_adapters = {r.lora.digest for r in decodes if r.lora is not None}
        if not decodes:
            return self._schedule_prefill()
        left = self.max_num_batched_tokens - sum(1 + len(r.drafts) for r in decodes)
        chosen = (self._choose_chunks(left, None) or []) if left > 0 else []
        return self._step(chosen, decodes, True)

    def _choose_chunks(self, budget: int, history: Optional[bool]) -> Optional[list[tuple[Request, int]]]:
        """The admitted requests (of ``history``'s kind; None: any) and how many tokens each
        computes in this step, in order, within ``budget``; those whose prompt this step finishes
        move to running. None: a request that could never fit was failed, choose again."""
        chosen, tokens = [], 0
        adapters = set(self._step_adapters)
        for r in [r for r in self.prefill if history is None or (r.cached > 0) == history]:
            if not self._lora_fits(r, adapters):
                continue  # a step batches at most lora.max_loras distinct adapters: a later step takes it
            n = chunk_tokens(r, budget - tokens, not chosen, chunked=self.chunked_prefill,
                             threshold=self.long_prefill_token_threshold)
            if n == 0:
                break
            if not self.reserve(r, r.cached + n):
                if (not chosen and not self.running and not self.deferred and not self.blocks.coming
                        and not any(o.in_steps for o in self.prefill)):  # no chunk in flight either
                    self._cannot_fit(r, r.cached + n)  # nothing else holds blocks that will come back
                    return None
                break
            chosen.append((r, n))
            tokens += n
        for r, n in chosen:
            if r.cached + n == len(r.seq):  # its last chunk: it decodes from the next step on
                self.prefill.remove(r)
                self.running.append(r)  # before building: an abort then frees their blocks
        return chosen

    def _step(self, chosen: list[tuple[Request, int]], decodes: list[Request], history: bool) -> StepPlan:
        """``decodes``' rows, then ``chosen``'s (a prompt or a chunk each): the decode variant for
        decode rows alone, else the prefill variant (with history when mixed)."""
        stalled = self._stalled([*decodes, *(r for r, _ in chosen)])
        rows = [r.plan_decode() for r in decodes]
        if not chosen:
            return StepPlan(self.variant_for("decode", False), "decode", tuple(rows), False,
                            decode_rows_stalled=stalled)
        variant = self.variant_for("prefill", history or bool(decodes))
        saves = self.spec.variant_saves(self.spec.variants[variant])
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
        return StepPlan(variant, "prefill", tuple(rows), saves, decode_rows_stalled=stalled)

    def _stalled(self, in_step: list[Request]) -> int:
        """Running requests that could decode but are not in this step: the decode stall."""
        return sum(1 for r in self.running
                   if r not in in_step and r.in_steps <= 1 and len(r.tokens) + r.in_steps < r.max_new_tokens)

    def _prefill_row(self, r: Request, start: int, end: int, saves: bool) -> RowPlan:
        """``r`` computes positions ``[start, end)`` (its whole prompt or one chunk of it): it loads
        its pool blocks with its first chunk, saves the full blocks this chunk completes (from the
        first one not loaded or saved by an earlier chunk) and samples only with its last chunk."""
        seq = r.seq
        save_ids, save_keys = (), ()
        if saves and not self.num_speculative_tokens:  # speculative: the first draft run saves them
            keys = self._keys(r)
            picked = self.blocks.selected([(r.table[j], keys[j]) for j in self.blocks.completed(r, start, end)])
            save_ids = tuple(b for b, _ in picked)
            save_keys = tuple(k for _, k in picked)
            r.result.saved_blocks += len(picked)
        last = end == len(seq)
        loads = len(r.loaded)  # non-empty only before its first chunk is planned
        return RowPlan(r, tuple(seq[start:end]), start, tuple(r.table),
                       load_block_ids=tuple(r.table[r.device_blocks:r.device_blocks + loads]),
                       loaded=tuple(r.loaded) if isinstance(r.loaded, list) else r.loaded,  # a LoadedBlocks: one run
                       save_block_ids=save_ids, save_keys=save_keys,
                       logits_positions=prefill_logits_positions(r, start, end) if last else (), samples=last)

    # ---- internals: decode and preemption ---------------------------------------------------
    def _schedule_decode(self) -> Optional[StepPlan]:
        decodes = self._choose_decodes(self.max_num_batched_tokens)
        return self._step([], decodes, False) if decodes else None

    def _choose_decodes(self, budget: int) -> list[Request]:
        """The running requests that decode in this step, oldest first, one token each within
        ``budget``, each with a block for its token (preempting the newest when none is free)."""
        chosen: list[Request] = []
        used = 0
        adapters: set = set()
        self._step_adapters = set()
        for r in list(self.running):
            width = min(1 + len(r.drafts), budget - used)  # a verify row: its last token and the drafts that fit
            if width < 1:
                break
            if r not in self.running or r.in_steps > (0 if self.num_speculative_tokens else 1) \
                    or len(r.tokens) + r.in_steps >= r.max_new_tokens:
                continue  # preempted meanwhile, its last token on its way, or (speculative) its start unknown
            if not self._lora_fits(r, set(adapters)):
                continue  # this step has lora.max_loras adapters already: a later one decodes it
            while not self.reserve(r, r.cached + width):
                victim = None if self.blocks.coming else self._victim(exclude=chosen)
                if victim is None:  # (blocks held for write-backs come back after the next step)
                    break
                self._preempt(victim)
                if victim is r:
                    break
            else:
                chosen.append(r)
                self._lora_fits(r, adapters)
                r.drafts, used = r.drafts[:width - 1], used + width
        return chosen
