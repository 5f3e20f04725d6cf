"""The spec's mtp: section (DeepSeek-V3's multi-token-prediction layers): parsed, validated with
file:line errors, in the schema; refused for Qwen3 and under features:; written by import-hf."""

from __future__ import annotations

import json

import pytest

from graphgen.modelspec import model as m
from graphgen.modelspec.compat import ACCEPTED_FEATURES
from graphgen.modelspec.errors import SpecError
from graphgen.modelspec.loader import load_spec, parse_spec_text
from graphgen.modelspec.schema import schema_text
from support.paths import REPO

MTP_SPEC = REPO / "specs" / "tiny_deepseek_v3_mtp.yaml"


def _errors(text):
    with pytest.raises(SpecError) as info:
        parse_spec_text(text, "s.yaml")
    return [(d.line, d.message, d.fix) for d in info.value.diagnostics]


def _line_of(text, needle):
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_mtp_section_parses_and_counts_kv_layers():
    spec = load_spec(MTP_SPEC)
    assert spec.mtp == m.Mtp(num_layers=1) and spec.mtp_layers == 1
    assert spec.kv_layers == spec.dims.num_hidden_layers + 1
    plain = load_spec(REPO / "specs" / "tiny_deepseek_v3.yaml")
    assert plain.mtp is None and plain.kv_layers == plain.dims.num_hidden_layers


@pytest.mark.parametrize("edit, needle, message", [
    ("mtp:\n  num_layers: 0\n", "num_layers: 0", "mtp.num_layers: must be >= 1, got 0"),
    ("mtp:\n  num_layer: 1\n", "num_layer: 1", "unknown key 'num_layer' in 'mtp'"),
    ("mtp:\n", "mtp:", "mtp: an empty value does not enable this"),
    ("mtp:\n  num_layers: one\n", "num_layers: one", "mtp.num_layers: expected an integer"),
])
def test_bad_mtp_section_is_a_positioned_error(edit, needle, message):
    text = MTP_SPEC.read_text().replace("mtp:\n  num_layers: 1\n", edit)
    errors = _errors(text)
    assert any(line == _line_of(text, needle) and message in msg for line, msg, _ in errors), errors


def test_qwen3_with_mtp_is_refused_at_its_line():
    text = (REPO / "specs" / "tiny_qwen3.yaml").read_text() + "mtp:\n  num_layers: 1\n"
    errors = _errors(text)
    assert errors == [(_line_of(text, "mtp:"), "mtp: multi-token prediction layers exist for family "
                       "deepseek_v3 only, not qwen3_dense", "remove the mtp: section")]


def test_mtp_under_features_points_to_the_section():
    text = (REPO / "specs" / "tiny_deepseek_v3.yaml").read_text().replace(
        "features: [prefix_cache]", "features: [prefix_cache, mtp]")
    (line, msg, fix), = _errors(text)
    assert line == _line_of(text, "features:") and "'mtp' is not a feature" in msg
    assert "mtp: {num_layers: 1}" in fix
    assert "mtp" not in ACCEPTED_FEATURES


def test_schema_describes_the_section():
    schema = json.loads(schema_text())
    assert schema["$defs"]["Mtp"]["properties"]["num_layers"]["minimum"] == 1
    assert schema["properties"]["mtp"]["allOf"] == [{"$ref": "#/$defs/Mtp"}]


def test_mtp_variant_needs_the_section_and_takes_no_save_settings():
    text = (REPO / "specs" / "tiny_deepseek_v3.yaml").read_text().replace(
        "  decode:\n    phase: decode\n", "  decode:\n    phase: decode\n  draft:\n    phase: mtp\n")
    (line, msg, fix), = _errors(text)
    assert line == _line_of(text, "phase: mtp") and "phase mtp needs the model's MTP layers" in msg
    text = MTP_SPEC.read_text().replace("    phase: mtp\n", "    phase: mtp\n    history: true\n")
    assert any("an mtp variant takes no history" in msg for _, msg, _ in _errors(text))


def test_mtp_with_the_npu_target_loads():
    """The NPU target lowers the MTP graphs (docs/npu.md, "MTP graphs"): the section and the target go together."""
    text = MTP_SPEC.read_text().replace("  cpu: {}\n", "  cpu: {}\n  npu: {}\n")
    assert "  npu: {}\n" in text
    spec = parse_spec_text(text, "s.yaml")
    assert spec.targets.npu is not None and spec.mtp.num_layers == 1


def test_mtp_with_ranks_shards_the_mtp_layer_like_a_decoder_layer_and_the_launch_runs():
    """Issue 38 item 2: tp/ep with MTP is a layout the spec rules accept (the build path shards the MTP layer:
    each of its decoder-layer weights split as the last MoE decoder layer's is, the pipeline's verify passes
    included); since item 1 the rank runners run it (tests/parallel/test_mtp_ranks.py), so the one refusal
    table has no row for it on the CPU target, speculative or not."""
    from graphgen.families.parallel import runtime_layout_gap
    from graphgen.ir.weights import graph_weight_names
    from graphgen.passes.manager import run_pipeline

    spec = parse_spec_text(MTP_SPEC.read_text() + "parallel:\n  tp: 2\n  ep: 2\n", "s.yaml")
    n = spec.dims.num_hidden_layers
    mtp = sorted(graph_weight_names([run_pipeline(spec, "mtp_draft")]))
    target = set(graph_weight_names([run_pipeline(spec, "decode")]))
    mine = [w for w in mtp if w.startswith(f"model.layers.{n}.")]
    as_decoder = [w.replace(f"model.layers.{n}.", f"model.layers.{n - 1}.") for w in mine]
    shared = [w for w in as_decoder if w.split("[")[0] in {t.split("[")[0] for t in target}]
    assert len(shared) >= 10 and set(shared) <= target, sorted(set(shared) - target)  # the same split
    assert any("[d0/2]" in w for w in shared) and any("[d1/2]" in w for w in shared)  # and it is split
    assert not _sharded(run_pipeline(parse_spec_text(MTP_SPEC.read_text(), "s.yaml"), "mtp_draft"))
    for speculative in (False, True):
        assert runtime_layout_gap(spec.parallel, "cpu", mtp=True, speculative=speculative) is None
    assert runtime_layout_gap(spec.parallel, "cpu") is None
    assert runtime_layout_gap(load_spec(MTP_SPEC).parallel, "cpu", mtp=True) is None


def _sharded(graph):
    from graphgen.ir.weights import graph_weight_names

    return [w for w in graph_weight_names([graph]) if "[" in w]


def test_every_layout_the_spec_rules_take_with_mtp_builds():
    """The spec rules and the passes agree for a spec with MTP (issue 38 item 2 lifted tp/ep): each layout of
    tp, ep, dp, cp and sp the rules accept builds every variant through the verified pipeline (dp with MTP
    included since issue 38 item 1: the DP ranks run it; cp too, whose pass gathers the MTP graph's KV over cp),
    and the rules refuse sp with MTP (what the passes do not do: sp's pass fails on the MTP layer's eh_proj -- the
    control below shows it)."""
    import dataclasses
    import itertools

    from graphgen.modelspec.compat import check_compat
    from graphgen.passes.base import PassError
    from graphgen.passes.manager import run_pipeline

    base = load_spec(MTP_SPEC)
    taken, refused = [], set()
    for tp, ep, dp, cp, sp in itertools.product((1, 2), (1, 2), (1, 2), (1, 2), (False, True)):
        spec = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, tp=tp, ep=ep, dp=dp, cp=cp,
                                                                      sp=sp))
        problems = list(check_compat(spec))
        if problems:
            refused |= {where for where, _, _ in problems}
            continue
        taken.append((tp, ep, dp, cp, sp))
        for v in spec.variants:
            run_pipeline(spec, v)
    assert (2, 2, 1, 1, False) in taken and (1, 1, 1, 1, False) in taken and (1, 2, 2, 1, False) in taken
    assert (1, 1, 1, 2, False) in taken and (2, 2, 1, 2, False) in taken  # cp with MTP: the MTP graph split too
    assert "parallel.sp" in refused and "parallel.cp" not in refused
    sp = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, tp=2, ep=2, sp=True))
    with pytest.raises(PassError, match="sequence_parallel"):  # the control: why the sp rule stays
        run_pipeline(sp, "mtp_draft")
