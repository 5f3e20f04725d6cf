"""What happens to a full KV block after the step that fills it: whether and when it is saved to the
pool (``pool.policy``, ``pool.save_decode``) and where it goes when its request lets it go (the
device prefix cache, ``pool.device_cache``). The scheduler's block bookkeeping; docs/runtime.md
(scheduling policy, items 9-11) has the rules and the tests that prove them.

* **Write policies** — of the blocks a step would save (a prefill chunk's completed blocks, the
  blocks decode rows fill): ``write_through`` saves them with that step; ``write_through_selective``
  the same, but a block only once its key has been computed ``pool.min_uses`` times (a count per
  key in an LRU map of at most ``USES_CAPACITY`` keys: a key pushed out starts again at 0);
  ``write_back`` saves none when filled: the step's blocks are marked dirty when it lands, and a
  dirty block is saved when it leaves the device (its last holder frees it, or the device prefix
  cache evicts it). The save rides in the next plan (`take_write_backs`: the runner saves it from
  the cache, pinned until its commit); until that plan has landed the scheduler keeps one reference
  of its own on the block (vLLM's delayed free), so it is never reused before the runner pinned it.
  Those blocks come back (`written_back`) once the plan has landed: an allocation that needs them
  waits for that step (``coming``) instead of preempting or failing a request.
* **Decode-time saves** — a decode row whose positions hold a block's last slot fills it; decode
  graphs have no save program, so the plan asks the runner to save such blocks from the cache once
  the step's forward is done (`decode_saves`, when the row's tokens are final: `Scheduler.finalize`).
* **Device prefix cache** — a released request's full blocks whose KV has landed
  (``Request.computed``) stay on the device (`DevicePrefixCache`, one reference of its own).

Every rank of a tensor-parallel engine sees the same steps, so every rank decides alike (each for
its own shard's keys).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Callable, Optional

from ..core.kvcache import BlockAllocator, OutOfBlocks
from .device_cache import DevicePrefixCache
from .request import Request, RowPlan, StepPlan

__all__ = ["BlockLife", "USES_CAPACITY"]

USES_CAPACITY = 1 << 16  # write_through_selective: keys whose computations are counted (LRU)


class BlockLife:
    def __init__(self, spec, alloc: BlockAllocator, block_keys: Callable, *, device_cache: bool):
        pool = spec.pool
        self.alloc = alloc
        self.block_size = spec.kv_cache.block_size
        self.block_keys = block_keys  # the loader's: pool keys of a sequence's full blocks
        self.writes = pool.write != "off"
        self.save_decode = pool.save_decode and self.writes
        self.policy = pool.policy
        self.min_uses = pool.min_uses
        self._write_backs: list[tuple[int, str]] = []  # left the device dirty, held, not in a plan yet
        self._in_plans: Counter[int] = Counter()  # held write-back blocks of plans that have not landed
        self._uses: OrderedDict[str, int] = OrderedDict()  # selective: key -> times computed
        self._dirty: dict[int, str] = {}  # write_back: block id -> key, filled and not saved yet
        self.device_cache: Optional[DevicePrefixCache] = \
            DevicePrefixCache(alloc, self._write_back) if device_cache else None

    # ---- when a block is saved ----------------------------------------------------------------
    def selected(self, pairs: list[tuple[int, str]]) -> list[tuple[int, str]]:
        """The (block, key) pairs a filling step saves: all (write_through), those whose key has now
        been computed ``min_uses`` times (write_through_selective, counting this time), none
        (write_back: see `landed`)."""
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

    def landed(self, row: RowPlan, blocks: range, keys: list[str]) -> None:
        """A prefill row that would have saved ``blocks`` ran: under write_back they are dirty now
        (their KV is in the cache) until they leave the device."""
        if self.policy == "write_back":
            self._dirty.update((row.block_table[j], keys[j]) for j in blocks)

    def _filled(self, row: RowPlan) -> list[tuple[int, str]]:
        """(block, key) of the full blocks decode row ``row`` fills: block ``j`` is filled by the row whose
        positions hold its last slot (``row``'s tokens final). Prefill rows save through their variant."""
        filled = range(row.start // self.block_size, row.seq_len // self.block_size)
        if not self.save_decode or not row.decode or row.request.finished or not filled:
            return []
        seq_keys = self.block_keys(row.request.seq[:row.seq_len], row.request.lora_salt)  # the chain through its last token
        return [(row.block_table[j], seq_keys[j]) for j in filled]

    def decode_saves(self, row: RowPlan) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """``pool.save_decode``: the blocks decode row ``row`` fills and their keys, which the runner saves
        from the cache after the step's forward (write_through; write_through_selective: those
        `selected`). None under write_back: they become dirty when the step lands (`landed_decode`)."""
        if self.policy == "write_back":
            return (), ()
        pairs = self.selected(self._filled(row))
        return tuple(b for b, _ in pairs), tuple(k for _, k in pairs)

    def landed_decode(self, plan: StepPlan) -> None:
        """write_back: the blocks the decode rows of ``plan`` (landed) filled are dirty now."""
        if self.policy == "write_back":
            for row in plan.rows:
                self._dirty.update(self._filled(row))

    def completed(self, r: Request, start: int, end: int) -> range:
        """The full blocks a prefill row of ``r`` over ``[start, end)`` completes and would save: from
        the first one not loaded nor saved by an earlier chunk (a fork: none of its prompt's
        blocks, its parent saves them)."""
        first = max(r.hit_blocks, start // self.block_size)
        if r.shared_blocks:
            first = max(first, len(r.prompt) // self.block_size)
        return range(first, end // self.block_size)

    # ---- where a released block goes, and how it comes back ----------------------------------
    def take_prefix(self, r: Request, keys: list[str], loader, alloc: Callable[[int], list[int]]) -> bool:
        """Admission of ``r`` (table empty) whose leading full blocks have ``keys``: the leading run
        found in the device prefix cache is shared (nothing to load: ``r.device_blocks``), then the
        pool is looked up for the rest and its leading run loaded into fresh blocks after them
        (``r.loaded``; a load cut short leaves the rest to recompute). ``alloc``: the scheduler's
        (it evicts cached blocks first). False (nothing taken): the run needs blocks held for
        write-backs (``coming``), so the admission waits for the step that frees them."""
        if self.device_cache is not None:
            r.table.extend(self.device_cache.leading(keys))
            r.device_blocks = len(r.table)
            r.computed = r.device_blocks * self.block_size
        dev = r.device_blocks
        run = loader.lookup(keys[dev:]) if dev < len(keys) else 0
        if run:
            try:
                r.table.extend(alloc(run))
            except OutOfBlocks:
                if self.coming:
                    self.alloc.free(r.table)
                    r.table.clear()
                    r.device_blocks = r.computed = 0
                    return False
                return True  # no room to load into: recompute (the prefill may still find blocks later)
            r.loaded = loader.load(keys[dev:dev + run])  # a LoadedBlocks run (sliced, never copied)
            if len(r.loaded) < run:  # the rest of the run is recomputed into fresh blocks
                self.alloc.free(r.table[dev + len(r.loaded):])
                del r.table[dev + len(r.loaded):]
        return True

    def release(self, r: Request) -> None:
        """Before ``r``'s table is freed: its landed full blocks go to the device prefix cache, and
        the dirty blocks it holds last (not kept there) are written back (held until then)."""
        if self.device_cache is not None:
            full = min(r.computed // self.block_size, len(r.table))
            keys = self.block_keys(r.seq[:full * self.block_size], r.lora_salt) if full else []
            for j in range(full):
                self.device_cache.insert(r.table[j], keys[j])
        if self._dirty:
            for b in [b for b in r.table if b in self._dirty and self.alloc.refcount(b) == 1]:
                self._hold(b, self._dirty.pop(b))

    def evict(self, n: int) -> bool:
        """Free up to ``n`` device-cached blocks nobody uses (LRU); whether any went."""
        return self.device_cache is not None and self.device_cache.evict(n) > 0

    def clear(self) -> None:
        """Drop the device prefix cache (shutdown, after an error): written back first."""
        if self.device_cache is not None:
            self.device_cache.clear()

    def _write_back(self, block_id: int, key: str) -> None:
        """A block leaving the device cache: written back when it is dirty (write_back)."""
        if self._dirty.pop(block_id, None) is not None:
            self._hold(block_id, key)

    # ---- write-backs: held until the plan that saves them has landed ----------------------------
    def _hold(self, block_id: int, key: str) -> None:
        if not self.writes:
            return  # nothing is saved: the block goes back at once
        self.alloc.share([block_id])  # the scheduler's own reference: the block's last holder frees it now
        self._write_backs.append((block_id, key))

    @property
    def write_backs_pending(self) -> bool:
        """Write-backs no plan carries yet (a step must run them, with a forward or without)."""
        return bool(self._write_backs)

    @property
    def coming(self) -> int:
        """Held write-back blocks: free once the plan that saves them has landed."""
        return len(self._write_backs) + sum(self._in_plans.values())

    def take_write_backs(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The write-backs the next plan carries (`Scheduler.finalize`)."""
        taken, self._write_backs = self._write_backs, []
        self._in_plans.update(b for b, _ in taken)
        return tuple(b for b, _ in taken), tuple(k for _, k in taken)

    def written_back(self, block_ids) -> None:
        """A plan carrying ``block_ids`` landed: the runner pinned them for their commit, the hold goes."""
        self._in_plans.subtract(block_ids)
        self._in_plans = +self._in_plans
        self.alloc.free(block_ids)

    def drop_write_backs(self, pending: bool) -> None:
        """After an error: the holds of plans that will never land go (their saves ran, pinned, or never
        will); with ``pending``, also those no plan carries (their KV is not saved: a recompute later)."""
        held = list(self._in_plans.elements()) + ([b for b, _ in self._write_backs] if pending else [])
        self._in_plans = Counter()
        if pending:
            self._write_backs = []
        self.alloc.free(held)
