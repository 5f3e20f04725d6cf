"""The compatibility matrix: one declared table of what graphgen implements and what combines.

Mirrors the seed's documented rules (MindIE-LLM async write): pool writes need prefix caching;
async write only for Qwen dense and DeepSeek-V3; async write does not combine with SplitFuse
scheduling, Micro Batch or Multi-LoRA. Features graphgen does not implement are rejected, never
silently ignored.

Every combination rule lives in :data:`MATRIX` (rendered into ``docs/spec.md`` as is). The rest of
this module is consistency rules that are not about combining features (shape rules of the dims,
variant settings that would have no effect, targets).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import get_args

from .model import Family, WriteMode

FAMILIES: tuple[str, ...] = get_args(Family)
WRITE_MODES: tuple[str, ...] = get_args(WriteMode)

STATUSES = ("implemented", "graph_neutral", "not_implemented")


@dataclass(frozen=True)
class Row:
    """One row of the matrix.

    ``subject`` is a feature name (listed under ``features:``) or ``write:<mode>`` (a
    ``mempool.write`` value). A spec uses the subject only if its family is in ``families`` and its
    ``mempool.write`` is in ``writes``; a feature is required when the write mode is in ``required_by``.
    """

    subject: str
    status: str  # implemented | graph_neutral (accepted, changes no graph) | not_implemented (rejected)
    families: tuple[str, ...]
    writes: tuple[str, ...]
    required_by: tuple[str, ...]
    note: str

    @property
    def is_feature(self) -> bool:
        return not self.subject.startswith("write:")


_NO_ASYNC = ("off", "sync")

MATRIX: tuple[Row, ...] = (
    Row("write:off", "implemented", FAMILIES, WRITE_MODES, (), "no pool writes"),
    Row("write:sync", "implemented", FAMILIES, WRITE_MODES, (), "save on the forward stream (blocks TTFT)"),
    Row("write:async", "implemented", ("qwen3_dense", "deepseek_v3"), WRITE_MODES, (),
        "save on the save stream, ordered by record/wait events"),
    Row("prefix_cache", "implemented", FAMILIES, WRITE_MODES, ("sync", "async"),
        "reuse leading full KV blocks from the pool"),
    Row("async_scheduling", "graph_neutral", FAMILIES, WRITE_MODES, (), "scheduler-side; graphs are unchanged"),
    Row("function_call", "graph_neutral", FAMILIES, WRITE_MODES, (), "output parsing; graphs are unchanged"),
    Row("reasoning_parser", "graph_neutral", FAMILIES, WRITE_MODES, (), "output parsing; graphs are unchanged"),
    Row("context_parallel", "not_implemented", FAMILIES, WRITE_MODES, (),
        "needs sharded attention and per-rank pool keys"),
    Row("sequence_parallel", "not_implemented", FAMILIES, WRITE_MODES, (), "needs sharded activations"),
    Row("mtp", "not_implemented", ("deepseek_v3",), WRITE_MODES, (),
        "multi-token prediction layer (its KV would be saved too)"),
    Row("yarn", "not_implemented", ("qwen3_dense",), WRITE_MODES, (),
        "YaRN for Qwen3 (DeepSeek-V3 YaRN is set in dims.rope_scaling)"),
    Row("splitfuse_scheduling", "not_implemented", FAMILIES, _NO_ASYNC, (), "chunked-prefill scheduling"),
    Row("micro_batch", "not_implemented", FAMILIES, _NO_ASYNC, (),
        "two micro-batches overlapping compute and communication"),
    Row("multi_lora", "not_implemented", FAMILIES, _NO_ASYNC, (), "LoRA adapters"),
)

ROWS: dict[str, Row] = {r.subject: r for r in MATRIX}
# feature -> (status, note): the feature rows of the matrix (kept for callers of the old table).
FEATURES: dict[str, tuple[str, str]] = {r.subject: (r.status, r.note) for r in MATRIX if r.is_feature}
# Features a spec may list (the JSON Schema's enum): everything not rejected outright.
ACCEPTED_FEATURES: tuple[str, ...] = tuple(f for f, (st, _) in FEATURES.items() if st != "not_implemented")

_MISSING = object()


def _get(spec, name):
    return getattr(spec, name, _MISSING)


def check_compat(spec):
    """Yield (dotted path, message, fix) for every rule the spec breaks.

    ``spec`` is a :class:`ModelSpec`, or (from the loader) any object with the subset of its
    attributes that parsed cleanly: each rule group runs when the attributes it reads are present,
    so one bad field does not hide the other problems of a file.
    """
    yield from _matrix_rules(spec)
    yield from _dims_rules(spec)
    yield from _variant_rules(spec)
    yield from _target_rules(spec)


def _matrix_rules(spec):
    feats, mempool, family = _get(spec, "features"), _get(spec, "mempool"), _get(spec, "family")
    if feats is _MISSING:
        return
    write = mempool.write if mempool is not _MISSING else None
    seen = set()
    for i, f in enumerate(feats):
        where = f"features[{i}]"
        if f in seen:
            yield where, f"feature '{f}' is listed twice", "remove the duplicate"
            continue
        seen.add(f)
        row = ROWS.get(f)
        if row is None or not row.is_feature:
            close = difflib.get_close_matches(f, list(FEATURES), n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"known features: {', '.join(FEATURES)}"
            yield where, f"unknown feature '{f}'", fix
            continue
        if family is not _MISSING and family not in row.families:
            yield (where, f"feature '{f}' does not apply to family {family} (only {', '.join(row.families)})",
                   f"remove '{f}' from features")
        elif write is not None and write not in row.writes:
            yield (where, f"mempool.write: {write} does not combine with '{f}'",
                   f"remove '{f}' or set mempool.write: {row.writes[-1]}")
        elif row.status == "not_implemented":
            yield where, f"feature '{f}' is not implemented yet ({row.note})", f"remove '{f}' from features"
    if write is None:
        return
    mode = ROWS[f"write:{write}"]
    if family is not _MISSING and family not in mode.families:
        ok = [m.subject[6:] for m in MATRIX if not m.is_feature and family in m.families]
        yield ("mempool.write", f"mempool.write: {write} is not supported for family {family}",
               f"use mempool.write: {' or '.join(ok)}")
    for row in MATRIX:
        if row.is_feature and write in row.required_by and row.subject not in seen:
            yield ("mempool.write", f"mempool.write: {write} needs the '{row.subject}' feature",
                   f"add {row.subject} to features, or set mempool.write: off")


def _dims_rules(spec):
    family, d = _get(spec, "family"), _get(spec, "dims")
    if family is _MISSING or d is _MISSING:
        return
    if family == "qwen3_dense":
        if d.num_attention_heads % d.num_key_value_heads:
            yield ("dims.num_key_value_heads",
                   f"num_key_value_heads ({d.num_key_value_heads}) must divide num_attention_heads "
                   f"({d.num_attention_heads})", "pick a divisor of num_attention_heads")
        if d.head_dim % 2:
            yield "dims.head_dim", f"head_dim ({d.head_dim}) must be even for RoPE", "use an even head_dim"
        return
    if d.num_experts_per_tok > d.n_routed_experts:
        yield ("dims.num_experts_per_tok",
               f"num_experts_per_tok ({d.num_experts_per_tok}) exceeds n_routed_experts ({d.n_routed_experts})",
               "choose at most n_routed_experts")
    if d.n_routed_experts % d.n_group:
        yield ("dims.n_group", f"n_group ({d.n_group}) must divide n_routed_experts ({d.n_routed_experts})",
               "pick a divisor of n_routed_experts")
    elif d.n_routed_experts // d.n_group < 2:
        # The router scores a group by the sum of its two best experts (noaux_tc).
        yield ("dims.n_group", f"n_group ({d.n_group}) leaves fewer than 2 experts per group "
               f"({d.n_routed_experts} routed experts)", "use n_group <= n_routed_experts / 2")
    if d.topk_group > d.n_group:
        yield "dims.topk_group", f"topk_group ({d.topk_group}) exceeds n_group ({d.n_group})", "use topk_group <= n_group"
    elif not d.n_routed_experts % d.n_group and d.num_experts_per_tok <= d.n_routed_experts:
        kept = d.topk_group * (d.n_routed_experts // d.n_group)
        if d.num_experts_per_tok > kept:
            # Experts outside the kept groups are masked out; top-k must fit in what is left.
            yield ("dims.num_experts_per_tok",
                   f"num_experts_per_tok ({d.num_experts_per_tok}) exceeds the {kept} experts in the "
                   f"topk_group ({d.topk_group}) groups kept per token", "raise topk_group or lower num_experts_per_tok")
    if d.first_k_dense_replace > d.num_hidden_layers:
        yield ("dims.first_k_dense_replace",
               f"first_k_dense_replace ({d.first_k_dense_replace}) exceeds num_hidden_layers ({d.num_hidden_layers})",
               "use at most num_hidden_layers")
    if d.qk_rope_head_dim % 2:
        yield "dims.qk_rope_head_dim", f"qk_rope_head_dim ({d.qk_rope_head_dim}) must be even for RoPE", "use an even value"


def _variant_rules(spec):
    variants, mempool, feats = _get(spec, "variants"), _get(spec, "mempool"), _get(spec, "features")
    if variants is _MISSING:
        return
    write = mempool.write if mempool is not _MISSING else None
    for name, v in variants.items():
        if v.phase == "decode" and v.history:
            yield (f"variants.{name}.history", f"variant {name}: 'history' applies to prefill only "
                   "(decode always attends to the cache)", "remove history from the decode variant")
        if v.phase == "decode" and v.save:
            yield (f"variants.{name}.save", f"variant {name}: decode graphs never save KV "
                   "(only a prefill's full blocks go to the pool)", "remove save from the decode variant")
        if v.save and write == "off":
            yield (f"variants.{name}.save", f"variant {name}: save: true but mempool.write is off",
                   "set mempool.write: sync or async, or drop save")
        if v.history and feats is not _MISSING and "prefix_cache" not in feats:
            yield (f"variants.{name}.history", f"variant {name}: history KV comes from the pool, "
                   "which needs the 'prefix_cache' feature", "add prefix_cache to features")
        saves = write not in (None, "off") and v.phase == "prefill" and v.save is not False
        if v.granularity is not None and write is not None and not saves:
            why = "decode graphs never save" if v.phase == "decode" else (
                "mempool.write is off" if write == "off" else "save is false")
            yield (f"variants.{name}.granularity", f"variant {name}: granularity has no effect ({why})",
                   "remove granularity from this variant")


def _target_rules(spec):
    targets = _get(spec, "targets")
    if targets is _MISSING:
        return
    if targets.cpu is None and targets.npu is None:
        yield "targets", "no target enabled", "add 'cpu: {}' and/or 'npu: {}' under targets"
    if targets.npu is not None:
        modes = targets.npu.compile_modes
        if not modes:
            yield "targets.npu.compile_modes", "compile_modes is empty", "list max-autotune and/or reduce-overhead"
        for i, mode in enumerate(modes):
            if mode in modes[:i]:
                yield f"targets.npu.compile_modes[{i}]", f"compile mode '{mode}' is listed twice", "remove the duplicate"
