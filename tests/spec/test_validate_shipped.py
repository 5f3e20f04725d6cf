"""``graphgen validate`` on every shipped spec (``specs/*.yaml``, the MTP ones included: the memory pass once
looked their MTP layer up in a layout without it, a KeyError traceback), the memory verdict with its fix,
and ``graphgen import-hf`` with a layout (``--tp``/``--fit``) on the published Qwen3-32B config.

The numbers validate prints are pinned where they are the issue's (docs/npu.md "Full-size launch": Qwen3-32B
at tp 2 holds 30.51 GiB of bf16 weights per rank, audit 3 §3); the dry run measures the rest
(tests/load/test_dry_run.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from graphgen.cli import main
from support.paths import REPO, SPECS

PUBLISHED = REPO / "tests/load/data"
SHIPPED = sorted(SPECS.glob("*.yaml"))


def _validate(capsys, *args):
    rc = main(["validate", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow  # every shipped spec's memory pass at full size, > 5 s
def test_every_shipped_spec_validates(capsys):
    assert {"deepseek_v3_1_mtp.yaml", "tiny_deepseek_v3_mtp.yaml", "qwen3_32b.yaml"} <= {p.name for p in SHIPPED}
    rc, out, err = _validate(capsys, *SHIPPED)
    assert "Traceback" not in err and "KeyError" not in err
    for p in SHIPPED:
        line = next(l for l in out.splitlines() if l.startswith(f"{p}: "))
        assert ": ok (" in line or p.name == "deepseek_v3_1_mtp.yaml", line
    # the MTP trace subject (it declares no device) holds 1.25 TiB on one rank: it does not fit the NPU target's
    # default die, the line says so and so does the exit code (issue 43 item 3); the fix names the layout that
    # fits with the MTP layer sharded like a decoder layer (issue 38 item 2: tp 32, as deepseek_v3_1 without it)
    assert f"{SPECS / 'deepseek_v3_1_mtp.yaml'}: does not fit" in out and rc == 2, err
    assert [l.split(":")[0] for l in err.splitlines() if ": error: " in l] == [str(SPECS / "deepseek_v3_1_mtp.yaml")]
    assert "fix: set parallel tp: 32, ep: 1 (tp=32, ep=1: 46.18 GiB per rank)" in err, err
    assert "per rank (tp=2, ep=1): 36.30 GiB of 54.87 GiB = weights 30.51 GiB" in out  # audit 3 §3


def test_a_spec_over_its_device_exits_2_naming_a_layout_that_fits(tmp_path, capsys):
    one = tmp_path / "qwen3_32b_tp1.yaml"
    one.write_text((SPECS / "qwen3_32b.yaml").read_text().replace("tp: 2", "tp: 1"))
    rc, out, err = _validate(capsys, one)
    assert rc == 2 and f"{one}: does not fit" in out
    assert f"{one}: error: per rank 70.87 GiB (weights 61.03 GiB + KV 8.00 GiB" in err, err
    assert "fix: set parallel tp: 2, ep: 1 (tp=2, ep=1: 36.30 GiB per rank)" in err, err
    rc, _, err = _validate(capsys, one, "--device-memory-gib", "160")  # the flag over the spec's 64
    assert rc == 0, err


def _published(tmp_path) -> Path:
    hf = tmp_path / "Qwen3-32B"
    hf.mkdir()
    (hf / "config.json").write_text((PUBLISHED / "qwen3_32b.config.json").read_text())
    return hf


def test_import_hf_fit_writes_a_layout_validate_accepts(tmp_path, capsys):
    """The published Qwen3-32B config (65.5 GB of bf16 weights): alone it imports at tp 1, which does not
    fit a 64 GiB die; --fit picks tp 2, and validate accepts what it wrote."""
    hf = _published(tmp_path)
    plain, fit = tmp_path / "plain.yaml", tmp_path / "fit.yaml"
    assert main(["import-hf", str(hf), "--out", str(plain)]) == 0
    assert main(["import-hf", str(hf), "--out", str(fit), "--fit"]) == 0
    assert "tp=2, ep=1" in capsys.readouterr().out
    rc, out, err = _validate(capsys, plain)  # no device stated: the 64 GiB default, and an error all the same
    assert rc == 2 and f"{plain}: does not fit" in out and f"{plain}: error: " in err, err
    assert "(the NPU target's default device: state yours with targets.npu.device_memory_gib" in err, err
    rc, out, err = _validate(capsys, fit)
    assert rc == 0 and f"{fit}: ok" in out and "tp=2" in out and not err, err
    text = fit.read_text()
    assert "tp: 2" in text and "Layout chosen by --fit for 64 GiB devices" in text
    assert "device_memory_gib: 64" in text  # the device the layout was fitted to (issue 43 item 3)
    capsys.readouterr()
    assert main(["import-hf", str(hf), "--out", str(fit), "--fit", "--device-memory-gib", "40"]) == 0
    assert "tp: 4" in fit.read_text() and "device_memory_gib: 40" in fit.read_text()


def test_one_per_rank_figure_the_fix_validate_and_its_parts_agree_on(tmp_path, capsys):
    """Issue 43 item 4: the fix a refusal names (tp 2's per-rank figure) is the figure validate prints for that
    layout against the share, the parts it lists add up to it, and KV per block is in MiB."""
    import re

    one = tmp_path / "qwen3_32b_tp1.yaml"
    one.write_text((SPECS / "qwen3_32b.yaml").read_text().replace("tp: 2", "tp: 1"))
    _, _, err = _validate(capsys, one)
    fix = re.search(r"\(tp=2, ep=1: ([\d.]+) GiB per rank\)", err)
    _, out, _ = _validate(capsys, SPECS / "qwen3_32b.yaml")
    line = re.search(r"per rank \(tp=2, ep=1\): ([\d.]+) GiB of ([\d.]+) GiB = (.*?) \(0\.9 x", out)
    assert fix and line and fix[1] == line[1] == "36.30" and line[2] == "54.87", (err, out)
    parts = [float(v) * (1 if unit == "GiB" else 1 / 1024) for v, unit in
             re.findall(r"(?:^|\+ )[a-zA-Z ]+? ([\d.]+) (GiB|MiB)", line[3])]
    assert len(parts) == 6 and abs(sum(parts) - 36.30) < 0.02, (parts, line[3])  # weights, KV, rings, HCCL, activations, reserve
    assert "KV 4.00 GiB (256 blocks for the largest decode batch, 16.00 MiB each)" in line[3]
    assert "KiB per block" not in out and "total" not in out
    # docs/npu.md's example is what the command prints (whitespace aside)
    doc = (REPO / "docs/npu.md").read_text()
    example = re.search(r"```\nspecs/qwen3_32b\.yaml: ok \(\.\.\.\); (per rank .*?)\n```", doc, re.S)
    printed = out.split("; ", 1)[1].strip()
    assert example and " ".join(example[1].split()) == printed, printed


def test_import_hf_layout_options(tmp_path, capsys):
    hf = _published(tmp_path)
    out = tmp_path / "s.yaml"
    assert main(["import-hf", str(hf), "--out", str(out), "--tp", "4", "--device-memory-gib", "32"]) == 0
    text = out.read_text()
    assert "tp: 4" in text and "device_memory_gib: 32" in text
    rc, o, err = _validate(capsys, out)
    assert rc == 0 and "GiB of 26.07 GiB = " in o, o  # 0.9 x (32 - 3.03) GiB: what the engine may use
    capsys.readouterr()
    assert main(["import-hf", str(hf), "--out", str(out), "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "tp (3) must divide num_attention_heads (64" in err and "Traceback" not in err
    assert main(["import-hf", str(hf), "--out", str(out), "--fit", "--device-memory-gib", "8"]) == 0
    assert "tp: 32" in out.read_text()  # 1.9 GiB of weights + 1 GiB of KV (a KV head each) fit; tp 16 does not
    assert main(["import-hf", str(hf), "--out", str(out), "--fit", "--tp", "2"]) == 2


@pytest.mark.parametrize("spec", ["deepseek_v3_1_mtp.yaml", "tiny_deepseek_v3_mtp.yaml"])
def test_mtp_specs_count_their_mtp_layer(spec, capsys):
    """The MTP layer's weights are counted (the KeyError of issue 27): more than the same spec without it."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.passes.manager import run_pipeline
    from graphgen.passes.memory import rank_memory

    s = load_spec(SPECS / spec)
    with_mtp = rank_memory(s, [run_pipeline(s, v, until="shard") for v in s.variants])
    import dataclasses

    plain = dataclasses.replace(s, mtp=None, variants={k: v for k, v in s.variants.items() if v.phase != "mtp"})
    without = rank_memory(plain, [run_pipeline(plain, v, until="shard") for v in plain.variants])
    assert with_mtp.weight_bytes > without.weight_bytes


def test_import_hf_of_the_published_deepseek_v3_1_fp8_config_fits_two_nodes_in_w8a8(tmp_path, capsys):
    """Issue 28's acceptance: the published DeepSeek-V3.1 config.json (its FP8 quantization_config included)
    imports; --fit --device-memory-gib 64 picks tp 32 in bf16 (four nodes of 8) and tp 16 with
    --quantization w8a8_dynamic (two nodes: the int8 weights and their scales, 40.63 GiB per rank), and
    validate accepts both."""
    hf = tmp_path / "DeepSeek-V3.1"
    hf.mkdir()
    (hf / "config.json").write_text((PUBLISHED / "deepseek_v3_1.config.json").read_text())
    bf16, w8 = tmp_path / "bf16.yaml", tmp_path / "w8a8.yaml"
    assert main(["import-hf", str(hf), "--out", str(bf16), "--fit", "--device-memory-gib", "64"]) == 0
    assert main(["import-hf", str(hf), "--out", str(w8), "--fit", "--device-memory-gib", "64",
                 "--quantization", "w8a8_dynamic"]) == 0
    out = capsys.readouterr().out
    assert "tp=32, ep=1" in out and "tp=16, ep=1" in out
    for spec in (bf16, w8):
        text = spec.read_text()
        assert "quant_method: fp8" in text and "weight_block_size: [128, 128]" in text
        rc, o, err = _validate(capsys, spec)
        assert rc == 0 and f"{spec}: ok" in o and not err, err
    assert "per rank (tp=16, ep=1): " in o and " = weights 40.63 GiB" in o
