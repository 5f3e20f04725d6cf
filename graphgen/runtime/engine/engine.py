"""`Engine`: one process's engine, as a caller holds it — prompts in, tokens out.

It is the outer object over the parts `graphgen.runtime.engine.assembly.build_engine` wires
(pool, paged KV cache and allocator, the connector's two sides, model runner, scheduler) and
implements `EngineInterface` (what `graphgen.runtime.open_engine` returns for every target and
layout): ``generate`` (a loop over the step API), ``core`` (`EngineCore`, the step loop a server
drives directly), ``drain``, ``stats``, ``pool_stats``, ``observe``, the P/D reads (``kv_naming``,
``kv_pool``, ``saves_in_flight``), ``close``, ``max_model_len``. It owns no policy and no pool
logic, and calls nothing of the connector's worker side: waiting for commits goes through the
runner. See docs/runtime.md.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ...modelspec.model import ModelSpec
from ..core.faults import Faults
from ..core.kvcache import BlockAllocator, PagedKVCache
from ..pool.base import PoolBackend
from ..pool.keys import chain_digests, successor_keys
from .connector import KVConnector
from .engine_core import EngineCore
from .interface import CacheNaming
from .kv_load import KVLoader
from .request import RequestResult
from .scheduler import Scheduler

__all__ = ["Engine"]


class Engine:
    """An engine's parts and the calls a driver needs (`EngineInterface`, for one process). Built by
    `build_engine` (never by hand)."""

    def __init__(self, *, spec: ModelSpec, pool: PoolBackend, faults: Faults, cache: PagedKVCache,
                 alloc: BlockAllocator, loader: KVLoader, connector: KVConnector, runner, scheduler: Scheduler,
                 core: EngineCore, closers: Sequence = (), max_model_len: Optional[int] = None):
        self.spec, self.pool, self.faults = spec, pool, faults
        self.cache, self.alloc, self.loader, self.connector, self.runner = cache, alloc, loader, connector, runner
        self.scheduler, self.core = scheduler, core
        self.dtype = cache.dtype
        self.block_size = spec.kv_cache.block_size
        self.write = spec.pool.write
        self.collect_logits = core.collect_logits
        self.speculative = core.drafter is not None
        self._closers = list(closers)
        self._target_max_len = max_model_len  # a target's own limit (the NPU's largest bucket)
        # prompt + generated tokens one request may have: the device blocks, the model's positions,
        # a target's own limit. Not the step token budget: a longer prompt runs in chunks (or, with
        # chunked prefill off, as one oversized step)
        self.max_model_len = min(alloc.num_free * self.block_size,
                                 getattr(spec.dims, "max_position_embeddings", None) or 1 << 30,
                                 max_model_len or 1 << 30)

    @property
    def stats(self) -> dict:
        """``puts``, ``put_failures``, ``save_failures``, ``hit_blocks``, ``loaded_blocks``, ``pool_errors``."""
        return self.connector.stats  # the counters (both sides of the connector bump them)

    def pool_stats(self) -> dict:
        """The pool backend's own counters (a Mooncake pool: errors, rejected values, whether it is down)."""
        return self.connector.pool_stats()

    def observe(self, observer) -> None:
        """Attach a `graphgen.trace.StepObserver` (None detaches): the runner reports forward spans,
        save copies and save ends, the connector commits, the engine core its scheduling."""
        self.runner.observer = self.connector.observer = self.core.observer = observer

    # ---- P/D (graphgen.serve.pd): read-only, any thread ------------------------------------------
    def kv_naming(self) -> Optional[CacheNaming]:
        """How this engine names a prompt's blocks in its pool (what a P/D handoff sends)."""
        bs = self.block_size
        def salt_of(name: Optional[str]) -> str:  # a request's adapter -> its weight digest (its blocks' salt)
            return self.core.resolve_lora(name).digest if name else ""

        keys = self.loader.block_keys
        if self.speculative:  # the keys its scheduler looks up and its drafter saves under (successor token in each)
            def keys(p, salt=""):
                return successor_keys(self.loader, p, (len(p) - 1) // bs, salt)
        return CacheNaming(bs, self.cache.layout, lambda p, salt="": chain_digests(p, bs, salt), keys, salt_of,
                           lookahead=self.speculative)

    def kv_pool(self) -> PoolBackend:
        return self.pool

    def saves_in_flight(self) -> int:
        """Commits not landed yet (the runner's connector), safe from any thread."""
        return self.runner.saves_in_flight()

    def save_report(self):
        """The steps' saves as the scheduler took them (`RanksSaveReport` of one rank: shard ``(0, 1)``), the
        same shape as a multi-rank engine's (`DistributedEngine.save_report`)."""
        from .step_output import RanksSaveReport

        return RanksSaveReport.aggregate([(self.scheduler.saves, (0, 1), True)])

    @property
    def modules(self) -> dict:
        return self.runner.modules

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, *,
                 batch: bool = False, settle: bool = True, lora: Any = None) -> list[RequestResult]:
        """Greedy generation (a loop over ``self.core``'s step API). ``batch=False``: prompts run one
        after another; with ``settle`` (default) each prompt's saves are committed before the next
        prompt looks up the pool, so a repeated prompt deterministically hits (its own TTFT clock
        starts after that wait; an async save still never delays the first token of the prompt
        that made it). ``batch=True``: all prompts at once, continuously batched (prefills grouped
        by variant, decodes together, within ``max_num_seqs`` / ``max_num_batched_tokens``; when
        blocks run out the newest request is preempted and recomputed later). A prompt that cannot
        fit in the cache even alone raises `OutOfBlocks` (every request's blocks are given back).
        Not to be mixed with requests added to ``self.core`` directly. ``lora``: the LoRA adapter (name or
        `Adapter`) every prompt runs under, or a list of one per prompt (None: the base model)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        for p in prompts:
            if len(p) < 1:
                raise ValueError("empty prompt")
            if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= self.spec.dims.vocab_size
                   for t in p):
                raise ValueError(f"prompt token ids must be ints in [0, {self.spec.dims.vocab_size})")
            if self._target_max_len is not None and len(p) + max_new_tokens > self._target_max_len:
                raise ValueError(f"prompt of {len(p)} tokens + {max_new_tokens} new tokens exceeds max_model_len "
                                 f"{self._target_max_len} (the target's limit)")
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} adapters for {len(prompts)} prompts")
        for a in loras:
            self.core.resolve_lora(a)  # an unknown name is refused before anything runs
        pairs = list(zip(prompts, loras))
        groups = [pairs] if batch else [[p] for p in pairs]
        results: list[RequestResult] = []
        for i, group in enumerate(groups):
            if i and settle:
                self.drain()
            reqs = [self.core.add_request(None, list(p), max_tokens=max_new_tokens, lora=a) for p, a in group]
            while self.core.has_work():
                self.core.step()
                failed = next((r for r in reqs if r.finish_reason == "error"), None)
                if failed is not None:
                    # e.g. OutOfBlocks: a prompt longer than the cache. Blocks taken must not leak,
                    # or the engine stays short of blocks for good (pinned ones come back with
                    # their commit)
                    self.core.abort_all()
                    raise failed.error or RuntimeError(f"request {failed.req_id!r} failed")
            results.extend(r.result for r in reqs)
        return results

    def drain(self, timeout: Optional[float] = None) -> None:
        """Wait until every pending save has been committed to the pool (or failed; failures are
        logged and counted, never raised: a save that did not land only costs a later recompute)."""
        self.runner.drain_saves(timeout)

    def close(self) -> None:
        try:
            self.core.close()  # the runner, then its connector (pending commits land first)
        finally:
            for c in self._closers:
                c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

