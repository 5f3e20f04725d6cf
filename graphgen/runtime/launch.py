"""`open_engine`: the one assembly point of an engine, for every target and layout.

It loads the spec (once), applies the run's overrides (``write``, ``granularity``, ``tp``, ``ep``),
checks the checkpoint's config against the spec, and hands the parts to the target:

* ``target="cpu"``, one rank: `graphgen.runtime.engine.assembly.cpu_engine` (the weights are loaded here);
* ``target="cpu"``, several ranks: `graphgen.runtime.parallel.launcher.DistributedEngine`, which
  starts one process per rank; each rank builds its parts with the same `cpu_engine` (its runtime,
  KV shard and pool keys given) — every rank loads its own weight slices;
* another target (``"npu"``): the builder it registered with `register_target` (the NPU runner
  registers itself when ``graphgen.npu.run`` is imported; the runtime never imports the NPU code).

Every builder gets ``(spec, weights, spec_file=..., pool=..., **options)`` and returns an
`EngineInterface` (`graphgen.runtime.engine.interface`: ``generate``, ``core``, ``drain``, ``stats``,
``close``, ``max_model_len``, the P/D reads, ...): a driver uses that interface, never the class.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from .engine.interface import EngineInterface

__all__ = ["open_engine", "register_target", "TARGETS"]

# target name -> builder(spec, weights, *, spec_file, pool, tp, **options) -> engine
TARGETS: dict[str, Callable] = {}


def register_target(name: str, builder: Callable) -> None:
    """Make ``open_engine(..., target=name)`` build engines with ``builder``."""
    TARGETS[name] = builder


def _cpu(spec, weights, *, spec_file: str, pool, **options):
    if spec.parallel.dp > 1:  # DP attention: one process per DP rank, each with its own requests
        from .parallel.data_parallel import DataParallelEngine

        return DataParallelEngine(spec, weights, spec_file=spec_file, pool=pool, **options)
    if spec.parallel.world > 1 or spec.parallel.ep > 1:  # each rank process loads its own slices (or, cp: all)
        from .parallel.launcher import DistributedEngine

        return DistributedEngine(spec, weights, spec_file=spec_file, pool=pool, **options)
    from .checkpoint.stream import CheckpointWeights
    from .engine.assembly import cpu_engine

    options.pop("rank_timeout", None)  # one process: no rank process to hold to the start deadlines
    if not isinstance(weights, dict):  # streamed into the spec's dtype as the engine loads (no float32 copy)
        weights = CheckpointWeights.whole(weights, spec)
    return cpu_engine(spec, weights, spec_file=spec_file, pool=pool, **options)


register_target("cpu", _cpu)


def open_engine(spec, weights, *, target: str = "cpu", write: Optional[str] = None,
                granularity: Optional[str] = None, tp: Optional[int] = None, ep: Optional[int] = None,
                dp: Optional[int] = None, cp: Optional[int] = None, sp: Optional[bool] = None,
                pool="host", spec_file: Optional[str] = None, pool_policy: Optional[str] = None,
                pool_min_uses: Optional[int] = None, lora_modules: Optional[dict] = None,
                max_loras: Optional[int] = None, max_lora_rank: Optional[int] = None, **options) -> "EngineInterface":
    """An engine for ``spec`` (a spec file, or a loaded `ModelSpec`) on ``weights`` (a Hugging Face
    checkpoint folder, or a dict of tensors by checkpoint name).

    ``write`` / ``granularity`` / ``tp`` / ``ep`` / ``dp`` / ``cp`` / ``sp`` / ``pool_policy`` (``pool.policy``) /
    ``pool_min_uses`` (``pool.min_uses``) override the spec's settings for this run (the code for the overridden spec is generated on the fly; a
    layout the runtime cannot run yet raises ValueError, `families.parallel.runtime_layout_gap`); ``pool``: ``"host"`` (the embedded pool),
    ``"mooncake://HOST:PORT"`` or a `PoolBackend`. ``options`` go to the target's builder
    (`graphgen.runtime.engine.assembly.build_engine`'s: ``num_blocks``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``async_scheduling``, ``collect_logits``, ``eos_token_ids``, ``faults``,
    ``num_speculative_tokens`` (speculative decoding with the spec's MTP layer, docs/mtp.md), ...; the
    NPU target's: ``standin``, ``mode``). ``lora_modules``: {name: PEFT adapter folder} requests may run under
    (docs/lora.md; a spec without a ``lora:`` section gets one), ``max_loras`` / ``max_lora_rank`` override it."""
    from ..lower.compile import display_path
    from ..modelspec.loader import load_spec
    from ..modelspec.model import ModelSpec

    if isinstance(spec, ModelSpec):  # loaded already (graphgen serve checked it): spec_file names its file
        spec_file = display_path(spec_file) if spec_file else ""
    else:
        path = Path(spec)
        spec_file = spec_file or display_path(path)
        spec = load_spec(path)
    if any(x is not None for x in (write, granularity, tp, ep, dp, cp, sp, pool_policy, pool_min_uses, max_loras,
                                   max_lora_rank)) or (lora_modules and spec.lora is None):
        spec = spec.with_overrides(write=write, granularity=granularity, tp=tp, ep=ep, dp=dp, cp=cp, sp=sp,
                                   policy=pool_policy, min_uses=pool_min_uses, max_loras=max_loras,
                                   max_lora_rank=max_lora_rank, enable_lora=bool(lora_modules))
    if spec.lora is not None:
        from ..modelspec.compat import check_compat

        refused = [f"{m} ({fix})" for where, m, fix in check_compat(spec) if where.startswith(("lora", "targets.npu"))]
        if refused:
            raise ValueError(f"spec {spec.name} with LoRA: {refused[0]}")
    if lora_modules:
        options["lora_modules"] = dict(lora_modules)
    from ..families.parallel import runtime_layout_gap

    gap = runtime_layout_gap(spec.parallel, target, mtp=spec.mtp is not None,
                             speculative=bool(options.get("num_speculative_tokens")))
    if gap is not None:
        raise ValueError(gap)
    if weights is None:
        raise ValueError("weights are required: a Hugging Face checkpoint folder or a dict of tensors")
    if target not in TARGETS:
        hint = " (import graphgen.npu.run first: it registers the NPU target)" if target == "npu" else ""
        raise ValueError(f"unknown target {target!r}: expected one of {sorted(TARGETS)}{hint}")
    if not isinstance(weights, dict):
        from .checkpoint.hf import check_config

        check_config(spec, Path(weights))
    from .progress import starting

    with starting():  # one process's loads and compiles print progress lines (ranks report to their launcher)
        engine = TARGETS[target](spec, weights, spec_file=spec_file, pool=pool, **options)
    from .engine.interface import interface_gaps

    gaps = interface_gaps(engine)
    if gaps:  # a target's builder must return the declared interface: drivers never ask for the class
        engine.close()
        raise TypeError(f"target {target!r} built a {type(engine).__name__} without EngineInterface's {gaps}")
    return engine
