"""The compatibility matrix: one declared table of what graphgen implements and what combines.

Mirrors the seed's documented rules (MindIE-LLM async write): pool writes need prefix caching;
async write only for Qwen dense and DeepSeek-V3; async write does not combine with Micro Batch or
Multi-LoRA (the seed also excludes SplitFuse scheduling; graphgen's chunked prefill combines with every
write mode: each chunk's step saves the blocks it completes, ordered by that step's events). Features graphgen does not implement are rejected, never
silently ignored.

Every combination rule lives in :data:`MATRIX` (rendered into ``docs/spec.md`` as is). The rest of
this module is consistency rules that are not about combining features (shape rules of the dims,
variant settings that would have no effect, targets).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterator, get_args

from ..families import FAMILIES as _FAMILY_REGISTRY
from ..families.base import Rule
from .model import FamilyName, NpuTarget, WriteMode

FAMILIES: tuple[str, ...] = get_args(FamilyName)
WRITE_MODES: tuple[str, ...] = get_args(WriteMode)

STATUSES = ("implemented", "graph_neutral", "derived", "not_implemented")


@dataclass(frozen=True)
class Row:
    """One row of the matrix.

    ``subject`` is a feature name (listed under ``features:``) or ``write:<mode>`` (a
    ``pool.write`` value). A spec uses the subject only if its family is in ``families`` and its
    ``pool.write`` is in ``writes``; a feature is required when the write mode is in ``required_by``.
    """

    subject: str
    status: str  # implemented | graph_neutral (accepted, changes no graph) | derived (on when the spec's
    # ``parallel:`` says so, never listed: see DERIVED) | not_implemented (rejected)
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
    Row("context_parallel", "derived", FAMILIES, WRITE_MODES, (),
        "on when parallel.cp > 1: prefill split head-tail over the CP ranks, KV all-gathered per layer, "
        "decode KV replicated (docs/parallel.md)"),
    Row("sequence_parallel", "derived", FAMILIES, WRITE_MODES, (),
        "on when parallel.sp is true: reduce-scatter + norm + all-gather inside the TP group (docs/parallel.md)"),
    Row("mtp", "implemented", ("deepseek_v3",), WRITE_MODES, (),
        "multi-token prediction layers, enabled by the `mtp:` section (not listed under features); "
        "their KV is saved and loaded with the target's"),
    Row("yarn", "not_implemented", ("qwen3_dense",), WRITE_MODES, (),
        "YaRN for Qwen3 (DeepSeek-V3 YaRN is set in dims.rope_scaling)"),
    Row("splitfuse_scheduling", "implemented", FAMILIES, WRITE_MODES, (),
        "chunked prefill: chunk k > 0 runs the history variant; each chunk saves the blocks it completes"),
    Row("micro_batch", "not_implemented", FAMILIES, _NO_ASYNC, (),
        "two micro-batches overlapping compute and communication"),
    Row("multi_lora", "implemented", FAMILIES, WRITE_MODES, (),
        "per-request LoRA adapters, enabled by the `lora:` section (not listed under features); pool keys "
        "salted by the adapter's weights (docs/lora.md); not yet with parallel ranks (tp/dp/cp/ep > 1)"),
)

ROWS: dict[str, Row] = {r.subject: r for r in MATRIX}
# derived feature -> (the ``parallel:`` field that turns it on, an example setting for the fix)
DERIVED = {"context_parallel": ("parallel.cp", "cp: 2"), "sequence_parallel": ("parallel.sp", "sp: true")}
# feature -> (status, note): the feature rows of the matrix (kept for callers of the old table).
FEATURES: dict[str, tuple[str, str]] = {r.subject: (r.status, r.note) for r in MATRIX if r.is_feature}
# Rows a spec enables by a section of its own rather than under ``features:`` (the section's key).
SECTION_ROWS: dict[str, str] = {"mtp": "mtp: {num_layers: 1}", "multi_lora": "lora: {max_loras: 4}"}
# Features a spec may list (the JSON Schema's enum): everything not rejected outright, derived or a section's.
ACCEPTED_FEATURES: tuple[str, ...] = tuple(f for f, (st, _) in FEATURES.items()
                                         if st not in ("not_implemented", "derived") and f not in SECTION_ROWS)

_MISSING = object()


def _get(spec: Any, name: str) -> Any:
    return getattr(spec, name, _MISSING)


def check_compat(spec: Any) -> Iterator[Rule]:
    """Yield (dotted path, message, fix) for every rule the spec breaks (``spec``: a `ModelSpec`, or
    the loader's namespace of the fields it could parse: an absent one is skipped).

    ``spec`` is a :class:`ModelSpec`, or (from the loader) any object with the subset of its
    attributes that parsed cleanly: each rule group runs when the attributes it reads are present,
    so one bad field does not hide the other problems of a file.
    """
    yield from _matrix_rules(spec)
    yield from _dims_rules(spec)
    yield from _variant_rules(spec)
    yield from _pool_rules(spec)
    yield from _target_rules(spec)
    yield from _parallel_rules(spec)
    yield from _mtp_rules(spec)
    yield from _quant_rules(spec)
    yield from _lora_rules(spec)


def _lora_rules(spec: Any) -> Iterator[Rule]:
    from .model import LORA_RANKS

    family, lora = _get(spec, "family"), _get(spec, "lora")
    if lora is _MISSING or lora is None:
        return
    if lora.max_lora_rank not in LORA_RANKS:
        bigger = [r for r in LORA_RANKS if r >= lora.max_lora_rank]
        yield ("lora.max_lora_rank", f"max_lora_rank {lora.max_lora_rank} is not one of vLLM's "
               f"{', '.join(map(str, LORA_RANKS))}", f"use max_lora_rank: {bigger[0] if bigger else LORA_RANKS[-1]}")
    if family is not _MISSING and family in _FAMILY_REGISTRY:
        known = _FAMILY_REGISTRY[family].lora_modules
        for i, t in enumerate(lora.targets):
            if t in lora.targets[:i]:
                yield f"lora.targets[{i}]", f"lora target '{t}' is listed twice", "remove the duplicate"
            elif t not in known:
                close = difflib.get_close_matches(t, known, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                yield (f"lora.targets[{i}]", f"lora target '{t}' is no projection a {family} adapter can target",
                       f"{hint}use some of: {', '.join(known)}")
    # with parallel ranks: the one refusal table's spec rules (graphgen.composition; _parallel_rules)


def _quant_rules(spec: Any) -> Iterator[Rule]:
    quant = _get(spec, "quantization")
    if quant is _MISSING or quant.checkpoint is None:
        return
    size = quant.checkpoint.weight_block_size
    if len(size) != 2:
        yield ("quantization.checkpoint.weight_block_size", f"weight_block_size has {len(size)} item(s); a block "
               "is [rows, cols]", "write two sizes, e.g. weight_block_size: [128, 128]")


def _mtp_rules(spec: Any) -> Iterator[Rule]:
    family, mtp, variants, targets = (_get(spec, k) for k in ("family", "mtp", "variants", "targets"))
    if variants is not _MISSING and mtp in (None, _MISSING):
        for name, v in variants.items():
            if v.phase == "mtp" and mtp is None:
                yield (f"variants.{name}.phase", f"variant {name}: phase mtp needs the model's MTP layers",
                       "add 'mtp: {num_layers: 1}' at the top level (DeepSeek-V3), or remove the variant")
    if family is _MISSING or mtp is _MISSING or mtp is None:
        return
    row = ROWS["mtp"]
    if family not in row.families:
        yield ("mtp", f"mtp: multi-token prediction layers exist for family {' or '.join(row.families)} "
               f"only, not {family}", "remove the mtp: section")
    # tp/ep: the shard pass splits the MTP layer like a decoder layer; the rank runners do not run it yet
    # (a launch refusal: graphgen.composition's table, not a spec rule)
    if variants is not _MISSING:
        for name, v in variants.items():
            if v.phase == "mtp" and (v.history or v.save is not None or v.granularity is not None):
                yield (f"variants.{name}", f"variant {name}: an mtp variant takes no history, save or granularity "
                       "(the target's KV is in the cache already; it saves whole blocks as pool.write says)",
                       "write only 'phase: mtp' for it")


def _matrix_rules(spec: Any) -> Iterator[Rule]:
    feats, pool, family = _get(spec, "features"), _get(spec, "pool"), _get(spec, "family")
    if feats is _MISSING:
        return
    write = pool.write if pool is not _MISSING else None
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
            yield (where, f"pool.write: {write} does not combine with '{f}'",
                   f"remove '{f}' or set pool.write: {row.writes[-1]}")
        elif row.status == "derived":
            setting, example = DERIVED[f]
            yield (where, f"feature '{f}' is set by {setting}, not listed in features",
                   f"remove '{f}' from features and write parallel: {{{example}}}")
        elif row.status == "not_implemented":
            yield where, f"feature '{f}' is not implemented yet ({row.note})", f"remove '{f}' from features"
        elif f in SECTION_ROWS:
            section = SECTION_ROWS[f]
            yield (where, f"'{f}' is not a feature: it is enabled by the {section.split(':')[0]}: section",
                   f"remove '{f}' from features and add '{section}' at the top level")
    if write is None:
        return
    mode = ROWS[f"write:{write}"]
    if family is not _MISSING and family not in mode.families:
        ok = [m.subject[6:] for m in MATRIX if not m.is_feature and family in m.families]
        yield ("pool.write", f"pool.write: {write} is not supported for family {family}",
               f"use pool.write: {' or '.join(ok)}")
    for row in MATRIX:
        if row.is_feature and write in row.required_by and row.subject not in seen:
            yield ("pool.write", f"pool.write: {write} needs the '{row.subject}' feature",
                   f"add {row.subject} to features, or set pool.write: off")


def _dims_rules(spec: Any) -> Iterator[Rule]:
    family, d = _get(spec, "family"), _get(spec, "dims")
    if family is _MISSING or d is _MISSING:
        return
    yield from _FAMILY_REGISTRY[family].dims_rules(d)


def _variant_rules(spec: Any) -> Iterator[Rule]:
    variants, pool, feats = _get(spec, "variants"), _get(spec, "pool"), _get(spec, "features")
    if variants is _MISSING:
        return
    write = pool.write if pool is not _MISSING else None
    for name, v in variants.items():
        if v.phase == "decode" and v.history:
            yield (f"variants.{name}.history", f"variant {name}: 'history' applies to prefill only "
                   "(decode always attends to the cache)", "remove history from the decode variant")
        if v.phase == "decode" and v.save:
            yield (f"variants.{name}.save", f"variant {name}: decode graphs never save KV "
                   "(only a prefill's full blocks go to the pool)", "remove save from the decode variant")
        if v.save and write == "off":
            yield (f"variants.{name}.save", f"variant {name}: save: true but pool.write is off",
                   "set pool.write: sync or async, or drop save")
        if v.history and feats is not _MISSING and "prefix_cache" not in feats:
            yield (f"variants.{name}.history", f"variant {name}: history KV comes from the pool, "
                   "which needs the 'prefix_cache' feature", "add prefix_cache to features")
        saves = write not in (None, "off") and v.phase == "prefill" and v.save is not False
        if v.granularity is not None and write is not None and not saves:
            why = "decode graphs never save" if v.phase == "decode" else (
                "pool.write is off" if write == "off" else "save is false")
            yield (f"variants.{name}.granularity", f"variant {name}: granularity has no effect ({why})",
                   "remove granularity from this variant")


def _pool_rules(spec: Any) -> Iterator[Rule]:
    pool, feats = _get(spec, "pool"), _get(spec, "features")
    if pool is _MISSING:
        return
    if pool.write == "off":
        if pool.save_decode:
            yield "pool.save_decode", "save_decode has no effect: pool.write is off", \
                "set pool.write: sync or async, or drop save_decode"
        if pool.policy != "write_through":
            yield "pool.policy", f"policy {pool.policy} has no effect: pool.write is off", \
                "set pool.write: sync or async, or drop policy"
    if pool.device_cache and feats is not _MISSING and "prefix_cache" not in feats:
        yield "pool.device_cache", "the device prefix cache is looked up like the pool: it needs " \
            "the 'prefix_cache' feature", "add prefix_cache to features, or drop device_cache"


def _target_rules(spec: Any) -> Iterator[Rule]:
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
        yield from _npu_rules(spec, targets.npu)


def _npu_rules(spec: Any, npu: NpuTarget) -> Iterator[Rule]:
    """The NPU target's shape buckets (graphgen.npu.run.bucketing pads every step to one of them)."""
    for name in ("decode_batch_buckets", "prefill_token_buckets"):
        values = getattr(npu, name)
        if not values:
            yield f"targets.npu.{name}", f"{name} is empty", f"list at least one size, e.g. {name}: [1, 2, 4, 8]"
        for i in range(1, len(values)):
            if values[i] == values[i - 1] or values[i] in values[:i]:
                yield (f"targets.npu.{name}[{i}]", f"{name}: {values[i]} is listed twice",
                       "remove the duplicate (each bucket is one compiled graph)")
            elif values[i] < values[i - 1]:
                yield (f"targets.npu.{name}[{i}]", f"{name} must be ascending: {values[i]} after {values[i - 1]}",
                       f"write them in ascending order: {sorted(set(values))}")
    if npu.prefill_token_buckets and npu.prefill_token_buckets[0] < npu.prefill_seqs + 1:
        yield ("targets.npu.prefill_token_buckets[0]",
               f"prefill bucket {npu.prefill_token_buckets[0]} is smaller than prefill_seqs + 1 = "
               f"{npu.prefill_seqs + 1} (every sequence of the padded batch needs a token)",
               f"use a smallest bucket of at least {npu.prefill_seqs + 1}, or lower prefill_seqs")
    if npu.max_model_len is None:
        return
    kv = _get(spec, "kv_cache")
    if kv is not _MISSING and npu.max_model_len < kv.block_size:
        yield ("targets.npu.max_model_len", f"max_model_len {npu.max_model_len} is shorter than one block "
               f"({kv.block_size} tokens)", f"use max_model_len >= {kv.block_size}")
    d = _get(spec, "dims")
    limit = getattr(d, "max_position_embeddings", None) if d is not _MISSING else None
    if limit is not None and npu.max_model_len > limit:
        yield ("targets.npu.max_model_len", f"max_model_len {npu.max_model_len} exceeds the model's "
               f"max_position_embeddings ({limit})", f"use max_model_len <= {limit}")


def _parallel_rules(spec: Any) -> Iterator[Rule]:
    family, d, par = _get(spec, "family"), _get(spec, "dims"), _get(spec, "parallel")
    if family is _MISSING or d is _MISSING or par is _MISSING:
        return
    from ..families.parallel import layout_rules

    mtp = _get(spec, "mtp")  # the MTP layer's spec field (absent, null or off: no MTP)
    feats = _get(spec, "features")
    has_mtp = getattr(mtp, "num_layers", 0) > 0 or (feats is not _MISSING and "mtp" in feats)
    lora = _get(spec, "lora")
    # the combinations (cp/dp/sp with MTP, LoRA with ranks...): the spec rules of graphgen.composition's table
    yield from layout_rules(family, d, par, mtp=has_mtp, lora=lora not in (None, _MISSING))
