"""CLI behaviour: check (stale/orphan/exit codes/fix command), generate (atomic, only changed), dump."""

import os
import shutil

import pytest

from ir_util import REPO, run_cli


@pytest.fixture
def project(tmp_path):
    """A scratch project with one tiny spec and its generated files."""
    (tmp_path / "specs").mkdir()
    shutil.copy(REPO / "specs" / "tiny_qwen3.yaml", tmp_path / "specs" / "tiny_qwen3.yaml")
    res = run_cli("generate", "--spec", "specs/tiny_qwen3.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    return tmp_path


ARGS = ("--spec", "specs/tiny_qwen3.yaml")


def test_check_clean_then_stale_with_diff_and_fix_command(project):
    assert run_cli("check", *ARGS, cwd=project).returncode == 0
    g = project / "generated" / "tiny_qwen3" / "decode.graph"
    g.write_text(g.read_text().replace("eps=1e-06", "eps=1e-05", 1))
    res = run_cli("check", *ARGS, cwd=project)
    assert res.returncode == 1
    assert "--- a/generated/tiny_qwen3/decode.graph" in res.stdout and "+++ b/generated/tiny_qwen3/decode.graph" in res.stdout
    assert "-node L00.attn_norm" in res.stdout and "eps=1e-05" in res.stdout
    assert "graphgen generate --spec specs/tiny_qwen3.yaml" in res.stderr
    assert run_cli("generate", *ARGS, cwd=project).returncode == 0
    assert run_cli("check", *ARGS, cwd=project).returncode == 0


def test_check_flags_orphans_and_generate_removes_them(project):
    orphan = project / "generated" / "tiny_qwen3" / "cpu" / "old_variant.py"
    orphan.write_text("# left over\n")
    res = run_cli("check", *ARGS, cwd=project)
    assert res.returncode == 1 and "orphan (no spec produces it): generated/tiny_qwen3/cpu/old_variant.py" in res.stderr
    res = run_cli("generate", *ARGS, cwd=project)
    assert "removed generated/tiny_qwen3/cpu/old_variant.py" in res.stdout
    assert not orphan.exists()


def test_check_flags_missing_file(project):
    (project / "generated" / "tiny_qwen3" / "splitfuse.graph").unlink()
    res = run_cli("check", *ARGS, cwd=project)
    assert res.returncode == 1 and "stale: generated/tiny_qwen3/splitfuse.graph" in res.stderr


def test_generate_writes_only_changed_files(project):
    files = sorted((project / "generated").rglob("*.*"))
    before = {p: (p.stat().st_mtime_ns, p.stat().st_ino) for p in files}
    changed = project / "generated" / "tiny_qwen3" / "decode.graph"
    changed.write_text("tampered\n")
    res = run_cli("generate", *ARGS, cwd=project)
    assert res.stdout.strip().splitlines() == ["wrote generated/tiny_qwen3/decode.graph"]
    for p in files:
        if p != changed:
            assert (p.stat().st_mtime_ns, p.stat().st_ino) == before[p], p


def test_dry_run_writes_nothing(project):
    target = project / "generated" / "tiny_qwen3" / "decode.graph"
    target.unlink()
    res = run_cli("generate", *ARGS, "--dry-run", cwd=project)
    assert res.returncode == 0 and "would write generated/tiny_qwen3/decode.graph" in res.stdout
    assert not target.exists()


def test_no_temp_files_left_behind(project):
    leftovers = [p for p in (project / "generated").rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_dump_after_each_pass_and_dot(project):
    res = run_cli("dump", "specs/tiny_qwen3.yaml", "mempool_prefill_layer", "--after", "insert_kv_save", cwd=project)
    assert res.returncode == 0
    assert "node L00.kv_save kv_save kv_save" in res.stdout and " record " not in res.stdout
    res = run_cli("dump", "specs/tiny_qwen3.yaml", "mempool_prefill_layer", cwd=project)
    assert "node L00.kv_write.record main record event=ev.L00.kv_write" in res.stdout
    res = run_cli("dump", "specs/tiny_qwen3.yaml", "mempool_prefill_layer", "--format", "dot", cwd=project)
    assert res.stdout.startswith('digraph "tiny_qwen3.mempool_prefill_layer"')
    assert '"L00.kv_write.record" -> "L00.kv_save.wait" [color=red' in res.stdout
    res = run_cli("dump", "specs/tiny_qwen3.yaml", "nope", cwd=project)
    assert res.returncode == 2 and "no variant 'nope'" in res.stderr


def test_validate(project):
    res = run_cli("validate", "specs/tiny_qwen3.yaml", cwd=project)
    assert res.returncode == 0 and "specs/tiny_qwen3.yaml: ok (qwen3_dense, 2 layers" in res.stdout


def test_schema_command_matches_file():
    res = run_cli("schema")
    assert res.returncode == 0 and res.stdout == (REPO / "specs" / "schema.json").read_text()


COMMANDS = ("generate", "check", "validate", "dump", "verify", "schema", "import-hf", "checkpoint", "run", "serve",
            "compile", "route", "dry-run")


@pytest.mark.parametrize("module", ["graphgen", "graphgen.cli"])
def test_python_dash_m_lists_every_command(module):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: graphgen ")
    listed = res.stdout.split("{", 1)[1].split("}", 1)[0].split(",")
    assert sorted(listed) == sorted(COMMANDS)


def test_build_commands_never_import_torch(project):
    """Every build command (import-hf included) runs in one process that must end without torch."""
    import json
    import subprocess
    import sys

    hf = project / "hf_tiny"
    hf.mkdir()
    hf.joinpath("config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "head_dim": 16,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "vocab_size": 256, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "torch_dtype": "float32", "attention_bias": False}))
    calls = [["check", *ARGS], ["validate", ARGS[1]], ["dump", ARGS[1], "decode"],
             ["dump", ARGS[1], "decode", "--format", "dot"], ["verify", "generated/tiny_qwen3/decode.graph"],
             ["schema"], ["import-hf", str(hf), "--out", "specs/imported.yaml"]]
    code = ("import contextlib, io, json, sys; from graphgen.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rcs = [main(a) for a in json.loads(sys.argv[1])]\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'torch_npu', 'transformers'))\n"
            "print(rcs, bad)")
    res = subprocess.run([sys.executable, "-c", code, json.dumps(calls)], cwd=project, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{[0] * len(calls)} []", res.stderr
    assert (project / "specs" / "imported.yaml").is_file()


def test_layout_flags_reach_open_engine_and_override_the_spec():
    import argparse

    from graphgen.engine_args import add_engine_arguments, check_engine_arguments, engine_options, layout_refusal
    from graphgen.modelspec.loader import load_spec

    p = argparse.ArgumentParser()
    add_engine_arguments(p, max_num_seqs=8, async_scheduling=False)
    base = ["--spec", "s.yaml", "--weights", "w"]
    args = p.parse_args([*base, "--tp", "2", "--sp", "--cp", "1"])
    opts = engine_options(args)
    assert (opts["tp"], opts["sp"], opts["cp"]) == (2, True, 1) and "dp" not in opts  # absent: the spec's value
    sp = load_spec(REPO / "specs/tiny_qwen3_tp2_sp.yaml")
    assert layout_refusal(sp, args) is None  # sp runs on the CPU ranks
    assert layout_refusal(sp, p.parse_args([*base, "--target", "npu"])) is None  # ... and on the NPU runner
    assert layout_refusal(sp, p.parse_args([*base, "--no-sp"])) is None
    assert sp.with_overrides(sp=False).parallel == type(sp.parallel)(tp=2)
    assert check_engine_arguments(p.parse_args([*base, "--dp", "0"])) == "--dp must be >= 1, got 0"


@pytest.mark.parametrize("cmd,flags,missing", [
    ("run", ("--speculative", "mtp", "--cp", "2", "--dp", "2", "--ep", "2"), "context parallel inside DP attention"),
    ("run", ("--tp", "2", "--sp"), "sp with MTP is not implemented"),
    ("serve", ("--speculative", "mtp", "--tp", "2", "--sp"), "sp with MTP is not implemented"),
    ("run", ("--speculative", "mtp", "--cp", "2", "--target", "npu", "--standin"), "MTP layers does not run on the NPU"),
])
def test_mtp_launches_the_runtimes_cannot_run_are_refused_in_one_sentence(tmp_path, cmd, flags, missing):
    """Issue 38 item 1: MTP with tp, ep, dp and cp runs on the CPU ranks (tests/parallel/test_mtp_ranks.py); what
    still does not -- sp with MTP (a spec rule, `families.parallel.parallel_rules`, also for a --sp override), cp
    with MTP on the NPU runner and speculative cp inside DP attention (launch rows of the one table) -- is one
    sentence naming what is missing, exit 2, before any weights load (the folder is empty). In this interpreter
    (`support.inproc`)."""
    from graphgen.families.parallel import runtime_layout_gap
    from graphgen.modelspec.loader import load_spec
    from support.cli import cli_inproc

    extra = ("--prompt-ids", "1,2") if cmd == "run" else ("--port", "0")
    res = cli_inproc(cmd, "--spec", str(REPO / "specs/tiny_deepseek_v3_mtp.yaml"), "--weights", str(tmp_path),
                     *extra, *flags)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and missing in lines[0], res.stderr
    # the controls: ranks with MTP on either target are no gap, speculative or not
    spec = load_spec(REPO / "specs/tiny_deepseek_v3_mtp.yaml")
    for layout in ({}, {"tp": 2}, {"tp": 2, "ep": 2}, {"dp": 2, "ep": 2}, {"dp": 2, "tp": 2, "ep": 4}):
        for target in ("cpu", "npu"):
            assert runtime_layout_gap(spec.with_overrides(**layout).parallel, target, mtp=True, speculative=True) is None
    for layout in ({"cp": 2}, {"cp": 2, "tp": 2}):  # cp with MTP: the CPU ranks run it, the NPU runner not yet
        assert runtime_layout_gap(spec.with_overrides(**layout).parallel, "cpu", mtp=True, speculative=True) is None
        assert runtime_layout_gap(spec.with_overrides(**layout).parallel, "npu", mtp=True, speculative=True)
