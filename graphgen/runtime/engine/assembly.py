"""The assembly of an engine: `build_engine`, the one place an engine's parts are wired together,
for every target and rank, and `cpu_engine`, the CPU target's.

`build_engine` makes the pool (a URL or a backend, with injected faults), the paged KV cache and its
block allocator, the KV connector's two sides (`KVLoader` for the scheduler, `KVConnector` for the
runner, which alone drives it), a model runner (CPU, CPU rank, NPU: given as a factory), the
`Scheduler`, the step loop (`EngineCore`) and the speculative drafter, and returns the `Engine`
(`graphgen.runtime.engine.engine`: the object a caller holds). Targets differ only in what they
hand it (cache shapes, device, connector and runner factories, what to close); no engine class
re-implements another's construction. `cpu_engine` is the CPU target's (and, with a rank's
runtime, shapes and connector, a CPU rank's). Callers normally go through
`graphgen.runtime.open_engine`, which loads the spec and the weights.
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
from .engine import Engine
from .engine_core import EngineCore
from .kv_load import Counters, KVLoader
from .runner import CpuModelRunner
from .scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Scheduler
from .spec_decode import MtpDrafter, check_speculative

__all__ = ["build_engine", "cpu_engine"]


def build_engine(spec: ModelSpec, *, kv_shapes: dict, make_runner: Callable, pool: Union[str, PoolBackend] = "host",
                 pool_capacity_bytes: int = DEFAULT_POOL_BYTES, faults: Optional[Faults] = None,
                 num_blocks: Optional[int] = 512, reserved_blocks: int = 0, device: str = "cpu", dtype=None,
                 make_connector: Optional[Callable] = None, make_loader: Optional[Callable] = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, async_scheduling: bool = False,
                 chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 collect_logits: bool = False, eos_token_ids: Iterable[int] = (), closers: Sequence = (),
                 max_model_len: Optional[int] = None, num_speculative_tokens: int = 0,
                 load_weights: Optional[Callable[[], None]] = None,
                 size_kv: Optional[Callable[[int], int]] = None, wrap_runner: Optional[Callable] = None,
                 lora_modules: Optional[dict] = None) -> Engine:
    """Wire an engine. ``kv_shapes``: cache component -> per-block shape (``[BS, ...]``);
    ``make_runner(cache, alloc, connector, reserved)`` -> the model runner (``reserved``: blocks
    taken from the allocator for the target's own use, e.g. the NPU's padding block);
    ``make_loader(pool, cache, counters)`` -> the connector's scheduler side (default: a `KVLoader`
    keyed by the spec's name); ``make_connector(pool, cache, alloc, counters)`` -> its worker side
    (default: a `KVConnector` writing as ``pool.write``); ``wrap_runner(runner)`` -> the runner the engine
    drives (a rank's: `graphgen.runtime.parallel.features.RankRunner` around it). ``num_speculative_tokens`` K > 0: every
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
    adapters = {}
    if lora_modules:  # read and checked before anything is started (AdapterError: one sentence)
        from ..lora import read_adapter

        adapters = {name: read_adapter(path, spec, name=name) for name, path in lora_modules.items()}
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
    runner = make_runner(cache, alloc, connector, reserved)  # it owns the connector's worker side
    if wrap_runner is not None:
        runner = wrap_runner(runner)
    scheduler = Scheduler(spec, alloc, loader, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, chunked_prefill=chunked_prefill,
                          long_prefill_token_threshold=long_prefill_token_threshold,
                          num_speculative_tokens=num_speculative_tokens)
    drafter = MtpDrafter(spec, num_speculative_tokens, runner, cache, scheduler) if num_speculative_tokens else None
    core = EngineCore(scheduler, runner, vocab_size=spec.dims.vocab_size, async_scheduling=async_scheduling,
                      eos_token_ids=eos_token_ids, collect_logits=collect_logits, drafter=drafter)
    if spec.lora is not None:  # the device slots adapters are loaded into on demand (LRU)
        from ..lora import LoraSlots

        # in the runner's compute dtype where it has one (the NPU's), on the cache's device
        runner.lora_slots = LoraSlots(spec, dtype=getattr(runner, "dtype", None) or dtype, device=torch.device(device))
        core.adapters = adapters
    return Engine(spec=spec, pool=pool, faults=faults, cache=cache, alloc=alloc, loader=loader, connector=connector,
                  runner=runner, scheduler=scheduler, core=core, closers=closers, max_model_len=max_model_len)


def cpu_engine(spec: ModelSpec, weights: dict, *, spec_file: str = "", generated_dir: Optional[Path] = Path("generated"),
               source_hook: Optional[Callable[[str, str], str]] = None, sources: Optional[dict] = None,
               event_timeout: float = 120.0, runtime: Optional[CpuRuntime] = None,
               kv_shapes: Optional[dict] = None, faults: Optional[Faults] = None,
               **options) -> Engine:
    """The CPU target's engine (one process). A CPU rank passes its own ``runtime`` (collectives),
    ``kv_shapes`` (its KV shard), ``make_loader``/``make_connector`` (its keys, agreed hits, save-once)
    and ``wrap_runner`` (its rank features: `graphgen.runtime.parallel.rank.RankSetup`); ``sources``: {variant: module
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
        return CpuModelRunner(modules, weights, cache, runtime, connector, event_timeout=event_timeout)

    return build_engine(spec, kv_shapes=kv_shapes, make_runner=make_runner, faults=faults, closers=[runtime],
                        dtype=dtype, **options)
