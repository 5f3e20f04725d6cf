"""Building the NPU target's engine (split from `graphgen.npu.run.runner`, the step driver): `npu_engine` is the
runtime `Engine` with `NpuModelRunner` (``open_engine(..., target="npu")``), `npu_rank_engine` one NPU rank's
(in a rank process). Importing this module registers both with the runtime (``graphgen.npu.run`` does)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ...runtime import register_rank_target, register_target
from ...runtime.core.kvcache import token_shapes
from ...runtime.engine import Engine, build_engine
from .bucketing import Buckets, max_model_len
from .data_parallel import NpuDPForward
from .ranks import launch_npu_ranks, setup_rank
from .runner import NpuModelRunner
from .startup import barrier_after_load, npu_rank_env
from .weights import load_first

__all__ = ["npu_engine", "npu_rank_engine"]


def npu_engine(spec, weights, *, spec_file: str = "", pool="host", num_blocks: Optional[int] = 512,
               max_num_seqs: Optional[int] = None, max_num_batched_tokens: Optional[int] = None,
               standin: bool = False, mode: Optional[str] = None, sources: Optional[dict] = None,
               groups=None, warmup: Optional[bool] = None, device_memory_utilization: Optional[float] = None,
               cache_dir=None, rank_timeout=None, kv_shapes: Optional[dict] = None, **options) -> Engine:
    """The runtime `Engine` with `NpuModelRunner` (``open_engine(..., target="npu")``).

    Differences from the CPU engine: the cache and the weights are in the NPU dtypes; one extra cache
    block is reserved for padding; the scheduler's limits come from the buckets (``max_num_seqs`` <= the
    largest decode bucket, ``max_num_batched_tokens`` <= the largest prefill bucket - prefill_seqs).
    ``world > 1``: the rank processes (`graphgen.npu.run.ranks`), each of which calls this with its
    ``groups`` (the layout's process groups) and its rank's options (`npu_rank_engine`: KV shard, keys,
    the `RankRunner` wrap with the plan check or the DP agreement).
    ``warmup``: compile every bucket of every variant before the first request (`NpuModelRunner.warm_up`,
    progress on stderr); ``None``: on an NPU, off with ``standin``.  ``cache_dir``: the on-disk compile
    cache (`compile.CacheKey`: a restart with the same cache compiles nothing); None: none.
    ``rank_timeout``: the rank processes' start deadlines (`graphgen.runtime.Deadlines`; one process: unused)."""
    if spec.targets.npu is None:
        raise ValueError(f"spec {spec.name} has no NPU target (targets.npu)")
    if not standin:  # before anything is put on the device: NpuUnavailable, one sentence
        from .compile import _import_torchair

        _import_torchair(False)
    if spec.parallel.world > 1 and groups is None:
        if sources is not None:
            raise ValueError("sources= is for one process; NPU ranks compile their own modules")
        return launch_npu_ranks(spec, weights, spec_file=spec_file, pool=pool, num_blocks=num_blocks,
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                standin=standin, mode=mode, warmup=warmup, cache_dir=cache_dir,
                                rank_timeout=rank_timeout, **options)
    if groups is not None and groups.layout.dp > 1 and options.get("num_speculative_tokens"):
        # a DP rank's calls run at agreed buckets of one kind each (data_parallel.py): verify rows need a decode
        # call of their own, never a prefill call beside prompt chunks, so no mixed steps
        options["chunked_prefill"] = False
    buckets = Buckets.from_spec(spec)
    # the weights go on the device first, streamed (each load-time weight built in place), then the KV cache
    load_weights, placed, size_kv, sources = load_first(spec, weights, mode, sources, standin,
                                                        device_memory_utilization, buckets.save_rows)
    if size_kv is not None:
        num_blocks = None

    def make_runner(cache, alloc, connector, reserved):  # closed with the engine (EngineCore.close)
        runner = NpuModelRunner(spec, placed.pop("W"), cache, connector, pad_block=reserved[0], mode=mode,
                                standin=standin, sources=sources, cache_dir=cache_dir, groups=groups,
                                num_speculative_tokens=options.get("num_speculative_tokens", 0))
        # every rank loaded before any compiles: HCCL connects inside the first conversion (startup.py, M2)
        barrier_after_load(groups, rank_timeout)
        if warmup if warmup is not None else not standin:
            runner.warm_up()
        return runner

    if kv_shapes is None:  # a rank's is its KV shard's
        shapes = token_shapes(spec.family, dataclasses.asdict(spec.dims))
        kv_shapes = {k: (spec.kv_cache.block_size, *v) for k, v in shapes.items()}
    return build_engine(spec, kv_shapes=kv_shapes, make_runner=make_runner, pool=pool, num_blocks=num_blocks,
                        load_weights=load_weights, size_kv=size_kv, reserved_blocks=1,
                        device="cpu" if standin else "npu",
                        max_num_seqs=min(max_num_seqs or buckets.decode_batch[-1], buckets.decode_batch[-1]),
                        max_num_batched_tokens=min(max_num_batched_tokens or 1 << 30,
                                                   buckets.prefill_tokens[-1] - buckets.prefill_seqs),
                        max_model_len=max_model_len(spec), **options)


def npu_rank_engine(spec, weights: dict, *, rank, **options) -> Engine:
    """One NPU rank's engine (in a rank process): `npu_engine` on its sliced weights with its rank's groups
    and options (``rank``: the runtime's `RankSetup`, from `build_rank`)."""
    return npu_engine(spec, weights, groups=rank.groups, **{**options, **rank.engine_options()})


register_target("npu", npu_engine)
register_rank_target("npu", npu_rank_engine, setup=setup_rank, dp_forward=NpuDPForward, env=npu_rank_env)  # graphgen.npu.run.ranks
