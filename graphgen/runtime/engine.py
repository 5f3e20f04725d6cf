"""The engine: prompts in, tokens out, through the generated graphs, a paged KV cache and a pool.

Per prompt: hash its full blocks (stable chained hash), look up the longest leading run in the
pool (at most ``(len-1)//block_size`` blocks: the last token is always computed), load the hits
into device blocks, pick the variant (history -> ``splitfuse``, none -> ``mempool_prefill``), run
it, sample greedily, hand the save to the save stream, and commit blocks to the pool only after
the save's event — on a host thread, so an async save never delays the first token. Decode steps
then use ``decode``. Device blocks being saved are pinned: the request may finish and free them,
but they are not reused until the commit is done, and the step never waits for that.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from ..modelspec.model import ModelSpec
from . import ops
from .cpu import CpuRuntime, load_cpu_modules
from .faults import Faults
from .kvcache import BlockAllocator, OutOfBlocks, PagedKVCache, pack_block, unpack_block_into
from .pool import HostPool, PoolBackend, block_keys
from .streams import EventSet, Job, Stream

log = logging.getLogger("graphgen.engine")

DEFAULT_POOL_BYTES = 256 << 20


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


@dataclass
class _Seq:
    result: RequestResult
    t0: float
    table: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose KV is in the cache
    hit_blocks: int = 0
    keys: Optional[list[str]] = None  # pool keys of the prompt's full blocks, hashed once

    @property
    def prompt(self) -> list[int]:
        return self.result.prompt


class Engine:
    """Runs a spec's generated CPU graphs. See :meth:`from_spec`."""

    def __init__(self, spec: ModelSpec, weights: dict, *, spec_file: str = "", pool: Union[str, PoolBackend] = "host",
                 pool_capacity_bytes: int = DEFAULT_POOL_BYTES, num_blocks: int = 512,
                 faults: Optional[Faults] = None, generated_dir: Optional[Path] = Path("generated"),
                 source_hook: Optional[Callable[[str, str], str]] = None, collect_logits: bool = False,
                 event_timeout: float = 120.0):
        self.spec = spec
        self.faults = faults or Faults()
        self.dtype = getattr(torch, spec.kv_cache.dtype)
        self.W = {k: v.to(self.dtype) for k, v in weights.items()}
        self.block_size = spec.kv_cache.block_size
        self.collect_logits = collect_logits
        self.write = spec.pool.write
        self.prefix_cache = "prefix_cache" in spec.features
        self.modules = load_cpu_modules(spec, spec_file, generated_dir=generated_dir, source_hook=source_hook)
        self.events = {v: EventSet(m.EVENTS, default_timeout=event_timeout) for v, m in self.modules.items()}
        shapes = ops.kv_cache_shapes(spec.family, dataclasses.asdict(spec.dims), num_blocks, self.block_size)
        self.cache = PagedKVCache(spec.dims.num_hidden_layers, {k: tuple(s[1:]) for k, s in shapes.items()},
                                  num_blocks, self.dtype)
        self.alloc = BlockAllocator(num_blocks)
        if isinstance(pool, str):
            if pool != "host":
                raise ValueError(f"unknown pool backend {pool!r}; available: host (or pass a PoolBackend)")
            pool = HostPool(pool_capacity_bytes)
        self.pool: PoolBackend = self.faults.wrap_pool(pool) if self.faults.active else pool
        self.rt = CpuRuntime(self.faults, event_timeout=event_timeout)
        self.host_stream = Stream("host")  # commits saved blocks to the pool
        self._pending: list[Job] = []  # host commits in flight, oldest first
        self._gen = 0
        self.stats = {"puts": 0, "put_failures": 0, "save_failures": 0, "hit_blocks": 0, "loaded_blocks": 0,
                      "pool_errors": 0}

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec_path, weights=None, *, write: Optional[str] = None, granularity: Optional[str] = None,
                  pool: Union[str, PoolBackend] = "host", **kwargs) -> "Engine":
        """``weights``: a Hugging Face checkpoint folder (safetensors) or a dict of tensors.

        ``write`` / ``granularity`` override the spec's mempool settings for this run (the code for the
        overridden spec is generated on the fly)."""
        from ..lower.compile import display_path
        from ..modelspec.loader import load_spec

        spec = load_spec(spec_path)
        if write is not None or granularity is not None:
            spec = spec.with_overrides(write=write, granularity=granularity)
        if weights is None:
            raise ValueError("weights are required: a Hugging Face checkpoint folder or a dict of tensors")
        if not isinstance(weights, dict):
            from .weights import load_hf_weights

            _check_config(spec, Path(weights))
            weights = load_hf_weights(weights)
        return cls(spec, weights, spec_file=display_path(Path(spec_path)), pool=pool, **kwargs)

    # ---- variants ---------------------------------------------------------------------------------
    def variant_for(self, phase: str, history: bool) -> Optional[str]:
        gran = self.spec.pool.granularity
        matches = [n for n, v in self.spec.variants.items() if v.phase == phase and (v.history == history or phase == "decode")]
        for n in matches:
            if self.spec.variant_granularity(self.spec.variants[n]) == gran:
                return n
        return matches[0] if matches else None

    # ---- public API --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, *,
                 batch: bool = False, settle: bool = True) -> list[RequestResult]:
        """Greedy generation. ``batch=False``: prompts run one after another; with ``settle`` (default)
        each prompt's saves are committed before the next prompt looks up the pool, so a repeated
        prompt deterministically hits (its own TTFT clock starts after that wait; an async save still
        never delays the first token of the prompt that made it). ``batch=True``: prefills grouped by
        variant, decode together."""
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
            results.extend(self._run_group(group, max_new_tokens))
        return results

    def drain(self, timeout: Optional[float] = None) -> None:
        """Wait until every pending save has been committed to the pool (or failed; failures are
        logged and counted, never raised: a save that did not land only costs a later recompute)."""
        for job in list(self._pending):
            job.wait(timeout)
        self._reap()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.host_stream.close()
            self.rt.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- internals ---------------------------------------------------------------------------------
    def _run_group(self, prompts, max_new_tokens) -> list[RequestResult]:
        t0 = time.perf_counter()
        seqs = [_Seq(RequestResult(prompt=list(p)), t0) for p in prompts]
        try:
            for s in seqs:
                self._lookup_and_load(s)
            for history in (False, True):
                part = [s for s in seqs if (s.hit_blocks > 0) == history]
                if part:
                    self._prefill(part, history)
            active = [s for s in seqs if len(s.result.tokens) < max_new_tokens]
            while active:
                self._decode(active)
                active = [s for s in active if len(s.result.tokens) < max_new_tokens]
        finally:
            # also on failure (e.g. OutOfBlocks for the 2nd sequence of a batch): blocks taken
            # by the group must not leak, or the engine stays short of blocks for good
            for s in seqs:
                self.alloc.free(s.table)  # pinned blocks stay out of the free list until committed
                s.table = []
        self._reap()
        return [s.result for s in seqs]

    def _keys(self, s: _Seq) -> list[str]:
        if s.keys is None:
            s.keys = block_keys(s.prompt, self.block_size, model=self.spec.name, layout=self.cache.layout)
        return s.keys

    def _alloc(self, n: int) -> list[int]:
        while True:
            try:
                return self.alloc.alloc(n)
            except OutOfBlocks:
                # Only when memory is exhausted: wait for the oldest in-flight save to release its pins.
                if not self._pending:
                    raise
                self._pending[0].wait()
                self._reap()

    def _ensure_blocks(self, s: _Seq, num_tokens: int) -> None:
        need = math.ceil(num_tokens / self.block_size) - len(s.table)
        if need > 0:
            s.table.extend(self._alloc(need))

    def _lookup_and_load(self, s: _Seq) -> None:
        prompt = s.prompt
        max_blocks = (len(prompt) - 1) // self.block_size
        if not self.prefix_cache or max_blocks == 0 or self.variant_for("prefill", True) is None:
            return
        keys = self._keys(s)[:max_blocks]
        try:
            run = self.pool.leading_run(keys)
        except Exception as e:  # a pool that is down costs a recompute, never the request
            log.warning("pool lookup failed, recomputing: %s", e)
            self.stats["pool_errors"] += 1
            return
        if run == 0:
            return
        self._ensure_blocks(s, len(prompt))
        loaded = 0
        for i in range(run):
            try:
                data = self.pool.get(keys[i])
                if data is None:  # evicted since the lookup: recompute from here
                    break
                unpack_block_into(self.cache, s.table[i], data)
            except Exception as e:  # unreachable pool or a foreign/corrupt value: recompute from here
                log.warning("pool load of block %d failed, recomputing from there: %s", i, e)
                self.stats["pool_errors"] += 1
                break
            loaded += 1
        s.hit_blocks = loaded
        s.cached = loaded * self.block_size
        s.result.hit_tokens = s.cached
        self.stats["hit_blocks"] += loaded
        self.stats["loaded_blocks"] += loaded

    def _prefill(self, seqs: list[_Seq], history: bool) -> None:
        variant = self.variant_for("prefill", history)
        spec_v = self.spec.variants[variant]
        saves = self.spec.variant_saves(spec_v)
        ids, pos, slots, qlens, slens = [], [], [], [], []
        save_ids, save_keys = [], []
        for s in seqs:
            n = len(s.prompt)
            self._ensure_blocks(s, n)
            start = s.cached
            ids.append(torch.tensor(s.prompt[start:], dtype=torch.long))
            pos.append(torch.arange(start, n, dtype=torch.long))
            slots.append(self.cache.slot_mapping(s.table, start, n))
            qlens.append(n - start)
            slens.append(n)
            if saves:
                new_full = range(s.hit_blocks, n // self.block_size)  # the new full blocks
                keys = self._keys(s)
                save_ids.extend(s.table[j] for j in new_full)
                save_keys.extend(keys[j] for j in new_full)
                s.result.saved_blocks = len(new_full)
            s.result.variant = variant
        b = self._inputs(seqs, ids, pos, slots, qlens, slens, save_ids)
        logits = self._run(variant, b, save_ids, save_keys, sync_commit=(self.write == "sync"))
        now = time.perf_counter()
        for i, s in enumerate(seqs):
            s.cached = slens[i]
            self._emit(s, logits[i])
            s.result.ttft_ms = (now - s.t0) * 1e3

    def _decode(self, seqs: list[_Seq]) -> None:
        variant = self.variant_for("decode", False)
        ids, pos, slots, slens = [], [], [], []
        for s in seqs:
            p = s.cached
            self._ensure_blocks(s, p + 1)
            ids.append(torch.tensor([s.result.tokens[-1]], dtype=torch.long))
            pos.append(torch.tensor([p], dtype=torch.long))
            slots.append(self.cache.slot_mapping(s.table, p, p + 1))
            slens.append(p + 1)
        b = self._inputs(seqs, ids, pos, slots, [1] * len(seqs), slens, [])
        logits = self._run(variant, b, [], [], sync_commit=False)
        for i, s in enumerate(seqs):
            s.cached += 1
            self._emit(s, logits[i])

    def _emit(self, s: _Seq, row: torch.Tensor) -> None:
        s.result.tokens.append(int(torch.argmax(row)))
        if self.collect_logits:
            s.result.step_logits.append(row.detach().float().clone())

    def _inputs(self, seqs, ids, pos, slots, qlens, slens, save_ids) -> StepInputs:
        width = max(len(s.table) for s in seqs)
        tables = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, :len(s.table)] = torch.tensor(s.table, dtype=torch.long)
        q = torch.tensor(qlens, dtype=torch.long)
        return StepInputs(
            input_ids=torch.cat(ids), positions=torch.cat(pos), slot_mapping=torch.cat(slots),
            block_tables=tables, seq_lens=torch.tensor(slens, dtype=torch.long), query_lens=q,
            logits_indices=torch.cumsum(q, 0) - 1, save_block_ids=torch.tensor(save_ids, dtype=torch.long))

    def _run(self, variant: str, b: StepInputs, save_ids: list[int], save_keys: list[str], *, sync_commit: bool):
        mod = self.modules[variant]
        self._gen += 1
        ev = self.events[variant].bind(self._gen)
        staging = self.cache.make_staging(len(save_ids)) if mod.HOST_EVENT else None
        if save_ids:
            self.alloc.pin(save_ids)
        self.rt.take_launched()
        try:
            with torch.inference_mode():
                logits = mod.run(self.rt, self.W, b, self.cache, staging, ev)
        except BaseException:
            ev.abort("the forward failed")
            for j in self.rt.take_launched():
                j.wait()
            if save_ids:
                self.alloc.unpin(save_ids)
            raise
        jobs = self.rt.take_launched()
        if mod.HOST_EVENT:
            save_job = jobs[0] if jobs else None
            host = self._host_job(mod, ev, save_job, staging, save_keys, save_ids)
            if sync_commit:
                host()
            else:
                self._pending.append(self.host_stream.launch(host))
        return logits

    def _host_job(self, mod, ev, save_job, staging, keys, block_ids):
        def commit():
            for j, key in enumerate(keys):
                try:
                    ok = self.pool.put(key, pack_block(staging, j))
                except Exception as e:  # a pool that is down: the block is simply not saved
                    log.warning("pool put failed: %s", e)
                    ok = False
                if ok:
                    self.stats["puts"] += 1
                else:
                    self.stats["put_failures"] += 1  # not visible; a later request recomputes it

        def host():
            try:
                if save_job is not None and save_job.exception() is not None:
                    self.stats["save_failures"] += 1
                    log.warning("KV save failed; its blocks are not committed: %s", save_job.exception())
                    return
                mod.host(self.rt, ev, commit)
            finally:
                if block_ids:
                    self.alloc.unpin(block_ids)
        return host

    def _reap(self) -> None:
        keep = []
        for job in self._pending:
            if not job.done():
                keep.append(job)
            elif job.exception() is not None:
                log.warning("pool commit failed: %s", job.exception())
        self._pending = keep


def _check_config(spec, hf_dir: Path) -> None:
    import json

    cfg_path = hf_dir / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path}: no config.json (expected a Hugging Face checkpoint folder)")
    cfg = json.loads(cfg_path.read_text())
    from .weights import WeightsError, family_of_config

    try:
        family = family_of_config(cfg)
    except WeightsError as e:
        raise ValueError(f"{cfg_path}: {e}") from None
    if family != spec.family:
        raise ValueError(f"{cfg_path} does not match spec {spec.name} (model_type {cfg.get('model_type')!r} is "
                         f"family {family}, the spec is {spec.family}); create a matching spec with: "
                         f"graphgen import-hf {hf_dir} --out specs/NAME.yaml")
    # Every dim the config states must agree (same family => same field names). Not compared:
    # max_position_embeddings (a context limit, not a weight or numeric property) and the RoPE
    # fields, which transformers 5 nests under rope_parameters.
    skip = {"max_position_embeddings", "rope_theta", "rope_scaling"}
    wrong = [(k, cfg[k], v) for k, v in dataclasses.asdict(spec.dims).items()
             if k not in skip and cfg.get(k) is not None and cfg[k] != v]
    if wrong:
        desc = ", ".join(f"{k}: checkpoint {a} vs spec {b}" for k, a, b in wrong)
        raise ValueError(f"{cfg_path} does not match spec {spec.name} ({desc}); "
                         f"create a matching spec with: graphgen import-hf {hf_dir} --out specs/NAME.yaml")
