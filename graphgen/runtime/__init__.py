"""graphgen's runtime: the public face (what `graphgen serve`, the CLI, the demo and users import).

It needs the ``runtime`` extra (torch, safetensors, numpy): importing any part of it without that
extra fails here, with one sentence naming the extra, rather than deep inside a submodule with a
bare ``No module named 'torch'``. Names are resolved lazily, so a torch-free part
(``graphgen.runtime.pool``) never imports torch itself: a pool process (``mooncake_server``, the rank
launcher's shared pool) does not pay for importing it, though like every part it needs the extra
installed. Everything else under ``graphgen.runtime`` is internal: see docs/runtime.md for the parts.
"""

from __future__ import annotations

import importlib

from ..install import require

require("runtime", "graphgen.runtime")

# public name -> the module that defines it
_EXPORTS = {
    "open_engine": "launch", "register_target": "launch",
    "Engine": "engine.engine", "EngineInterface": "engine.interface", "StepAPI": "engine.interface",
    "CacheNaming": "engine.interface",
    "EngineCore": "engine.engine_core",
    "SamplingParams": "engine.sampling", "SEED_RANGE": "engine.sampling", "MIN_TEMPERATURE": "engine.sampling",
    "VALUE_RANGES": "engine.sampling", "StructuredOutput": "engine.grammar",
    "compiled_matcher": "engine.grammar", "warm_up_grammars": "engine.grammar",
    "speculative_refusal": "engine.spec_decode",
    "RequestOutput": "engine.request", "RequestResult": "engine.request", "FINISH_REASONS": "engine.request",
    "DistributedEngine": "parallel.launcher", "RankFailure": "parallel.launcher",
    "DataParallelEngine": "parallel.data_parallel",
    "register_rank_target": "parallel.rank",
    "RankLayout": "parallel.layout", "RankGroups": "parallel.layout", "cp_pieces": "parallel.context_parallel",
    "OutOfBlocks": "core.kvcache",
    "Faults": "core.faults",
    "Deadlines": "progress", "current_progress": "progress",
    "PoolBackend": "pool", "HostPool": "pool", "make_pool": "pool", "DEFAULT_POOL_BYTES": "pool",
    "chain_digests": "pool.keys",
    "load_hf_weights": "checkpoint.hf", "write_random_hf_checkpoint": "checkpoint.hf",
    "CheckpointWeights": "checkpoint.stream", "RankSlicing": "checkpoint.plan",
    "eos_token_ids": "checkpoint.generation", "load_tokenizer": "checkpoint.generation",
    "chat_parsers": "checkpoint.generation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'graphgen.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
