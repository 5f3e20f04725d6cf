"""Malformed specs: every error names file:line:col, what is wrong and the fix; all at once.

Each case edits a valid base spec. The line an error must point at is marked in the case text
with a ``# <tag>`` comment, so the expected line is found in the text itself (not hard-coded)
and must equal the line the loader reports exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphgen.modelspec.loader import load_spec, load_specs, parse_spec_text
from graphgen.modelspec.errors import SpecError
from support.cli import cli_inproc


BASE_QWEN = """\
# a valid tiny Qwen3 spec (the cases edit it)
name: m_qwen
family: qwen3_dense
description: test spec
dims:
  num_hidden_layers: 2
  hidden_size: 64
  intermediate_size: 128
  vocab_size: 256
  num_attention_heads: 4
  num_key_value_heads: 2
  head_dim: 16
  rope_theta: 1000000.0
  rms_norm_eps: 1.0e-6
  tie_word_embeddings: false
kv_cache:
  block_size: 4
  dtype: float32
pool:
  write: async
  granularity: forward
features: [prefix_cache]
variants:
  decode:
    phase: decode
  mempool_prefill:
    phase: prefill
    history: false
  splitfuse:
    phase: prefill
    history: true
targets:
  cpu: {}
  npu:
    compile_modes: [max-autotune, reduce-overhead]
"""

BASE_DS = """\
name: m_ds
family: deepseek_v3
dims:
  num_hidden_layers: 3
  first_k_dense_replace: 1
  hidden_size: 64
  intermediate_size: 128
  moe_intermediate_size: 32
  vocab_size: 256
  num_attention_heads: 4
  q_lora_rank: 32
  kv_lora_rank: 16
  qk_nope_head_dim: 16
  qk_rope_head_dim: 8
  v_head_dim: 16
  n_routed_experts: 8
  num_experts_per_tok: 2
  n_shared_experts: 1
  n_group: 2
  topk_group: 1
  routed_scaling_factor: 2.5
  rope_scaling: null
kv_cache:
  block_size: 4
  dtype: float32
pool:
  write: async
features: [prefix_cache]
variants:
  decode:
    phase: decode
  mempool_prefill:
    phase: prefill
  splitfuse:
    phase: prefill
    history: true
targets:
  cpu: {}
"""


def edit(base: str, *pairs: tuple[str, str]) -> str:
    for old, new in pairs:
        assert base.count(old) == 1, f"edit target not unique: {old!r}"
        base = base.replace(old, new)
    return base


# (id, spec text, [(tag, message part, fix part), ...]) -- one entry per expected diagnostic, and
# no other diagnostic may appear.
CASES = [
    # quantization (issue 28): the method's names, the checkpoint's block as two sizes
    ("quant_method_typo", edit(BASE_QWEN, ("features: [prefix_cache]\n",
                                           "features: [prefix_cache]\nquantization:\n  method: w8a8  # a\n")),
     [("a", "quantization.method: the string 'w8a8' is not one of none, w8a8_dynamic", "use one of: none, w8a8_dynamic")]),
    ("quant_block_one_size", edit(BASE_QWEN, ("features: [prefix_cache]\n",
                                              "features: [prefix_cache]\nquantization:\n  checkpoint:\n"
                                              "    weight_block_size: [128]  # a\n")),
     [("a", "weight_block_size has 1 item(s); a block is [rows, cols]", "weight_block_size: [128, 128]")]),
    # the key's old name: one error with the rename as the fix, and its settings still checked
    ("old_mempool_key", edit(BASE_QWEN, ("pool:\n  write: async\n  granularity: forward\n",
                                         "mempool:  # a\n  write: async\n  granularity: forward\n")),
     [("a", "'mempool' was renamed to 'pool'", "rename 'mempool:' to 'pool:' (same settings)")]),
    ("old_mempool_key_bad_value", edit(BASE_QWEN, ("pool:\n  write: async\n",
                                                   "mempool:  # a\n  write: asink  # b\n")),
     [("a", "'mempool' was renamed to 'pool'", "rename 'mempool:' to 'pool:'"),
      ("b", "pool.write: the string 'asink' is not one of off, sync, async", "did you mean 'async'?")]),
    ("old_and_new_pool_key", edit(BASE_QWEN, ("features: [prefix_cache]\n",
                                              "features: [prefix_cache]\nmempool: {}  # a\n")),
     [("a", "'mempool' was renamed to 'pool'", "remove 'mempool:' and keep 'pool:'")]),
    ("typo_top_key", edit(BASE_QWEN, ("variants:\n", "variant:  # a\n")),
     [("a", "unknown key 'variant' in the spec", "did you mean 'variants'?")]),
    ("typo_dims_key", edit(BASE_QWEN, ("  hidden_size: 64\n", "  hiden_size: 64  # a\n")),
     [("a", "unknown key 'hiden_size' in 'dims'", "did you mean 'hidden_size'?")]),
    ("unknown_key_no_match", edit(BASE_QWEN, ("  block_size: 4\n", "  block_size: 4\n  zzz: 1  # a\n")),
     [("a", "unknown key 'zzz' in 'kv_cache'", "allowed keys: block_size, dtype")]),
    ("missing_dims_key", edit(BASE_QWEN, ("dims:\n", "dims:  # a\n"), ("  vocab_size: 256\n", "")),
     [("a", "missing required key 'dims.vocab_size'", "add 'vocab_size: <integer>' under 'dims'")]),
    ("missing_variant_phase", edit(BASE_QWEN, ("  mempool_prefill:\n    phase: prefill\n",
                                               "  mempool_prefill:  # a\n")),
     [("a", "missing required key 'variants.mempool_prefill.phase'", "add 'phase: prefill|decode|mtp'")]),
    ("missing_family", edit(BASE_QWEN, ("name: m_qwen\n", "name: m_qwen  # a\n"), ("family: qwen3_dense\n", "")),
     [("a", "missing required key 'family'", "add 'family: qwen3_dense|deepseek_v3' at the top level")]),
    ("int_as_string", edit(BASE_QWEN, ("  hidden_size: 64\n", '  hidden_size: "64"  # a\n')),
     [("a", "dims.hidden_size: expected an integer, got the string '64'", "write an integer without quotes")]),
    ("int_as_float", edit(BASE_QWEN, ("  num_hidden_layers: 2\n", "  num_hidden_layers: 2.0  # a\n")),
     [("a", "dims.num_hidden_layers: expected an integer, got 2.0", "write 2 (no decimal point)")]),
    ("yaml11_bool", edit(BASE_QWEN, ("  tie_word_embeddings: false\n", "  tie_word_embeddings: no  # a\n")),
     [("a", "expected a boolean (true/false), got the string 'no'", "write true or false")]),
    ("number_as_string", edit(BASE_QWEN, ("  rope_theta: 1000000.0\n", "  rope_theta: 'big'  # a\n")),
     [("a", "dims.rope_theta: expected a number, got the string 'big'", "write a plain number")]),
    ("enum_typo", edit(BASE_QWEN, ("    phase: decode\n", "    phase: decod  # a\n")),
     [("a", "variants.decode.phase: the string 'decod' is not one of prefill, decode", "did you mean 'decode'?")]),
    ("bad_dtype", edit(BASE_QWEN, ("  dtype: float32\n", "  dtype: fp32  # a\n")),
     [("a", "kv_cache.dtype: the string 'fp32' is not one of float32, bfloat16, float16", "use one of")]),
    ("duplicate_key", edit(BASE_QWEN, ("  hidden_size: 64\n", "  hidden_size: 64  # first\n  hidden_size: 32  # a\n")),
     [("a", "duplicate key 'hidden_size' (first defined on line {first})", "remove one of the two entries")]),
    ("name_injection", edit(BASE_QWEN, ("name: m_qwen\n", 'name: "x; import os"  # a\n')),
     [("a", "name 'x; import os' is not a Python identifier", "use ASCII letters, digits and underscores")]),
    ("variant_name_dash", edit(BASE_QWEN, ("  splitfuse:\n", '  "split-fuse":  # a\n')),
     [("a", "variant name 'split-fuse' is not a Python identifier", "e.g. my_model")]),
    ("variant_name_keyword", edit(BASE_QWEN, ("  splitfuse:\n", "  class:  # a\n")),
     [("a", "variant name 'class' is not a Python identifier", "not a Python keyword")]),
    ("stream_tag_injection", edit(BASE_QWEN, ("    compile_modes: [max-autotune, reduce-overhead]\n",
                                              "    compile_modes: [max-autotune]\n"
                                              "    save_stream_tag: \"s')\\nimport os#\"  # a\n")),
     [("a", "targets.npu.save_stream_tag \"s')\\nimport os#\" is not a Python identifier", "use ASCII letters")]),
    ("dunder_name", edit(BASE_QWEN, ("name: m_qwen\n", "name: __init__  # a\n")),
     [("a", "name '__init__' is not a Python identifier", "not starting with a digit or '__'")]),
    ("family_dims_mismatch", edit(BASE_DS, ("family: deepseek_v3\n", "family: qwen3_dense\n"),
                                  ("dims:\n", "dims:  # a\n")),
     [("a", "dims do not match family qwen3_dense", "set family: deepseek_v3")]),
    ("foreign_dim_key", edit(BASE_QWEN, ("  head_dim: 16\n", "  head_dim: 16\n  kv_lora_rank: 16  # a\n")),
     [("a", "it is a deepseek_v3 dim, not a qwen3_dense one", "remove it, or set family: deepseek_v3")]),
    ("unknown_family", edit(BASE_QWEN, ("family: qwen3_dense\n", "family: qwen3  # a\n")),
     [("a", "family: the string 'qwen3' is not one of qwen3_dense, deepseek_v3", "did you mean 'qwen3_dense'?")]),
    ("feature_typo_and_write", edit(BASE_QWEN, ("features: [prefix_cache]\n", "features: [prefix_cach]  # a\n"),
                                    ("  write: async\n", "  write: async  # b\n"),
                                    ("    history: true\n", "    history: true  # c\n")),
     [("a", "unknown feature 'prefix_cach'", "did you mean 'prefix_cache'?"),
      ("b", "pool.write: async needs the 'prefix_cache' feature", "add prefix_cache to features"),
      ("c", "variant splitfuse: history KV comes from the pool", "add prefix_cache to features")]),
    ("not_implemented_feature", edit(BASE_QWEN, ("features: [prefix_cache]\n",
                                                 "features: [prefix_cache, yarn]  # a\n")),
     [("a", "feature 'yarn' is not implemented yet", "remove 'yarn' from features")]),
    # the parallel layout (graphgen/families/parallel.py, compat._parallel_rules)
    ("derived_feature_listed", edit(BASE_QWEN, ("features: [prefix_cache]\n",
                                                "features: [prefix_cache, context_parallel]  # a\n")),
     [("a", "feature 'context_parallel' is set by parallel.cp, not listed in features",
       "write parallel: {cp: 2}")]),
    ("sp_needs_tp", BASE_QWEN + "parallel:\n  sp: true  # a\n",
     [("a", "sp: true needs tp > 1", "set tp: 2 or more, or sp: false")]),
    ("ep_under_dp", BASE_DS + "parallel:\n  tp: 2\n  dp: 2\n  ep: 2  # a\n",
     [("a", "ep (2) must equal dp × tp (2 × 2 = 4) under DP attention", "set ep: 4")]),
    ("ep_without_dp", BASE_DS + "parallel:\n  tp: 2\n  ep: 4  # a\n",
     [("a", "ep (4) must be 1 or equal tp (2)", "set ep: 2 or ep: 1")]),
    ("ep_divides_shared_width", edit(BASE_DS, ("  moe_intermediate_size: 32\n", "  moe_intermediate_size: 18\n"))
     + "parallel:\n  dp: 4\n  ep: 4  # a\n",
     [("a", "ep (4) must divide the shared experts' width (18)", "divides 18")]),
    ("dp_ep_on_dense", BASE_QWEN + "parallel:\n  dp: 2\n  ep: 2  # a\n",
     [("a", "ep (2) needs routed experts; this family has none", "set ep: 1")]),
    ("dp_heads_per_group", BASE_DS + "parallel:\n  tp: 8  # a\n  dp: 2\n  ep: 16  # b\n",
     [("a", "tp (8) must divide num_attention_heads (4", "use a tp that divides 4"),
      ("b", "ep (16) must divide n_routed_experts (8)", "use an ep that divides 8")]),
    ("async_excludes", edit(BASE_QWEN, ("features: [prefix_cache]\n", "features: [prefix_cache, micro_batch]  # a\n")),
     [("a", "pool.write: async does not combine with 'micro_batch'", "set pool.write: sync")]),
    ("family_only_feature", edit(BASE_QWEN, ("features: [prefix_cache]\n", "features: [prefix_cache, mtp]  # a\n")),
     [("a", "feature 'mtp' does not apply to family qwen3_dense", "remove 'mtp' from features")]),
    ("duplicate_feature", edit(BASE_QWEN, ("features: [prefix_cache]\n",
                                           "features:\n  - prefix_cache\n  - prefix_cache  # a\n")),
     [("a", "feature 'prefix_cache' is listed twice", "remove the duplicate")]),
    ("sync_without_prefix_cache", edit(BASE_QWEN, ("  write: async\n", "  write: sync  # a\n"),
                                       ("features: [prefix_cache]\n", "features: []\n"),
                                       ("    history: true\n", "    history: true  # b\n")),
     [("a", "pool.write: sync needs the 'prefix_cache' feature", "or set pool.write: off"),
      ("b", "variant splitfuse: history KV comes from the pool", "add prefix_cache to features")]),
    ("off_is_a_string", edit(BASE_QWEN, ("  write: async\n", "  write: off\n"),
                             ("  mempool_prefill:\n    phase: prefill\n",
                              "  mempool_prefill:\n    phase: prefill\n    save: true  # a\n")),
     [("a", "variant mempool_prefill: save: true but pool.write is off", "set pool.write: sync or async")]),
    ("decode_history", edit(BASE_QWEN, ("    phase: decode\n", "    phase: decode\n    history: true  # a\n")),
     [("a", "variant decode: 'history' applies to prefill only", "remove history from the decode variant")]),
    ("decode_save", edit(BASE_QWEN, ("    phase: decode\n", "    phase: decode\n    save: true  # a\n")),
     [("a", "variant decode: decode graphs never save KV", "remove save from the decode variant")]),
    ("granularity_no_effect", edit(BASE_QWEN, ("    phase: decode\n", "    phase: decode\n    granularity: layer  # a\n")),
     [("a", "variant decode: granularity has no effect (decode graphs never save)", "remove granularity")]),
    ("kv_heads_divide", edit(BASE_QWEN, ("  num_key_value_heads: 2\n", "  num_key_value_heads: 3  # a\n")),
     [("a", "num_key_value_heads (3) must divide num_attention_heads (4)", "pick a divisor of num_attention_heads")]),
    ("odd_head_dim", edit(BASE_QWEN, ("  head_dim: 16\n", "  head_dim: 15  # a\n")),
     [("a", "head_dim (15) must be even for RoPE", "use an even head_dim")]),
    ("bad_pool_policy", edit(BASE_QWEN, ("  granularity: forward\nfeatures", "  granularity: forward\n"
                                         "  policy: write_bak  # a\n  min_uses: 0  # b\nfeatures")),
     [("a", "pool.policy: the string 'write_bak' is not one of write_through, write_through_selective, "
            "write_back", "did you mean 'write_back'?"),
      ("b", "pool.min_uses: must be >= 1, got 0", "use a value of at least 1")]),
    ("pool_options_without_effect", edit(BASE_QWEN, ("  write: async\n  granularity: forward\nfeatures: [prefix_cache]\n",
                                                     "  write: off\n  granularity: forward\n"
                                                     "  save_decode: true  # a\n  device_cache: true  # b\n"
                                                     "features: []\n"),
                                         ("    history: true\n", "")),
     [("a", "save_decode has no effect: pool.write is off", "set pool.write: sync or async"),
      ("b", "the device prefix cache is looked up like the pool", "add prefix_cache to features")]),
    ("below_minimum", edit(BASE_QWEN, ("  num_hidden_layers: 2\n", "  num_hidden_layers: 0  # a\n")),
     [("a", "dims.num_hidden_layers: must be >= 1, got 0", "use a value of at least 1")]),
    ("negative_eps", edit(BASE_QWEN, ("  rms_norm_eps: 1.0e-6\n", "  rms_norm_eps: -1e-6  # a\n")),
     [("a", "dims.rms_norm_eps: must be > 0, got -1e-06", "use a value greater than 0")]),
    ("nan", edit(BASE_QWEN, ("  rope_theta: 1000000.0\n", "  rope_theta: .nan  # a\n")),
     [("a", "dims.rope_theta: must be a finite number, got nan", "write a plain number")]),
    ("no_target", edit(BASE_QWEN, ("targets:\n  cpu: {}\n  npu:\n    compile_modes: [max-autotune, reduce-overhead]\n",
                                   "targets: {}  # a\n")),
     [("a", "no target enabled", "add 'cpu: {}' and/or 'npu: {}' under targets")]),
    ("null_target", edit(BASE_QWEN, ("  cpu: {}\n", "  cpu:  # a\n")),
     [("a", "targets.cpu: an empty value does not enable this", "write 'cpu: {}' to enable it")]),
    ("compile_mode_twice", edit(BASE_QWEN, ("    compile_modes: [max-autotune, reduce-overhead]\n",
                                            "    compile_modes:\n    - max-autotune\n    - max-autotune  # a\n")),
     [("a", "compile mode 'max-autotune' is listed twice", "remove the duplicate")]),
    ("compile_modes_empty", edit(BASE_QWEN, ("    compile_modes: [max-autotune, reduce-overhead]\n",
                                             "    compile_modes: []  # a\n")),
     [("a", "compile_modes is empty", "list max-autotune and/or reduce-overhead")]),
    ("python_tag", edit(BASE_QWEN, ("description: test spec\n", "description: !!python/object:os.system x  # a\n")),
     [("a", "unsupported YAML tag tag:yaml.org,2002:python/object:os.system", "write a plain value")]),
    ("merge_key", edit(BASE_QWEN, ("  mempool_prefill:\n    phase: prefill\n",
                                   "  mempool_prefill:\n    <<: {phase: prefill}  # a\n    phase: prefill\n")),
     [("a", "YAML merge keys ('<<') are not supported", "write the keys out in full")]),
    ("yaml_syntax", edit(BASE_QWEN, ("description: test spec\n", "description: a: b  # a\n")),
     [("a", "invalid YAML: mapping values are not allowed here", "fix the YAML syntax")]),
    ("features_not_list", edit(BASE_QWEN, ("features: [prefix_cache]\n", "features: prefix_cache  # a\n")),
     [("a", "features: expected a list, got the string 'prefix_cache'", "write features: [item, ...]")]),
    ("variants_empty", edit(BASE_QWEN, ("variants:\n  decode:\n    phase: decode\n  mempool_prefill:\n"
                                        "    phase: prefill\n    history: false\n  splitfuse:\n"
                                        "    phase: prefill\n    history: true\n", "variants: {}  # a\n")),
     [("a", "variants: expected a non-empty mapping", "e.g. variants: {decode: {phase: decode}}")]),
    ("dims_not_mapping", edit(BASE_DS, ("dims:\n", "dims: 5  # a\nold_dims:  # b\n")),
     [("a", "dims: expected a mapping (key: value lines), got 5", "write key: value pairs"),
      ("b", "unknown key 'old_dims' in the spec", "did you mean 'dims'?")]),
    ("description_not_string", edit(BASE_QWEN, ("description: test spec\n", "description: 5  # a\n")),
     [("a", "description: expected a string, got 5", "quote the value")]),
    ("ds_n_group", edit(BASE_DS, ("  n_group: 2\n", "  n_group: 3  # a\n")),
     [("a", "n_group (3) must divide n_routed_experts (8)", "pick a divisor of n_routed_experts")]),
    ("ds_group_too_small", edit(BASE_DS, ("  n_group: 2\n", "  n_group: 8  # a\n"), ("  topk_group: 1\n", "  topk_group: 2\n")),
     [("a", "n_group (8) leaves fewer than 2 experts per group", "use n_group <= n_routed_experts / 2")]),
    ("ds_topk_group", edit(BASE_DS, ("  topk_group: 1\n", "  topk_group: 3  # a\n")),
     [("a", "topk_group (3) exceeds n_group (2)", "use topk_group <= n_group")]),
    ("ds_topk_fits_groups", edit(BASE_DS, ("  num_experts_per_tok: 2\n", "  num_experts_per_tok: 6  # a\n")),
     [("a", "num_experts_per_tok (6) exceeds the 4 experts in the topk_group (1) groups kept",
       "raise topk_group or lower num_experts_per_tok")]),
    ("ds_dense_layers", edit(BASE_DS, ("  first_k_dense_replace: 1\n", "  first_k_dense_replace: 4  # a\n")),
     [("a", "first_k_dense_replace (4) exceeds num_hidden_layers (3)", "use at most num_hidden_layers")]),
    ("ds_odd_rope", edit(BASE_DS, ("  qk_rope_head_dim: 8\n", "  qk_rope_head_dim: 7  # a\n")),
     [("a", "qk_rope_head_dim (7) must be even for RoPE", "use an even value")]),
    ("ds_rope_scaling_type", edit(BASE_DS, ("  rope_scaling: null\n",
                                            "  rope_scaling:\n    type: linear  # a\n    factor: 4.0\n"
                                            "    original_max_position_embeddings: 4096\n")),
     [("a", "dims.rope_scaling.type: the string 'linear' is not one of yarn", "use one of: yarn")]),
    ("ds_rope_scaling_missing", edit(BASE_DS, ("  rope_scaling: null\n",
                                               "  rope_scaling:  # a\n    type: yarn\n    factor: 40.0\n")),
     [("a", "missing required key 'dims.rope_scaling.original_max_position_embeddings'",
       "add 'original_max_position_embeddings: <integer>' under 'dims.rope_scaling'")]),
    ("ds_yarn_feature", edit(BASE_DS, ("features: [prefix_cache]\n", "features: [prefix_cache, yarn]  # a\n")),
     [("a", "feature 'yarn' does not apply to family deepseek_v3", "remove 'yarn' from features")]),
]


def _line_of(text: str, tag: str) -> int:
    lines = [i + 1 for i, line in enumerate(text.splitlines()) if re.search(rf"#\s*{re.escape(tag)}\s*$", line)]
    assert len(lines) == 1, f"tag {tag!r} must mark exactly one line"
    return lines[0]


def test_enough_distinct_cases():
    assert len({c[0] for c in CASES}) == len(CASES) >= 25


def test_base_specs_are_valid():
    # The cases only mean something if the unedited bases load cleanly.
    parse_spec_text(BASE_QWEN, "base_qwen.yaml")
    parse_spec_text(BASE_DS, "base_ds.yaml")


@pytest.mark.parametrize("case_id,text,expected", CASES, ids=[c[0] for c in CASES])
def test_malformed_spec(tmp_path, capsys, case_id, text, expected):
    path = tmp_path / f"{case_id}.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    # `graphgen generate` refuses with exit 2, prints the same errors, and writes (or removes) nothing.
    from graphgen.cli import main

    out = tmp_path / "out"
    (out / "keep").mkdir(parents=True)
    (out / "keep" / "old.graph").write_text("previous output\n")
    capsys.readouterr()
    assert main(["generate", "--spec", str(path), "--out", str(out)]) == 2
    stderr = capsys.readouterr().err
    assert str(info.value) in stderr and "nothing was written" in stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["keep", "keep/old.graph"]
    assert (out / "keep" / "old.graph").read_text() == "previous output\n"
    diags = info.value.diagnostics
    rendered = str(info.value)
    assert len(diags) == len(expected), rendered
    for tag, message, fix in expected:
        line = _line_of(text, tag)
        if "{first}" in message:
            message = message.format(first=_line_of(text, "first"))
        hits = [d for d in diags if d.line == line and message in d.message]
        assert hits, f"no error at line {line} containing {message!r}:\n{rendered}"
        d = hits[0]
        assert fix in d.fix, f"fix {d.fix!r} lacks {fix!r}"
        # The rendered form a user sees: file:line:col, the problem, then the fix.
        assert f"{path}:{line}:{d.col}: error: {d.message}\n    fix: {d.fix}" in rendered


def test_all_errors_of_a_file_at_once(tmp_path):
    text = edit(BASE_QWEN,
                ("name: m_qwen\n", 'name: "bad name"  # a\n'),
                ("  hidden_size: 64\n", "  hiden_size: 64  # b\n"),
                ("  num_key_value_heads: 2\n", "  num_key_value_heads: 2\n  max_position_embeddings: 0  # c\n"),
                ("  dtype: float32\n", "  dtype: fp32  # d\n"),
                ("features: [prefix_cache]\n", "features: [prefix_cache, multi_lora]  # e\n"),
                ("    phase: decode\n", "    phase: decode\n    history: true  # f\n"),
                ("  cpu: {}\n", "  cpu:  # g\n"))
    path = tmp_path / "many.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    got = sorted((d.line, d.message) for d in info.value.diagnostics)
    want_lines = sorted(_line_of(text, t) for t in "abcdefg")
    assert [line for line, _ in got] == want_lines, str(info.value)
    # Sorted by position, so the report reads top to bottom.
    assert [d.line for d in info.value.diagnostics] == want_lines


def test_errors_of_several_files_together(tmp_path):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    a.write_text(edit(BASE_QWEN, ("  head_dim: 16\n", "  head_dim: 15\n")))
    b.write_text(edit(BASE_DS, ("  n_group: 2\n", "  n_group: 3\n")))
    with pytest.raises(SpecError) as info:
        load_specs([a, b])
    assert {d.file for d in info.value.diagnostics} == {str(a), str(b)}


def test_duplicate_model_names_point_at_name(tmp_path):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    a.write_text(BASE_QWEN)
    b.write_text(BASE_QWEN)
    with pytest.raises(SpecError) as info:
        load_specs([a, b])
    (d,) = info.value.diagnostics
    assert (d.file, d.line) == (str(b), _line_of(edit(BASE_QWEN, ("name: m_qwen\n", "name: m_qwen  # n\n")), "n"))
    assert "also used by" in d.message and str(a) in d.message


def test_empty_and_unreadable_files(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# only a comment\n")
    with pytest.raises(SpecError, match=r"empty\.yaml:1:1: error: the spec file is empty"):
        load_spec(empty)
    with pytest.raises(SpecError, match=r"missing\.yaml:1:1: error: cannot read spec"):
        load_spec(tmp_path / "missing.yaml")
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match=r"list\.yaml:1:1: error: the spec: expected a mapping"):
        load_spec(listed)


# ---------------------------------------------------------------- nothing is written on error

def _generate_or_load(spec_paths, out_dir: Path) -> None:
    from graphgen.generate import generate

    generate(spec_paths, out_dir)


def _assert_nothing_written(tmp_path: Path, spec_path: Path) -> None:
    out = tmp_path / "out"
    proc = cli_inproc("generate", "--spec", spec_path, "--out", out)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert re.search(rf"{re.escape(str(spec_path))}:\d+:", proc.stderr), proc.stderr
    assert not out.exists() or not any(out.iterdir())


def _bad_spec(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(edit(BASE_QWEN, ("  head_dim: 16\n", "  head_dim: 15\n"), ("  dtype: float32\n", "  dtype: x\n")))
    return path


def test_front_end_refuses_bad_spec_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SpecError) as info:
        _generate_or_load([_bad_spec(tmp_path)], out)
    assert len(info.value.diagnostics) == 2
    assert not out.exists() or not any(out.iterdir())


def test_cli_generate_writes_nothing_on_bad_spec(tmp_path):
    _assert_nothing_written(tmp_path, _bad_spec(tmp_path))
