"""The compatibility matrix: one declared table of what graphgen implements and what combines.

Mirrors the seed's documented rules (MindIE-LLM async write): pool writes need prefix caching;
async write only for Qwen dense and DeepSeek-V3; async write does not combine with SplitFuse
scheduling, Micro Batch or Multi-LoRA. Features graphgen does not implement are rejected, never
silently ignored.
"""

from __future__ import annotations

import difflib

# feature -> (status, note). Status:
#   implemented:     changes what is generated or run
#   graph_neutral:   accepted; it does not change any graph (handled outside graphgen, e.g. text parsing)
#   not_implemented: rejected until graphgen implements it
FEATURES: dict[str, tuple[str, str]] = {
    "prefix_cache": ("implemented", "reuse leading full KV blocks from the pool"),
    "async_scheduling": ("graph_neutral", "scheduler-side; graphs are unchanged"),
    "function_call": ("graph_neutral", "output parsing; graphs are unchanged"),
    "reasoning_parser": ("graph_neutral", "output parsing; graphs are unchanged"),
    "context_parallel": ("not_implemented", "needs sharded attention and per-rank pool keys"),
    "sequence_parallel": ("not_implemented", "needs sharded activations"),
    "mtp": ("not_implemented", "multi-token prediction layer (its KV would be saved too)"),
    "yarn": ("not_implemented", "YaRN for Qwen3 (DeepSeek-V3 YaRN is set in dims.rope_scaling)"),
    "splitfuse_scheduling": ("not_implemented", "chunked-prefill scheduling"),
    "micro_batch": ("not_implemented", "two micro-batches overlapping compute and communication"),
    "multi_lora": ("not_implemented", "LoRA adapters"),
}

ASYNC_WRITE_FAMILIES = ("qwen3_dense", "deepseek_v3")
ASYNC_WRITE_EXCLUDES = ("splitfuse_scheduling", "micro_batch", "multi_lora")
POOL_WRITE_REQUIRES = "prefix_cache"


def check_compat(spec):
    """Yield (dotted path, message, fix) for every rule the spec breaks."""
    feats = list(spec.features)
    seen = set()
    for i, f in enumerate(feats):
        if f in seen:
            yield "features", f"feature '{f}' is listed twice", "remove the duplicate"
        seen.add(f)
        if f not in FEATURES:
            close = difflib.get_close_matches(f, list(FEATURES), n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"known features: {', '.join(FEATURES)}"
            yield "features", f"unknown feature '{f}'", fix
    write = spec.mempool.write
    if write != "off" and POOL_WRITE_REQUIRES not in seen:
        yield ("mempool.write", f"mempool.write: {write} needs the '{POOL_WRITE_REQUIRES}' feature",
               f"add {POOL_WRITE_REQUIRES} to features, or set mempool.write: off")
    if write == "async":
        if spec.family not in ASYNC_WRITE_FAMILIES:
            yield ("mempool.write", f"async write is not supported for family {spec.family}",
                   "use mempool.write: sync")
        for f in ASYNC_WRITE_EXCLUDES:
            if f in seen:
                yield ("features", f"async write does not combine with '{f}'",
                       f"remove '{f}' or set mempool.write: sync")
    for f in feats:
        status, note = FEATURES.get(f, ("", ""))
        if status == "not_implemented" and not (write == "async" and f in ASYNC_WRITE_EXCLUDES):
            yield ("features", f"feature '{f}' is not implemented yet ({note})",
                   f"remove '{f}' from features")
    d = spec.dims
    if spec.family == "qwen3_dense":
        if d.num_attention_heads % d.num_key_value_heads:
            yield ("dims.num_key_value_heads",
                   f"num_key_value_heads ({d.num_key_value_heads}) must divide num_attention_heads "
                   f"({d.num_attention_heads})", "pick a divisor of num_attention_heads")
        if d.head_dim % 2:
            yield "dims.head_dim", f"head_dim ({d.head_dim}) must be even for RoPE", "use an even head_dim"
    else:
        if d.num_experts_per_tok > d.n_routed_experts:
            yield ("dims.num_experts_per_tok",
                   f"num_experts_per_tok ({d.num_experts_per_tok}) exceeds n_routed_experts ({d.n_routed_experts})",
                   "choose at most n_routed_experts")
        if d.n_routed_experts % d.n_group:
            yield ("dims.n_group", f"n_group ({d.n_group}) must divide n_routed_experts ({d.n_routed_experts})",
                   "pick a divisor of n_routed_experts")
        if d.topk_group > d.n_group:
            yield "dims.topk_group", f"topk_group ({d.topk_group}) exceeds n_group ({d.n_group})", "use topk_group <= n_group"
        if d.first_k_dense_replace > d.num_hidden_layers:
            yield ("dims.first_k_dense_replace",
                   f"first_k_dense_replace ({d.first_k_dense_replace}) exceeds num_hidden_layers ({d.num_hidden_layers})",
                   "use at most num_hidden_layers")
        if d.qk_rope_head_dim % 2:
            yield "dims.qk_rope_head_dim", "qk_rope_head_dim must be even for RoPE", "use an even value"
    for name, v in spec.variants.items():
        if v.phase == "decode" and v.history:
            yield (f"variants.{name}.history", f"variant {name}: 'history' applies to prefill only "
                   "(decode always attends to the cache)", "remove history from the decode variant")
        if v.phase == "decode" and v.save:
            yield (f"variants.{name}.save", f"variant {name}: decode graphs never save KV "
                   "(only a prefill's full blocks go to the pool)", "remove save from the decode variant")
        if v.save and write == "off":
            yield (f"variants.{name}.save", f"variant {name}: save: true but mempool.write is off",
                   "set mempool.write: sync or async, or drop save")
        if v.history and POOL_WRITE_REQUIRES not in seen:
            yield (f"variants.{name}.history", f"variant {name}: history KV comes from the pool, "
                   f"which needs the '{POOL_WRITE_REQUIRES}' feature", f"add {POOL_WRITE_REQUIRES} to features")
    if spec.targets.cpu is None and spec.targets.npu is None:
        yield "targets", "no target enabled", "add 'cpu: {}' and/or 'npu: {}' under targets"
    if spec.targets.npu is not None:
        modes = spec.targets.npu.compile_modes
        if not modes:
            yield "targets.npu.compile_modes", "compile_modes is empty", "list max-autotune and/or reduce-overhead"
        if len(set(modes)) != len(modes):
            yield "targets.npu.compile_modes", "a compile mode is listed twice", "remove the duplicate"
