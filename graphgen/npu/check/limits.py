"""The documented limits of the torch_npu kernels graphgen's NPU lowering calls, as data.

One row per limit: the op, a predicate over one call (``Call``: the call's arguments by name, plus the
compile mode being traced) that is True when the call VIOLATES the limit, the limit in words, and its
source -- the torch-npu 2.14.0 wheel's kernel docs (``torch_npu/_op_plugin_docs.py:<lines>``) or, where
the wheel has no docstring, the hiascend page.  The CPU stand-in checks every row of an op before its
kernel runs (``graphgen.npu.standin.oplib``), and ``check_spec_limits`` checks a spec declaring the NPU target
against the same rows.  Rows come from reading the docs; no row was confirmed on hardware.
Torch-free at import (``graphgen validate`` is on the torch-free build path): dtypes are compared by
name and tensors recognised by their ``dtype``/``shape`` attributes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

DOCS = "torch_npu/_op_plugin_docs.py"
FIA = "npu_fused_infer_attention_score"
FIA2 = "npu_fused_infer_attention_score_v2"  # the static decode graph's BSH/BNSD attention
HALF = ("float16", "bfloat16")


@dataclass(frozen=True)
class Call:
    """One kernel call as the limits see it: arguments by parameter name, and the compile mode."""

    op: str
    args: dict
    mode: Optional[str] = None  # "max-autotune" / "reduce-overhead" while the stand-in backend traces
    tiling_sink: bool = False   # the traced config's experimental_config.tiling_schedule_optimize

    def get(self, name, default=None):
        v = self.args.get(name, default)
        return default if v is None else v


@dataclass(frozen=True)
class Limit:
    """One documented kernel limit."""

    key: str          # short stable id, e.g. "fia.mla.query_len"
    op: str           # torch_npu op name
    text: str         # the limit in words
    source: str       # wheel doc file:line (or page) where it is stated
    violated: Callable[[Call], bool] = field(compare=False)


class KernelLimitError(ValueError):
    """A call outside a kernel's documented limits (raised by the stand-in at trace and run time)."""


def value(x) -> int:
    """An int argument's value without installing a Dynamo guard (a SymInt's hint)."""
    if type(x).__name__ == "SymInt" and x.node.hint is not None:
        return int(x.node.hint)
    return int(x)


def _ints(xs) -> list[int]:
    return [value(x) for x in (xs or [])]


def _tensor(t) -> bool:
    return hasattr(t, "dtype") and hasattr(t, "shape")


def _dtype(t) -> Optional[str]:
    return str(t.dtype).removeprefix("torch.") if _tensor(t) else None


def _query_lens(c: Call) -> list[int]:
    cum = _ints(c.get("actual_seq_lengths"))
    return [b - a for a, b in zip([0] + cum, cum)]


def _mla(c: Call) -> bool:
    return c.get("query_rope") is not None


def _paged(c: Call) -> bool:
    return c.get("block_table") is not None


def _dense_tnd(c: Call) -> bool:
    """The non-paged TND form without query_rope whose query D is not 512."""
    return (c.get("input_layout", "BSH") == "TND" and not _paged(c) and not _mla(c)
            and _last(c.args.get("query")) != 512)


def _multi_token(c: Call) -> bool:
    return c.get("input_layout", "BSH") == "TND" and any(q > 1 for q in _query_lens(c))


def _last(t) -> Optional[int]:
    return t.shape[-1] if _tensor(t) else None


def _v2_decode_dims(c: Call) -> tuple[int, int, int, int]:
    """(B, query N, KV S, D) of a v2 BSH/BNSD page-attention call (KV S = block_table columns x block size)."""
    q, n = c.args.get("query"), value(c.get("num_query_heads", 1))
    d = q.shape[-1] // n if c.get("input_layout", "BSH") == "BSH" else q.shape[-1]
    table = c.get("block_table")
    kv_s = table.shape[1] * value(c.get("block_size", 0)) if _tensor(table) else 0
    return q.shape[0], n, kv_s, d


def _v2_query_s(c: Call) -> int:
    """Query tokens per sequence (S) of a v2 BSH/BSND/BNSD call."""
    q = c.args.get("query")
    if not _tensor(q):
        return 0
    return q.shape[2] if c.get("input_layout", "BSH") == "BNSD" else q.shape[1]


def _v2_one_token(c: Call) -> bool:
    q = c.args.get("query")
    layout = c.get("input_layout", "BSH")
    return _tensor(q) and ((layout in ("BSH", "BSND") and q.shape[1] == 1) or (layout == "BNSD" and q.shape[2] == 1))


def _moe_e(c: Call) -> int:
    return c.args["x"].shape[-1]


def _first(c: Call, name: str):
    """The first tensor of a tensor-list argument (npu_grouped_matmul's x, weight, scale, ...), else None."""
    v = c.get(name)
    return v[0] if isinstance(v, (list, tuple)) and v and _tensor(v[0]) else None


def _out(c: Call) -> Optional[str]:
    """An ``output_dtype`` argument as a dtype name (a torch dtype, or the ScalarType number an ``int?`` carries)."""
    v = c.get("output_dtype")
    if v is None:
        return None
    if not isinstance(v, int) and hasattr(v, "is_floating_point"):
        return str(v).removeprefix("torch.")
    return {1: "int8", 3: "int32", 5: "float16", 6: "float32", 15: "bfloat16"}.get(value(v), str(v))


def _scale_for_output(scale: Optional[str], out: Optional[str]) -> bool:
    """The per-token int8 rows: a bfloat16 output takes a bfloat16 or float32 scale, a float16 output a
    float32 one (npu_quant_matmul :5020-5027; npu_grouped_matmul :5960-5969 pairs bfloat16/bfloat16 and
    float32/float16)."""
    return (out == "bfloat16" and scale in ("bfloat16", "float32")) or (out == "float16" and scale == "float32")


def _gmm_quant_bad(c: Call) -> bool:
    x, w, scale, tok = (_first(c, n) for n in ("x", "weight", "scale", "per_token_scale"))
    if tok is None and scale is None:
        return False  # the unquantized form
    return (x is None or w is None or scale is None or tok is None or _dtype(x) != "int8" or _dtype(w) != "int8"
            or _dtype(tok) != "float32" or tok.dim() != 1 or tok.shape[0] != x.shape[0]
            or not _scale_for_output(_dtype(scale), _out(c))
            or (w.dim() == 3 and tuple(scale.shape) != (w.shape[0], w.shape[-1])))


LIMITS: tuple[Limit, ...] = (
    # ------------------------------------------------------------------ fused_infer_attention_score
    Limit("fia.dtype", FIA, "query/key/value must be float16, bfloat16 or int8 (never float32)",
          f"{DOCS}:8065-8071",
          lambda c: any(_dtype(c.args.get(n)) not in (*HALF, "int8") for n in ("query", "key", "value"))),
    Limit("fia.pa.block_size", FIA, "page attention with query S > 1 needs block_size >= 128 and a multiple of 128",
          f"{DOCS}:8219",
          lambda c: _paged(c) and not _mla(c) and _multi_token(c)
          and (value(c.get("block_size", 0)) < 128 or value(c.get("block_size", 0)) % 128 != 0)),
    Limit("fia.sparse3.mask", FIA, "sparse_mode=3 needs the compressed 2048x2048 atten_mask (bool/int8/uint8)",
          f"{DOCS}:8081",
          lambda c: value(c.get("sparse_mode", 0)) == 3 and (
              not _tensor(c.get("atten_mask")) or tuple(c.get("atten_mask").shape[-2:]) != (2048, 2048)
              or _dtype(c.get("atten_mask")) not in ("bool", "int8", "uint8"))),
    Limit("fia.mla.query_len", FIA, "with query_rope (absorbed MLA) each sequence's query length must be 1..16",
          f"{DOCS}:8174-8176; v2 {DOCS}:8697-8699,8724",
          lambda c: _mla(c) and any(q > 16 for q in _query_lens(c))),
    Limit("fia.mla.num_heads", FIA, "with query_rope (absorbed MLA) num_heads must be 32, 64 or 128",
          f"{DOCS}:8174-8176",
          lambda c: _mla(c) and value(c.get("num_heads", 1)) not in (32, 64, 128)),
    Limit("fia.mla.latent_dim", FIA, "with query_rope (absorbed MLA) the query/latent D must be 512",
          f"{DOCS}:8174-8176",
          lambda c: _mla(c) and _last(c.args.get("query")) != 512),
    Limit("fia.mla.rope_dim", FIA, "with query_rope (absorbed MLA) the rope part (query_rope/key_rope last dim) must be 64",
          f"v2 {DOCS}:8697-8703",
          lambda c: _mla(c) and (_last(c.get("query_rope")) != 64 or _last(c.get("key_rope")) != 64)),
    Limit("fia.mla.block_size", FIA, "with query_rope (absorbed MLA) page attention block_size must be 16 or 128",
          f"v2 {DOCS}:8722-8724",
          lambda c: _mla(c) and _paged(c) and value(c.get("block_size", 0)) not in (16, 128)),
    Limit("fia.tnd.reduce_overhead", FIA, "input_layout TND with D != 512 is not supported in reduce-overhead mode",
          f"v2 {DOCS}:8737",
          lambda c: c.mode == "reduce-overhead" and c.get("input_layout", "BSH") == "TND"
          and _last(c.args.get("query")) != 512),
    # non-paged TND without query_rope, D != 512 (DeepSeek prefill/splitfuse on up-projected K/V)
    Limit("fia.dense.dtype", FIA, "TND without page attention and query D != 512: query/key/value bfloat16 only",
          f"v2 {DOCS}:8730",
          lambda c: _dense_tnd(c) and any(_dtype(c.args.get(n)) != "bfloat16" for n in ("query", "key", "value"))),
    Limit("fia.dense.head_dims", FIA, "TND without page attention and query D != 512: Q_D = K_D = 192, V_D 128 or 192",
          f"v2 {DOCS}:8730",
          lambda c: _dense_tnd(c) and (_last(c.args.get("query")) != 192 or _last(c.args.get("key")) != 192
                                        or _last(c.args.get("value")) not in (128, 192))),
    Limit("fia.dense.heads", FIA, "TND without page attention and query D != 512: query, key and value head counts equal",
          f"v2 {DOCS}:8730",
          lambda c: _dense_tnd(c) and len({c.args["query"].shape[1], c.args["key"].shape[1], c.args["value"].shape[1],
                                             value(c.get("num_heads", 1)),
                                             value(c.get("num_key_value_heads", 0)) or value(c.get("num_heads", 1))}) != 1),
    Limit("fia.dense.head_count", FIA, "TND without page attention and query D != 512 (v1 TND text): "
          "N in 8/16/32/64/128", f"{DOCS}:8193-8195",
          lambda c: _dense_tnd(c) and value(c.get("num_heads", 1)) not in (8, 16, 32, 64, 128)),
    Limit("fia.dense.tokens", FIA, "TND without page attention and query D != 512 (v1 TND text): T <= 65536",
          f"{DOCS}:8193-8194",
          lambda c: _dense_tnd(c) and (c.args["query"].shape[0] > 65536 or c.args["key"].shape[0] > 65536)),
    Limit("fia.tnd.sequences", FIA, "TND with query D != 512: actual_seq_lengths and actual_seq_lengths_kv "
          "have at most 4096 elements", f"v2 {DOCS}:8738",
          lambda c: c.get("input_layout", "BSH") == "TND" and _last(c.args.get("query")) != 512
          and max(len(_ints(c.get("actual_seq_lengths"))), len(_ints(c.get("actual_seq_lengths_kv")))) > 4096),
    Limit("fia.tnd.tiling_sink", FIA, "input_layout TND is not supported with graph-mode tiling schedule "
          "optimisation (tiling_schedule_optimize=True): the static decode graph needs BSH/BSND/BNSD",
          f"v1 {DOCS}:8113-8114; v2 {DOCS}:8632-8633,8737",
          lambda c: c.tiling_sink and c.get("input_layout", "BSH") == "TND"),
    # -------------------------------------------- fused_infer_attention_score_v2 (decode: BSH / BNSD, Q_S = 1)
    Limit("fia2.dtype", FIA2, "query/key/value must be float16, bfloat16 or int8 (never float32)",
          f"{DOCS}:8589-8595",
          lambda c: any(_dtype(c.args.get(n)) not in (*HALF, "int8") for n in ("query", "key", "value"))),
    Limit("fia2.tnd.tiling_sink", FIA2, "input_layout TND is not supported with graph-mode tiling schedule "
          "optimisation (tiling_schedule_optimize=True): the static decode graph needs BSH/BSND/BNSD",
          f"v2 {DOCS}:8632-8633,8737",
          lambda c: c.tiling_sink and c.get("input_layout", "BSH").startswith("TND")),
    Limit("fia2.decode.dims", FIA2, "one query token per sequence (Q_S = 1): B <= 65536, N <= 256, "
          "KV S <= 262144, D <= 512", f"{DOCS}:8806-8808",
          lambda c: _v2_one_token(c) and any(x > m for x, m in zip(_v2_decode_dims(c), (65536, 256, 262144, 512)))),
    # Not applied to MLA (query_rope): its own section allows query N up to 128 over key N 1 (:8699-8700),
    # the more specific rule (our reading; DeepSeek-V3's 128 heads on one rank need it; unverified).
    Limit("fia2.gqa.ratio", FIA2, "num_query_heads must be a multiple of num_key_value_heads, at most 64 times it "
          "(MLA: fia2.mla.heads instead)",
          f"{DOCS}:8627",
          lambda c: not _mla(c) and value(c.get("num_key_value_heads", 0)) > 0 and (
              value(c.get("num_query_heads", 1)) % value(c.get("num_key_value_heads", 0))
              or value(c.get("num_query_heads", 1)) // value(c.get("num_key_value_heads", 0)) > 64)),
    Limit("fia2.pa.bsh_cache", FIA2, "BSH/BSND page attention takes the (blocknum, blocksize, H) KV cache only",
          f"{DOCS}:8822",
          lambda c: _paged(c) and c.get("input_layout", "BSH") in ("BSH", "BSND") and _tensor(c.args.get("key"))
          and c.args["key"].dim() != 3),
    Limit("fia2.mla.heads", FIA2, "with query_rope (MLA) and query D 512: query S 1-16 and N in "
          "1/2/4/8/16/32/64/128; key N 1 and D 512; rope D 64", f"{DOCS}:8694-8700",
          lambda c: _mla(c) and _v2_decode_dims(c)[3] == 512 and (
              not 1 <= _v2_query_s(c) <= 16 or value(c.get("num_query_heads", 1)) not in (1, 2, 4, 8, 16, 32, 64, 128)
              or value(c.get("num_key_value_heads", 0)) != 1 or _last(c.args.get("key")) != 512
              or _last(c.get("query_rope")) != 64 or _last(c.get("key_rope")) != 64)),
    Limit("fia2.mla.block_size", FIA2, "with query_rope (MLA) page attention is required, block_size 16 or 128",
          f"{DOCS}:8703",
          lambda c: _mla(c) and (not _paged(c) or value(c.get("block_size", 0)) not in (16, 128))),
    Limit("fia2.mla.sparse", FIA2, "with query_rope (MLA): one query token (Q_S = 1) sparse_mode 0 and no "
          "atten_mask; Q_S > 1 (a speculative verify row) sparse_mode 3 with atten_mask", f"{DOCS}:8697",
          lambda c: _mla(c) and (
              (value(c.get("sparse_mode", 0)) != 0 or c.get("atten_mask") is not None) if _v2_one_token(c)
              else (value(c.get("sparse_mode", 0)) != 3 or c.get("atten_mask") is None))),
    # ------------------------------------------------------------------ RoPE
    Limit("rope.head_dim", "npu_apply_rotary_pos_emb", "on Atlas A2/A3 the head dim D must be 64 or 128",
          f"{DOCS}:15790-15802",
          lambda c: _last(c.args.get("query")) not in (64, 128)),
    Limit("rope.same_dtype", "npu_apply_rotary_pos_emb", "query, key, cos and sin must have the same dtype",
          f"{DOCS}:15821",
          lambda c: len({_dtype(c.args.get(n)) for n in ("query", "key", "cos", "sin")}) != 1),
    Limit("interleave_rope.dim", "npu_interleave_rope", "x's last dim D must be 64",
          "hiascend torch_npu.npu_interleave_rope (ptaoplist_002369, PyTorch 7.0.0)",
          lambda c: _last(c.args.get("x")) != 64),
    Limit("interleave_rope.dtype", "npu_interleave_rope", "x must be float16/bfloat16 and cos/sin the same dtype as x",
          "hiascend torch_npu.npu_interleave_rope (ptaoplist_002369, PyTorch 7.0.0)",
          lambda c: _dtype(c.args.get("x")) not in HALF
          or _dtype(c.args.get("cos")) != _dtype(c.args.get("x")) or _dtype(c.args.get("sin")) != _dtype(c.args.get("x"))),
    # ------------------------------------------------------------------ norms, scatter
    Limit("rms_norm.gamma_dtype", "npu_rms_norm", "gamma's dtype must equal x's (float16/bfloat16/float32)",
          f"{DOCS}:3439",
          lambda c: _dtype(c.args.get("gamma")) != _dtype(c.args.get("x"))
          or _dtype(c.args.get("x")) not in (*HALF, "float32")),
    Limit("scatter_nd_update.indices", "npu_scatter_nd_update", "indices must be int32/int64 and at least 2-D",
          f"{DOCS}:6875-6900",
          lambda c: _dtype(c.args.get("indices")) not in ("int32", "int64") or c.args["indices"].dim() < 2),
    Limit("scatter_nd_update.updates_shape", "npu_scatter_nd_update",
          "updates.shape must be indices.shape[:-1] + input.shape[indices.shape[-1]:]", f"{DOCS}:6875-6900",
          lambda c: tuple(c.args["updates"].shape) != tuple(c.args["indices"].shape[:-1])
          + tuple(c.args["self"].shape[c.args["indices"].shape[-1]:])),
    # ------------------------------------------------------------------ MoE
    Limit("moe_gating.bias_dtype", "npu_moe_gating_top_k", "x is float16/bfloat16/float32 and bias has x's dtype",
          f"{DOCS}:10816-10850",
          lambda c: _dtype(c.args.get("x")) not in (*HALF, "float32")
          or (c.get("bias") is not None and _dtype(c.get("bias")) != _dtype(c.args.get("x")))),
    Limit("moe_gating.groups", "npu_moe_gating_top_k",
          "the expert count must divide into group_count groups and 1 <= k <= experts/group_count*k_group",
          f"{DOCS}:10816-10850",
          lambda c: _moe_e(c) % value(c.get("group_count", 1)) != 0
          or not 1 <= value(c.args["k"]) <= _moe_e(c) // value(c.get("group_count", 1)) * value(c.get("k_group", 1))),
    Limit("moe_gating.k_max", "npu_moe_gating_top_k", "on Atlas A2/A3 k is in [1, 32]",
          f"{DOCS}:10816-10850", lambda c: not 1 <= value(c.args["k"]) <= 32),
    Limit("moe_routing.dropless", "npu_moe_init_routing_v2",
          "dropless, counted routing only: drop_pad_mode 0, expert_tokens_num_type 1 or 2, "
          "expert_tokens_num_flag True, quant_mode -1 or 1; expert_num in (0, 10240]; active_expert_range "
          "[start, end) with 0 <= start < end <= expert_num",
          f"{DOCS}:11098-11104",
          lambda c: value(c.get("drop_pad_mode", 0)) != 0 or value(c.get("expert_tokens_num_type", 0)) not in (1, 2)
          or not c.get("expert_tokens_num_flag", False) or value(c.get("quant_mode", -1)) not in (-1, 1)
          or not 0 < value(c.get("expert_num", -1)) <= 10240
          or (len(c.get("active_expert_range", ())) > 0
              and not 0 <= _ints(c.get("active_expert_range"))[0] < _ints(c.get("active_expert_range"))[1]
              <= value(c.get("expert_num", -1)))),
    Limit("moe_unpermute.dtype", "npu_moe_token_unpermute", "permuted_tokens and probs bfloat16 (the earlier "
          "docstring; the one torch_npu attaches also allows float16/float32), sorted_indices int32",
          f"{DOCS}:14342,14344; {DOCS}:16941-16943",
          lambda c: _dtype(c.args.get("permuted_tokens")) != "bfloat16"
          or (c.get("probs") is not None and _dtype(c.get("probs")) != "bfloat16")
          or _dtype(c.args.get("sorted_indices")) != "int32"),
    Limit("moe_unpermute.shape", "npu_moe_token_unpermute", "permuted_tokens [tokens*topK, H], sorted_indices "
          "[tokens*topK], probs [tokens, topK] with topK <= 512; padded_mode False, restore_shape None only",
          f"{DOCS}:16941-16945,16955-16956",
          lambda c: c.get("padded_mode", False) or c.get("restore_shape") is not None
          or c.args["sorted_indices"].dim() != 1
          or c.args["sorted_indices"].shape[0] != c.args["permuted_tokens"].shape[0]
          or (c.get("probs") is not None and (c.get("probs").numel() != c.args["permuted_tokens"].shape[0]
                                              or c.get("probs").shape[-1] > 512))),
    Limit("moe_finalize.drop_pad_mode", "npu_moe_finalize_routing", "drop_pad_mode: only 0 is documented",
          f"{DOCS}:10618", lambda c: value(c.get("drop_pad_mode", 0)) != 0),
    Limit("moe_finalize.shapes", "npu_moe_finalize_routing",
          "expanded_permuted_rows [NUM_ROWS*K, H] float16/bfloat16/float32; scales [NUM_ROWS, K] of its dtype; "
          "expanded_src_to_dst_row int32 [NUM_ROWS*K]; skip1 only with skip2",
          f"{DOCS}:10611-10616",
          lambda c: _dtype(c.args.get("expanded_permuted_rows")) not in (*HALF, "float32")
          or c.args["expanded_permuted_rows"].dim() != 2
          or not _tensor(c.get("scales")) or _dtype(c.get("scales")) != _dtype(c.args["expanded_permuted_rows"])
          or c.get("scales").dim() != 2
          or c.get("scales").numel() != c.args["expanded_permuted_rows"].shape[0]
          or _dtype(c.args.get("expanded_src_to_dst_row")) != "int32"
          or c.args["expanded_src_to_dst_row"].dim() != 1
          or c.args["expanded_src_to_dst_row"].shape[0] != c.args["expanded_permuted_rows"].shape[0]
          or (c.get("skip1") is not None and c.get("skip2") is None)),
    # "shape大小需要小于2^24" (:11017) is read per dimension; read as the element count it would cap
    # NUM_ROWS * H (a 2340-token step at H = 7168): hardware checklist item H3 asks
    Limit("moe_init_routing.shapes", "npu_moe_init_routing",
          "x [NUM_ROWS, H] float16/bfloat16/float32, each dimension below 2^24; row_idx and expert_idx int32 "
          "of one shape [NUM_ROWS, K]",
          f"{DOCS}:11017-11019",
          lambda c: _dtype(c.args.get("x")) not in (*HALF, "float32") or c.args["x"].dim() != 2
          or any(d >= 1 << 24 for d in c.args["x"].shape)
          or _dtype(c.args.get("row_idx")) != "int32" or _dtype(c.args.get("expert_idx")) != "int32"
          or tuple(c.args["row_idx"].shape) != tuple(c.args["expert_idx"].shape)
          or c.args["expert_idx"].dim() != 2 or c.args["expert_idx"].shape[0] != c.args["x"].shape[0]),
    Limit("moe_expert_tokens.input", "npu_moe_compute_expert_tokens",
          "sorted_expert_for_source_row int32, 1-D, fewer than 2^24 elements; num_expert in (0, 2048]",
          f"{DOCS}:10545-10546",
          lambda c: _dtype(c.args.get("sorted_expert_for_source_row")) != "int32"
          or c.args["sorted_expert_for_source_row"].dim() != 1
          or c.args["sorted_expert_for_source_row"].numel() >= 1 << 24
          or not 0 < value(c.args["num_expert"]) <= 2048),
)

LIMITS += (
    # ------------------------------------------------------------------ W8A8 (dynamic; graphgen.ir.quant)
    Limit("quant.dynamic.input", "npu_dynamic_quant", "x float16/bfloat16 with more than one dim; dst_type None "
          "(int8) or int8; no smooth_scales/group_index (per-token symmetric int8)", f"{DOCS}:4673-4679",
          lambda c: _dtype(c.args.get("x")) not in HALF or c.args["x"].dim() < 2
          or value(c.get("dst_type", 1)) != 1 or c.get("smooth_scales") is not None),
    Limit("quant.matmul.dtypes", "npu_quant_matmul", "A2/A3 int8 per-token form: x1 and x2 int8, pertoken_scale "
          "float32, a bfloat16 output with a bfloat16 or float32 scale or a float16 output with a float32 one",
          f"{DOCS}:4962-4979,5020-5027",
          lambda c: _dtype(c.args.get("x1")) != "int8" or _dtype(c.args.get("x2")) != "int8"
          or _dtype(c.get("pertoken_scale")) != "float32"
          or not _scale_for_output(_dtype(c.args.get("scale")), _out(c))),
    Limit("quant.matmul.shapes", "npu_quant_matmul", "x1 [.., m, k] and x2 [k, n] of 2-6 dims, x1's and x2's last "
          "dims at most 65535; scale 1-D with 1 or n elements; pertoken_scale 1-D with m elements",
          f"{DOCS}:4962,4966,4972,4978,5001",
          lambda c: not 2 <= c.args["x1"].dim() <= 6 or not 2 <= c.args["x2"].dim() <= 6
          or c.args["x1"].shape[-1] != c.args["x2"].shape[-2]
          or max(c.args["x1"].shape[-1], c.args["x2"].shape[-1]) > 65535
          or c.args["scale"].dim() != 1 or c.args["scale"].shape[0] not in (1, c.args["x2"].shape[-1])
          or (_tensor(c.get("pertoken_scale")) and (c.get("pertoken_scale").dim() != 1
                                                  or c.get("pertoken_scale").shape[0] != c.args["x1"].shape[-2]))),
    # vllm-ascend's W8A8_DYNAMIC MoE passes one [E, K, N] weight with scale [E, N] (w8a8_dynamic.py apply_mlp:
    # w1_scale (num_experts, 2I)); the docs' "1-D per tensor" (:5852) reads as one tensor per weight of a list
    Limit("gmm.per_token", "npu_grouped_matmul", "per-token quantized form: x and weight int8, per_token_scale "
          "float32 [M], scale bfloat16 with a bfloat16 output or float32 with a float16 one, [E, N] for one "
          "[E, K, N] weight", f"{DOCS}:5808-5812,5860-5865,5960-5969",
          _gmm_quant_bad),
    Limit("gmm.inner_limit", "npu_grouped_matmul", "every group's x and weight last dim below 65536 (A2/A3 InnerLimit)",
          f"{DOCS}:5906",
          lambda c: _first(c, "x") is None or _first(c, "weight") is None
          or max(_first(c, "x").shape[-1], _first(c, "weight").shape[-1]) >= 65536),
    Limit("gmm.group_list", "npu_grouped_matmul", "group_list an int64 tensor (group_list_type 0: cumulative, 1: "
          "counts), group_type 0 (groups along m) or -1, split_item 2 or 3 (one output) for one x",
          f"{DOCS}:5866-5890",
          lambda c: not _tensor(c.get("group_list")) or _dtype(c.get("group_list")) != "int64"
          or value(c.get("group_list_type", 0)) not in (0, 1) or value(c.get("group_type", 0)) not in (0, -1)
          or value(c.get("split_item", 0)) not in (2, 3)),
)

BY_OP: dict[str, tuple[Limit, ...]] = {}
for _row in LIMITS:
    BY_OP[_row.op] = BY_OP.get(_row.op, ()) + (_row,)
BY_KEY: dict[str, Limit] = {r.key: r for r in LIMITS}


def violations(call: Call, only=None) -> list[Limit]:
    """Rows of ``call.op`` that the call violates (only the rows keyed in ``only`` when given)."""
    return [row for row in BY_OP.get(call.op, ()) if (only is None or row.key in only) and row.violated(call)]


def check_call(call: Call, only=None) -> None:
    """Raise :class:`KernelLimitError` naming every violated limit and its source."""
    bad = violations(call, only)
    if bad:
        lines = "; ".join(f"[{r.key}] {r.text} ({r.source})" for r in bad)
        raise KernelLimitError(f"torch_npu.{call.op}: call outside the documented kernel limits: {lines}")


def describe(rows: Any = LIMITS) -> str:
    return "\n".join(f"{r.op:34} {r.key:28} {r.text}  [{r.source}]" for r in rows)
