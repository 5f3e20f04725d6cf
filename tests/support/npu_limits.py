"""The NPU kernel-limit cases: each edits ONE field of a shipped full-size spec past one documented
limit row (`graphgen.npu.check.limits.BY_KEY`). One table for the library check
(tests/npu/test_spec_limits.py) and the CLI (tests/npu/test_validate_limits.py), so they cannot drift."""
from __future__ import annotations

from .paths import SPECS

QWEN = (SPECS / "qwen3_32b.yaml").read_text()
DSV3 = (SPECS / "deepseek_v3_1.yaml").read_text()

LIMIT_CASES = [  # (base, key, new value, field path, limit row)
    ("qwen", "dtype", "float32", "kv_cache.dtype", "fia.dtype"),
    ("dsv3", "dtype", "float32", "kv_cache.dtype", "fia.dtype"),
    ("qwen", "block_size", "64", "kv_cache.block_size", "fia.pa.block_size"),
    ("qwen", "block_size", "192", "kv_cache.block_size", "fia.pa.block_size"),
    ("dsv3", "block_size", "64", "kv_cache.block_size", "fia.mla.block_size"),
    ("qwen", "head_dim", "96", "dims.head_dim", "rope.head_dim"),
    ("qwen", "head_dim", "256", "dims.head_dim", "rope.head_dim"),
    ("dsv3", "qk_rope_head_dim", "32", "dims.qk_rope_head_dim", "interleave_rope.dim"),
    ("dsv3", "qk_rope_head_dim", "32", "dims.qk_rope_head_dim", "fia.mla.rope_dim"),
    ("dsv3", "qk_rope_head_dim", "128", "dims.qk_rope_head_dim", "fia.mla.rope_dim"),
    ("dsv3", "kv_lora_rank", "256", "dims.kv_lora_rank", "fia.mla.latent_dim"),
    ("dsv3", "num_attention_heads", "8192", "dims.num_attention_heads", "fia2.mla.heads"),
    # 512 query heads over 4 KV heads per rank at tp=2: more than 64 per KV head (v2 decode, GQA)
    ("qwen", "num_attention_heads", "1024", "dims.num_attention_heads", "fia2.gqa.ratio"),
    ("qwen", "compile_modes", "[max-autotune, reduce-overhead]", "targets.npu.compile_modes",
     "fia.tnd.reduce_overhead"),
    ("dsv3", "num_experts_per_tok", "40", "dims.num_experts_per_tok", "moe_gating.k_max"),
    # 4096 experts on one rank: more groups than npu_moe_compute_expert_tokens counts (2048)
    ("dsv3", "n_routed_experts", "4096", "dims.n_routed_experts", "moe_expert_tokens.input"),
    # 256 heads per rank at tp=32: more than the 128 the prefill helper can pad up to (v1 TND N set)
    ("dsv3", "num_attention_heads", "8192", "dims.num_attention_heads", "fia.dense.head_count"),
]
# Rows whose spec field is an NpuTarget bucket list the shipped specs leave at its default: the case
# inserts the field under targets.npu (base, inserted line, field path, limit row).
INSERT_CASES = [
    ("dsv3", "    prefill_token_buckets: [128, 70000]", "targets.npu.prefill_token_buckets", "fia.dense.tokens"),
    ("qwen", "    prefill_seqs: 4096\n    prefill_token_buckets: [8192]", "targets.npu.prefill_seqs",
     "fia.tnd.sequences"),
    ("qwen", "    decode_batch_buckets: [1, 70000]", "targets.npu.decode_batch_buckets", "fia2.decode.dims"),
    ("dsv3", "    decode_batch_buckets: [1, 70000]", "targets.npu.decode_batch_buckets", "fia2.decode.dims"),
    # an 8192-token context: a mixed cell of 8 decode rows gathers 10 * 8192 + 1024 KV rows into TND (audit 3 N9)
    ("dsv3", "    max_model_len: 8192", "targets.npu.max_model_len", "fia.dense.tokens"),
]


def insert_npu_field(text: str, line: str) -> str:
    head = "    compile_modes: [max-autotune]\n"
    assert text.count(head) == 1
    return text.replace(head, head + line + "\n")


def base_text(base: str) -> str:
    return QWEN if base == "qwen" else DSV3
