"""Spec-level check of the kernels' documented limits for a spec that declares the NPU target.

``check_spec_limits(spec)`` returns ``[(field_path, message, source)]``: every spec field that would make
a generated NPU module call a kernel outside a row of ``graphgen.npu.check.limits.LIMITS``.  Each check names
its row, so the limit's words and its source line live in one place.  Torch-free (``graphgen validate``
runs it on the build path).  A spec without ``targets.npu`` returns [].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...families import FAMILIES
from ...modelspec.errors import Diagnostic
from ...modelspec.loader import load_tree, locate
from .limits import BY_KEY


@dataclass(frozen=True)
class SpecCheck:
    """A spec field that feeds one documented kernel limit."""

    row: str                                # key of the limit row in limits.LIMITS
    field_path: str                         # where in the spec the offending value lives
    applies: Callable[[object], bool] = field(compare=False)   # families/variants it concerns
    bad: Callable[[object], bool] = field(compare=False)       # True when the spec violates the row
    got: Callable[[object], object] = field(compare=False)     # the offending value, for the message


def _gqa(s) -> bool:
    return FAMILIES[s.family].attention == "gqa"


def _mla(s) -> bool:
    return FAMILIES[s.family].attention == "mla"


def _moe(s) -> bool:
    return FAMILIES[s.family].has_moe(s.dims)


def _multi_token(s) -> bool:
    # prefill/splitfuse variants run paged attention with query S > 1
    return any(v.phase == "prefill" for v in s.variants.values())


def _model_dtype(s) -> str:
    # NpuTarget.dtype (the activations/weights dtype) once the spec has it; the KV dtype until then
    return getattr(s.targets.npu, "dtype", None) or s.kv_cache.dtype


def _max_prefill_tokens(s) -> int:
    return max(getattr(s.targets.npu, "prefill_token_buckets", None) or (1024,))


def _max_decode_batch(s) -> int:
    return max(getattr(s.targets.npu, "decode_batch_buckets", None) or (8,))


def _gqa_heads(s) -> tuple[int, int]:
    """(query heads, KV heads) on one tensor-parallel rank: KV heads fewer than tp are replicated."""
    tp = s.parallel.tp
    return s.dims.num_attention_heads // tp, max(1, s.dims.num_key_value_heads // tp)


def _max_model_len(s) -> int:
    """The context an NPU rank serves: ``targets.npu.max_model_len``, else max_position_embeddings capped
    at 4096 (as `graphgen.npu.run.bucketing.max_model_len`, which imports torch; a test pins the two)."""
    own = getattr(s.targets.npu, "max_model_len", None)
    return own if own is not None else min(4096, getattr(s.dims, "max_position_embeddings", 4096))


def _mla_history(s) -> bool:
    return _mla(s) and any(v.phase == "prefill" and v.history for v in s.variants.values())


def _max_gather_rows(s) -> int:
    """The most KV rows (S) an MLA history graph gathers and attends over in TND: a step padded to a
    bucket or a mixed-grid cell of B sequences has (B - 1) full tables plus its T tokens
    (`graphgen.npu.run.inputs.StepPadding.gather_rows`); the mixed cells add the decode rows to B
    (`graphgen.npu.run.mixed_grid`: B = D + prefill_seqs + 1, cells with T >= D + prefill_seqs + 1)."""
    npu = s.targets.npu
    bs = s.kv_cache.block_size
    table = -(-_max_model_len(s) // bs) * bs
    ps, tokens = npu.prefill_seqs, tuple(getattr(npu, "prefill_token_buckets", None) or (1024,))
    rows = [ps * table + t for t in tokens]
    rows += [(d + ps) * table + t for d in (getattr(npu, "decode_batch_buckets", None) or (8,)) for t in tokens
             if t >= d + ps + 1]
    return max(rows)


def _expert_groups(s) -> int:
    """The groups ``npu_moe_compute_expert_tokens`` counts on a rank (graphgen.lower.npu_helpers._moe_residual)."""
    ep = s.parallel.ep
    return s.dims.n_routed_experts // ep + (1 if ep > 1 else 0)


def _all(s) -> bool:
    return True


CHECKS: tuple[SpecCheck, ...] = (
    SpecCheck("fia.dtype", "kv_cache.dtype", _all, lambda s: s.kv_cache.dtype not in ("float16", "bfloat16", "int8"),
              lambda s: s.kv_cache.dtype),
    SpecCheck("fia.dtype", "targets.npu.dtype", lambda s: getattr(s.targets.npu, "dtype", None) is not None,
              lambda s: _model_dtype(s) not in ("float16", "bfloat16"), _model_dtype),
    SpecCheck("fia.pa.block_size", "kv_cache.block_size", lambda s: _gqa(s) and _multi_token(s),
              lambda s: s.kv_cache.block_size < 128 or s.kv_cache.block_size % 128, lambda s: s.kv_cache.block_size),
    SpecCheck("fia.mla.block_size", "kv_cache.block_size", _mla,
              lambda s: s.kv_cache.block_size not in (16, 128), lambda s: s.kv_cache.block_size),
    SpecCheck("rope.head_dim", "dims.head_dim", _gqa, lambda s: s.dims.head_dim not in (64, 128),
              lambda s: s.dims.head_dim),
    SpecCheck("interleave_rope.dim", "dims.qk_rope_head_dim", _mla, lambda s: s.dims.qk_rope_head_dim != 64,
              lambda s: s.dims.qk_rope_head_dim),
    SpecCheck("fia.mla.rope_dim", "dims.qk_rope_head_dim", _mla, lambda s: s.dims.qk_rope_head_dim != 64,
              lambda s: s.dims.qk_rope_head_dim),
    SpecCheck("fia.mla.latent_dim", "dims.kv_lora_rank", _mla, lambda s: s.dims.kv_lora_rank != 512,
              lambda s: s.dims.kv_lora_rank),
    # per rank (num_heads / tp); the decode helper pads a rank's heads up to the next power of two (v2 BNSD)
    SpecCheck("fia2.mla.heads", "dims.num_attention_heads", _mla,
              lambda s: s.dims.num_attention_heads // s.parallel.tp > 128,
              lambda s: f"{s.dims.num_attention_heads} heads over tp={s.parallel.tp} ranks"),
    # un-absorbed MLA prefill/splitfuse: the helper pads a rank's heads up to the next of 8/16/32/64/128,
    # so only more than 128 heads per rank cannot be padded into the v1 TND set
    SpecCheck("fia.dense.head_count", "dims.num_attention_heads", _mla,
              lambda s: s.dims.num_attention_heads // s.parallel.tp > 128,
              lambda s: f"{s.dims.num_attention_heads} heads over tp={s.parallel.tp} ranks"),
    SpecCheck("fia.dense.tokens", "targets.npu.prefill_token_buckets", _mla,
              lambda s: _max_prefill_tokens(s) > 65536, _max_prefill_tokens),
    # the KV side of the same TND call: every history row the splitfuse/mixed graphs gather (audit 3 N9)
    SpecCheck("fia.dense.tokens", "targets.npu.max_model_len", _mla_history,  # (query side reported above)
              lambda s: _max_gather_rows(s) > 65536 and _max_prefill_tokens(s) <= 65536,
              lambda s: f"max_model_len {_max_model_len(s)} makes a history step gather up to "
                        f"{_max_gather_rows(s)} KV rows"),
    # TND (prefill/splitfuse, both families) runs prefill_seqs + 1 sequences; decode is BSH/BNSD (v2)
    SpecCheck("fia.tnd.sequences", "targets.npu.prefill_seqs", _all,
              lambda s: s.targets.npu.prefill_seqs + 1 > 4096, lambda s: s.targets.npu.prefill_seqs),
    # the static decode graph: v2 BSH/BNSD with one query token per sequence, B = the decode batch bucket
    SpecCheck("fia2.decode.dims", "targets.npu.decode_batch_buckets", _all,
              lambda s: _max_decode_batch(s) > 65536, _max_decode_batch),
    SpecCheck("fia2.gqa.ratio", "dims.num_attention_heads", _gqa,
              lambda s: _gqa_heads(s)[0] % _gqa_heads(s)[1] or _gqa_heads(s)[0] // _gqa_heads(s)[1] > 64,
              lambda s: f"{s.dims.num_attention_heads} heads over {s.dims.num_key_value_heads} KV heads at tp={s.parallel.tp}: "
                        "{} per {} on a rank".format(*_gqa_heads(s))),
    # the MoE helper counts a rank's E/ep experts, plus one group for other ranks' pairs under ep > 1
    SpecCheck("moe_expert_tokens.input", "dims.n_routed_experts", _moe,
              lambda s: not 0 < _expert_groups(s) <= 2048,
              lambda s: f"{s.dims.n_routed_experts} experts over ep={s.parallel.ep}: {_expert_groups(s)} groups"),
    SpecCheck("fia.tnd.reduce_overhead", "targets.npu.compile_modes", _gqa,
              lambda s: "reduce-overhead" in s.targets.npu.compile_modes, lambda s: list(s.targets.npu.compile_modes)),
    SpecCheck("moe_gating.groups", "dims.n_group", _moe,
              lambda s: s.dims.n_routed_experts % s.dims.n_group
              or not 1 <= s.dims.num_experts_per_tok <= s.dims.n_routed_experts // s.dims.n_group * s.dims.topk_group,
              lambda s: f"n_routed_experts={s.dims.n_routed_experts}, n_group={s.dims.n_group}, "
                        f"topk_group={s.dims.topk_group}, num_experts_per_tok={s.dims.num_experts_per_tok}"),
    SpecCheck("moe_gating.k_max", "dims.num_experts_per_tok", _moe,
              lambda s: not 1 <= s.dims.num_experts_per_tok <= 32, lambda s: s.dims.num_experts_per_tok),
)


def check_spec_limits(spec) -> list[tuple[str, str, str]]:
    """``[(field_path, message, source)]`` for every documented kernel limit the spec's NPU target breaks."""
    if getattr(getattr(spec, "targets", None), "npu", None) is None:
        return []
    out = []
    for c in CHECKS:
        if c.applies(spec) and c.bad(spec):
            row = BY_KEY[c.row]
            out.append((c.field_path, f"{c.got(spec)!r} is outside a documented limit of torch_npu.{row.op}: "
                                      f"{row.text} [{row.key}]", row.source))
    return out


def limit_diagnostics(path, spec=None) -> list[Diagnostic]:
    """Every documented NPU kernel limit the spec at ``path`` breaks ([] without ``targets.npu``)."""

    loaded, root = load_tree(Path(path))
    found = check_spec_limits(spec if spec is not None else loaded)
    out = []
    for field_path, message, source in found:
        line, col = locate(root, field_path)
        out.append(Diagnostic(str(path), line, col, f"{field_path}: NPU kernel limit: {message} (source: {source})",
                              f"change {field_path} to a value inside the documented limit, or remove the npu "
                              f"target (targets.npu) if this spec is not meant for Ascend hardware"))
    return out


# --------------------------------------------------------------------------- doc conflicts to measure (audit 4)
def doc_conflicts(spec) -> list[tuple[str, str]]:
    """``[(id, what the first hardware run must measure)]``: calls the lowering makes that one reading of the
    kernel docs allows and another forbids (audit 4 M4, M7, M8).  Not refusals (the lowering follows the reading
    vllm-ascend runs); docs/npu.md's hardware checklist (H8) lists them, with these numbers, for the shipped specs."""
    npu = getattr(getattr(spec, "targets", None), "npu", None)
    if npu is None:
        return []
    out = []
    if _moe(spec):
        rows = _max_prefill_tokens(spec) * spec.parallel.dp  # DP attention gathers every DP rank's tokens
        elems = rows * spec.dims.hidden_size
        if elems >= 1 << 24:
            out.append(("M4", f"npu_moe_init_routing x [{rows}, {spec.dims.hidden_size}] = {elems} elements "
                              f">= 2^24 ({1 << 24}): allowed per dimension, refused if :11017's 'shape大小' is the "
                              f"element count; measure the largest prefill bucket at dp={spec.parallel.dp}"))
        if getattr(getattr(spec, "quantization", None), "method", "none") == "w8a8_dynamic" and spec.parallel.ep > 1:
            out.append(("M7", f"npu_grouped_matmul per-token W8A8 under ep={spec.parallel.ep}: scale 2-D [E, N] for "
                              f"one [E, K, N] weight (:5852 says 1-D per tensor) and a group_list ending below M "
                              f"(other ranks' rows): measure both at the first MoE layer"))
    if _gqa(spec) and spec.dims.head_dim == 128:
        out.append(("M8", "npu_fused_infer_attention_score TND + block_table (page attention) at D=128 for "
                          "prefill/splitfuse: older CANN docs require D=192 under TND; note the CANN version and "
                          "whether the first prefill warm-up graph compiles"))
    return out
