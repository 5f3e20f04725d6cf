"""The engine: prompts in, tokens out — one object over the parts every target builds the same way.

`build_engine` is the one place an engine's parts are wired together, for every target and rank:
the pool (a URL or a backend, with injected faults), the paged KV cache and its block allocator,
the KV connector's two sides (`KVLoader` for the scheduler, `KVConnector` for the runner), a model runner (CPU, CPU rank, NPU: given as a factory), the `Scheduler` and the
step loop (`LLMEngine`). Targets differ only in what they hand it (cache shapes, device, connector
and runner factories, what to close); no engine class re-implements another's construction.
`cpu_engine` is the CPU target's (and, with a rank's runtime, shapes and connector, a CPU rank's).
Callers normally go through `graphgen.runtime.open_engine`, which loads the spec and the weights.

One step (`LLMEngine.step`): ``schedule()`` -> the runner's ``submit``/``collect`` (it builds its
inputs from the plan, pins and stages the save, runs the module, hands the save to the connector:
commit after the save's event, inline for sync, on the host stream for async) -> sample -> the
scheduler's ``update``. ``generate`` is a loop over that step API (``Engine.llm``); a server drives
``Engine.llm`` directly. See docs/runtime.md.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import torch

from ...modelspec.model import ModelSpec
from ..core.cpu_runtime import CpuRuntime, load_cpu_modules
from ..core.faults import Faults
from ..core.kvcache import BlockAllocator, PagedKVCache, kv_cache_shapes
from ..core.weights import place_weights
from ..pool import DEFAULT_POOL_BYTES, PoolBackend, make_pool
from ..pool.faulty import wrap_pool
from .connector import KVConnector
from .kv_load import Counters, KVLoader
from .request import RequestResult
from .runner import CpuModelRunner
from .scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Scheduler
from .spec_decode import MtpDrafter, check_speculative
from .step_loop import LLMEngine

__all__ = ["Engine", "build_engine", "cpu_engine"]


class Engine:
    """An engine's parts and the calls a driver needs. Built by `build_engine` (never by hand)."""

    def __init__(self, *, spec: ModelSpec, pool: PoolBackend, faults: Faults, cache: PagedKVCache,
                 alloc: BlockAllocator, loader: KVLoader, connector: KVConnector, runner, scheduler: Scheduler,
                 llm: LLMEngine, closers: Sequence = (), max_model_len: Optional[int] = None):
        self.spec, self.pool, self.faults = spec, pool, faults
        self.cache, self.alloc, self.loader, self.connector, self.runner = cache, alloc, loader, connector, runner
        self.scheduler, self.llm = scheduler, llm
        self.dtype = cache.dtype
        self.block_size = spec.kv_cache.block_size
        self.write = spec.pool.write
        self.collect_logits = llm.collect_logits
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
        return self.connector.stats

    def pool_stats(self) -> dict:
        """The pool backend's own counters (a Mooncake pool: errors, rejected values, whether it is down)."""
        return self.connector.pool_stats()

    def observe(self, observer) -> None:
        """Attach a `graphgen.trace.StepObserver` (None detaches): the runner reports forward spans,
        save copies and save ends, the connector commits, the step engine its scheduling."""
        self.runner.observer = self.connector.observer = self.llm.observer = observer

    @property
    def modules(self) -> dict:
        return self.runner.modules

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, *,
                 batch: bool = False, settle: bool = True) -> list[RequestResult]:
        """Greedy generation (a loop over ``self.llm``'s step API). ``batch=False``: prompts run one
        after another; with ``settle`` (default) each prompt's saves are committed before the next
        prompt looks up the pool, so a repeated prompt deterministically hits (its own TTFT clock
        starts after that wait; an async save still never delays the first token of the prompt
        that made it). ``batch=True``: all prompts at once, continuously batched (prefills grouped
        by variant, decodes together, within ``max_num_seqs`` / ``max_num_batched_tokens``; when
        blocks run out the newest request is preempted and recomputed later). A prompt that cannot
        fit in the cache even alone raises `OutOfBlocks` (every request's blocks are given back).
        Not to be mixed with requests added to ``self.llm`` directly."""
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
        groups = [list(prompts)] if batch else [[p] for p in prompts]
        results = []
        for i, group in enumerate(groups):
            if i and settle:
                self.drain()
            reqs = [self.llm.add_request(None, list(p), max_tokens=max_new_tokens) for p in group]
            while self.llm.has_work():
                self.llm.step()
                failed = next((r for r in reqs if r.finish_reason == "error"), None)
                if failed is not None:
                    # e.g. OutOfBlocks: a prompt longer than the cache. Blocks taken must not leak,
                    # or the engine stays short of blocks for good (pinned ones come back with
                    # their commit)
                    self.llm.abort_all()
                    raise failed.error
            results.extend(r.result for r in reqs)
        return results

    def drain(self, timeout: Optional[float] = None) -> None:
        """Wait until every pending save has been committed to the pool (or failed; failures are
        logged and counted, never raised: a save that did not land only costs a later recompute)."""
        self.connector.drain(timeout)

    def close(self) -> None:
        try:
            self.llm.close()
            self.connector.close()
        finally:
            for c in self._closers:
                c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def build_engine(spec: ModelSpec, *, kv_shapes: dict, make_runner: Callable, pool: Union[str, PoolBackend] = "host",
                 pool_capacity_bytes: int = DEFAULT_POOL_BYTES, faults: Optional[Faults] = None,
                 num_blocks: Optional[int] = 512, reserved_blocks: int = 0, device: str = "cpu", dtype=None,
                 make_connector: Optional[Callable] = None, make_loader: Optional[Callable] = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, async_scheduling: bool = False,
                 chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 collect_logits: bool = False, eos_token_ids: Iterable[int] = (), closers: Sequence = (),
                 max_model_len: Optional[int] = None, num_speculative_tokens: int = 0,
                 load_weights: Optional[Callable[[], None]] = None,
                 size_kv: Optional[Callable[[int], int]] = None) -> Engine:
    """Wire an engine. ``kv_shapes``: cache component -> per-block shape (``[BS, ...]``);
    ``make_runner(cache, alloc, connector, reserved)`` -> the model runner (``reserved``: blocks
    taken from the allocator for the target's own use, e.g. the NPU's padding block);
    ``make_loader(pool, cache, counters)`` -> the connector's scheduler side (default: a `KVLoader`
    keyed by the spec's name); ``make_connector(pool, cache, alloc, counters)`` -> its worker side
    (default: a `KVConnector` writing as ``pool.write``). ``num_speculative_tokens`` K > 0: every
    request decodes speculatively with the spec's MTP layer, K drafts per verify row
    (`spec_decode.MtpDrafter`; ValueError in one sentence for a spec without MTP layers).

    The order on a device: ``load_weights()`` first (a target that places its weights itself), then the
    KV cache, sized by ``size_kv(bytes of one block)`` when ``num_blocks`` is None (from what the weights
    left, `graphgen.runtime.core.device_memory.kv_blocks_that_fit`), then the runner."""
    if num_blocks is None and size_kv is None:
        raise ValueError("num_blocks=None needs a size_kv (the KV cache sized from the device's free memory)")
    if num_blocks is not None and (not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1):
        raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    faults = faults or Faults()
    if num_speculative_tokens:
        check_speculative(spec, num_speculative_tokens)  # before anything is started
    if isinstance(pool, str):  # "host" or "mooncake://HOST:PORT[?opts]" (Mooncake imported lazily)
        pool = make_pool(pool, capacity_bytes=pool_capacity_bytes)
    if faults.active:
        pool = wrap_pool(pool, faults)
    dtype = dtype or getattr(torch, spec.kv_cache.dtype)
    if load_weights is not None:  # the weights before the cache: it is sized from what they leave
        load_weights()
    if num_blocks is None:
        assert size_kv is not None  # num_blocks=None without size_kv was refused above
        per_block = spec.kv_layers * sum(math.prod(s) for s in kv_shapes.values()) * dtype.itemsize
        num_blocks = size_kv(per_block) - reserved_blocks
        if num_blocks < 1:
            raise ValueError(f"no device memory is left for the KV cache after the weights (one block: "
                             f"{per_block / (1 << 20):.1f} MiB): use more ranks (--tp), or a larger device")
    total = num_blocks + reserved_blocks
    cache = PagedKVCache(spec.kv_layers, kv_shapes, total, dtype, device=device)
    alloc = BlockAllocator(total)
    reserved = alloc.alloc(reserved_blocks) if reserved_blocks else []  # never freed
    counters = Counters()
    loader = (make_loader or (lambda p, c, n: KVLoader(p, c, model=spec.name, stats=n)))(pool, cache, counters)
    connector = (make_connector or (lambda p, c, a, n: KVConnector(p, c, a, write=spec.pool.write, stats=n)))(
        pool, cache, alloc, counters)
    runner = make_runner(cache, alloc, connector, reserved)
    scheduler = Scheduler(spec, alloc, loader, reclaim=connector.wait_oldest, save_blocks=connector.save_filled,
                          max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, chunked_prefill=chunked_prefill,
                          long_prefill_token_threshold=long_prefill_token_threshold,
                          num_speculative_tokens=num_speculative_tokens)
    drafter = MtpDrafter(spec, num_speculative_tokens, runner, cache, connector, scheduler) \
        if num_speculative_tokens else None
    llm = LLMEngine(scheduler, connector, runner, vocab_size=spec.dims.vocab_size,
                    async_scheduling=async_scheduling, eos_token_ids=eos_token_ids, collect_logits=collect_logits,
                    drafter=drafter)
    return Engine(spec=spec, pool=pool, faults=faults, cache=cache, alloc=alloc, loader=loader, connector=connector,
                  runner=runner, scheduler=scheduler, llm=llm, closers=closers, max_model_len=max_model_len)


def cpu_engine(spec: ModelSpec, weights: dict, *, spec_file: str = "", generated_dir: Optional[Path] = Path("generated"),
               source_hook: Optional[Callable[[str, str], str]] = None, sources: Optional[dict] = None,
               event_timeout: float = 120.0, runtime: Optional[CpuRuntime] = None,
               kv_shapes: Optional[dict] = None, faults: Optional[Faults] = None,
               runner_cls: type = CpuModelRunner, **options) -> Engine:
    """The CPU target's engine (one process). A CPU rank passes its own ``runtime`` (collectives),
    ``kv_shapes`` (its KV shard), ``make_loader``/``make_connector`` (its keys, agreed hits, save-once)
    and ``runner_cls`` (its plan check); ``sources``: {variant: module
    source} compiled by a parent process (default: compiled here). ``options``: `build_engine`'s."""
    faults = faults or Faults()
    if runtime is None:
        if spec.parallel.world > 1 or spec.parallel.ep > 1:
            raise ValueError(f"spec {spec.name} runs on {spec.parallel.world} ranks: use "
                             f"graphgen.runtime.open_engine (it starts the rank processes)")
        runtime = CpuRuntime(faults, event_timeout=event_timeout)
    if kv_shapes is None:
        shapes = kv_cache_shapes(spec.family, dataclasses.asdict(spec.dims), 1, spec.kv_cache.block_size)
        kv_shapes = {k: tuple(s[1:]) for k, s in shapes.items()}
    modules = load_cpu_modules(spec, spec_file, generated_dir=generated_dir, source_hook=source_hook, sources=sources)
    # computed in the spec's dtype (bf16 specs in bf16, as transformers runs a bf16 model), the
    # family's float32 keys (router weight, score bias) kept float32; the modules' load-time weights
    # built here (a checkpoint folder's `CheckpointWeights`: streamed, slice by slice)
    dtype = getattr(torch, spec.kv_cache.dtype)
    weights = place_weights(weights, modules.values(), family=spec.family, dtype=dtype)

    def make_runner(cache, alloc, connector, reserved):
        return runner_cls(modules, weights, cache, runtime, connector, event_timeout=event_timeout)

    return build_engine(spec, kv_shapes=kv_shapes, make_runner=make_runner, faults=faults, closers=[runtime],
                        dtype=dtype, **options)
