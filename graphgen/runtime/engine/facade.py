"""The engine: prompts in, tokens out. A small facade over three parts:

* `Scheduler` (``scheduler.py``): request queues, variant choice, block tables, step inputs;
* `KVConnector` (``connector.py``): pool lookup and load, the save handoff, commits after the
  save's event, pins, pool stats;
* `CpuModelRunner` (``runner.py``): binds events, runs one generated module, returns
  `StepHandles` (logits, save job, save event).

One step (`LLMEngine.step`, ``llm_engine.py``): ``schedule()`` -> ``prepare_save`` (pin, staging)
-> ``execute`` -> ``handoff`` (commit after the save's event: inline for sync, on the host stream
for async) -> ``update`` with the sampled tokens. ``generate`` is a loop over that step API
(``Engine.llm``); a server drives ``Engine.llm`` directly. See docs/runtime.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from ...modelspec.model import ModelSpec
from ..core import ops
from .connector import KVConnector
from ..core.cpu_runtime import CpuRuntime, load_cpu_modules
from ..core.faults import Faults
from ..core.kvcache import BlockAllocator, PagedKVCache
from .step_loop import LLMEngine
from ..pool import DEFAULT_POOL_BYTES, PoolBackend, make_pool
from ..pool.faulty import wrap_pool
from .request import RequestResult, StepInputs
from .runner import CpuModelRunner
from .scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Scheduler

__all__ = ["Engine", "RequestResult", "StepInputs", "DEFAULT_POOL_BYTES"]

class Engine:
    """Runs a spec's generated CPU graphs. See :meth:`from_spec`."""

    def __init__(self, spec: ModelSpec, weights: dict, *, spec_file: str = "", pool: Union[str, PoolBackend] = "host",
                 pool_capacity_bytes: int = DEFAULT_POOL_BYTES, num_blocks: int = 512,
                 faults: Optional[Faults] = None, generated_dir: Optional[Path] = Path("generated"),
                 source_hook: Optional[Callable[[str, str], str]] = None, collect_logits: bool = False,
                 event_timeout: float = 120.0, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, async_scheduling: bool = False,
                 sources: Optional[dict] = None):
        self._setup(spec, faults, collect_logits, pool, pool_capacity_bytes)
        shapes = self._kv_shapes(num_blocks)
        self.cache = PagedKVCache(spec.dims.num_hidden_layers, {k: tuple(s[1:]) for k, s in shapes.items()},
                                  num_blocks, self.dtype)
        self.alloc = BlockAllocator(num_blocks)
        self.rt = self._make_runtime(event_timeout)
        modules = load_cpu_modules(spec, spec_file, generated_dir=generated_dir, source_hook=source_hook,
                                   sources=sources)  # sources: compiled by the caller (a rank's launcher)
        weights = {k: v.to(self.dtype) for k, v in weights.items()}
        self.runner = CpuModelRunner(modules, weights, self.cache, self.rt, event_timeout=event_timeout)
        self.connector = self._make_connector()
        self.scheduler = Scheduler(spec, self.alloc, self.connector, reclaim=self.connector.wait_oldest,
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        self.llm = LLMEngine(self.scheduler, self.connector, self.runner, vocab_size=spec.dims.vocab_size,
                             async_scheduling=async_scheduling, collect_logits=collect_logits)

    def _setup(self, spec, faults, collect_logits: bool, pool, pool_capacity_bytes: int) -> None:
        """What every engine (CPU, rank, NPU) holds before its cache and runner: the spec's facts and the pool."""
        self.spec = spec
        self.faults = faults or Faults()
        self.dtype = getattr(torch, spec.kv_cache.dtype)
        self.block_size = spec.kv_cache.block_size
        self.collect_logits = collect_logits
        self.write = spec.pool.write
        if isinstance(pool, str):  # "host" or "mooncake://HOST:PORT[?opts]" (Mooncake imported lazily)
            pool = make_pool(pool, capacity_bytes=pool_capacity_bytes)
        self.pool: PoolBackend = wrap_pool(pool, self.faults) if self.faults.active else pool

    # -- what a rank engine (graphgen.runtime.parallel.launcher.RankEngine) replaces ----------------------
    def _kv_shapes(self, num_blocks: int) -> dict:
        return ops.kv_cache_shapes(self.spec.family, dataclasses.asdict(self.spec.dims), num_blocks, self.block_size)

    def _make_runtime(self, event_timeout: float) -> CpuRuntime:
        if self.spec.parallel.tp > 1 or self.spec.parallel.ep > 1:
            raise ValueError(f"spec {self.spec.name} runs on {self.spec.parallel.tp} ranks: use "
                             f"Engine.from_spec(..., tp=...) (it starts the rank processes)")
        return CpuRuntime(self.faults, event_timeout=event_timeout)

    def _make_connector(self) -> KVConnector:
        return KVConnector(self.pool, self.cache, self.alloc, model=self.spec.name, write=self.write)

    @classmethod
    def from_spec(cls, spec_path, weights=None, *, write: Optional[str] = None, granularity: Optional[str] = None,
                  pool: Union[str, PoolBackend] = "host", tp: Optional[int] = None, ep: Optional[int] = None,
                  **kwargs) -> "Engine":
        """``weights``: a Hugging Face checkpoint folder (safetensors) or a dict of tensors.

        ``write`` / ``granularity`` / ``tp`` / ``ep`` override the spec's settings for this run (the
        code for the overridden spec is generated on the fly). A layout of more than one rank gives
        a `graphgen.runtime.parallel.launcher.DistributedEngine` (same calls; it starts the rank processes)."""
        from ...lower.compile import display_path
        from ...modelspec.loader import load_spec

        spec = load_spec(spec_path)
        if write is not None or granularity is not None or tp is not None or ep is not None:
            spec = spec.with_overrides(write=write, granularity=granularity, tp=tp, ep=ep)
        if weights is None:
            raise ValueError("weights are required: a Hugging Face checkpoint folder or a dict of tensors")
        if not isinstance(weights, dict):
            _check_config(spec, Path(weights))
        if spec.parallel.tp > 1 or spec.parallel.ep > 1:  # each rank process loads its own slices
            from ..parallel.launcher import DistributedEngine

            return DistributedEngine(spec, weights, spec_file=display_path(Path(spec_path)), pool=pool, **kwargs)
        if not isinstance(weights, dict):
            from ..checkpoint.hf import load_hf_weights

            weights = load_hf_weights(weights)
        return cls(spec, weights, spec_file=display_path(Path(spec_path)), pool=pool, **kwargs)

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
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        for p in prompts:
            if len(p) < 1:
                raise ValueError("empty prompt")
            if any((not isinstance(t, int)) or t < 0 or t >= self.spec.dims.vocab_size for t in p):
                raise ValueError(f"prompt token ids must be ints in [0, {self.spec.dims.vocab_size})")
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
            self.rt.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_config(spec, hf_dir: Path) -> None:
    """The checkpoint's config.json must describe the spec's model (family and every stated dim)."""
    import json

    from ..checkpoint.hf import WeightsError, family_of_config

    cfg_path = hf_dir / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path}: no config.json (expected a Hugging Face checkpoint folder)")
    cfg = json.loads(cfg_path.read_text())
    try:
        family = family_of_config(cfg)
    except WeightsError as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    fix = f"create a matching spec with: graphgen import-hf {hf_dir} --out specs/NAME.yaml"
    if family != spec.family:
        raise ValueError(f"{cfg_path} does not match spec {spec.name} (model_type {cfg.get('model_type')!r} is "
                         f"family {family}, the spec is {spec.family}); {fix}")
    # Every dim the config states must agree (same family => same field names). Not compared:
    # max_position_embeddings (a context limit, not a weight or numeric property) and the RoPE
    # fields, which transformers 5 nests under rope_parameters.
    skip = {"max_position_embeddings", "rope_theta", "rope_scaling"}
    wrong = [(k, cfg[k], v) for k, v in dataclasses.asdict(spec.dims).items()
             if k not in skip and cfg.get(k) is not None and cfg[k] != v]
    if wrong:
        desc = ", ".join(f"{k}: checkpoint {a} vs spec {b}" for k, a, b in wrong)
        raise ValueError(f"{cfg_path} does not match spec {spec.name} ({desc}); {fix}")
