"""`support.inproc.cli_inproc` gives what a subprocess gives (status, stdout, stderr: compared with a
real ``python -m graphgen.cli`` for a success, a bad spec and a bad argument) and leaves this process
as it found it (cwd, environment, argv, logging, warnings, torch threads and RNG)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from support.cli import cli, cli_inproc
from support.paths import REPO, TINY_QWEN3

BAD_SPEC = "name: x\nfamily: qwen3_dense\ndims: {hidden_size: -1}\n"


@pytest.mark.parametrize("case", ["ok", "bad_spec", "bad_argument", "help"])
def test_same_status_and_output_as_a_subprocess(tmp_path, case):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_SPEC)
    args = {"ok": ("validate", TINY_QWEN3), "bad_spec": ("validate", bad),
            "bad_argument": ("validate", "--no-such-flag"), "help": ("validate", "--help")}[case]
    want, got = cli(*args), cli_inproc(*args)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert got.returncode == {"ok": 0, "bad_spec": 2, "bad_argument": 2, "help": 0}[case]
    assert got.stdout or got.stderr   # not vacuous: the command said something


def test_an_uncaught_exception_is_a_traceback_and_status_1(monkeypatch):
    import graphgen.cli.build as build

    def boom(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(build, "cmd_validate", boom, raising=True)
    res = cli_inproc("validate", TINY_QWEN3)
    assert res.returncode == 1 and "Traceback" in res.stderr and "RuntimeError: a bug" in res.stderr


def test_state_is_restored(tmp_path, monkeypatch):
    import warnings

    import torch

    import graphgen.cli.build as build

    seen = {}

    def probe(args):   # what the command sees, then it changes everything it can
        seen.update(cwd=os.getcwd(), env=os.environ.get("GG_PROBE"), argv=sys.argv[:], threads=torch.get_num_threads())
        os.chdir(tmp_path)
        os.environ["GG_LEAK"] = "1"
        sys.argv.append("leak")
        logging.basicConfig(level=logging.DEBUG)
        logging.getLogger("graphgen.probe").warning("to stderr")
        warnings.simplefilter("error")
        torch.set_num_threads(3)
        torch.rand(1)
        print("to stdout")
        return 0

    monkeypatch.setattr(build, "cmd_validate", probe, raising=True)
    suite_threads = torch.get_num_threads()
    torch.set_num_threads(2)   # not the suite's 1 (tests/conftest.py): the call's 1 is then its own doing
    before = (os.getcwd(), dict(os.environ), sys.argv[:], logging.getLogger().handlers[:], logging.getLogger().level,
              torch.get_num_threads(), torch.get_rng_state())
    try:
        res = cli_inproc("validate", TINY_QWEN3, cwd=REPO / "specs", env_extra={"GG_PROBE": "x"})
        after = (os.getcwd(), dict(os.environ), sys.argv[:], logging.getLogger().handlers[:],
                 logging.getLogger().level, torch.get_num_threads(), torch.get_rng_state())
    finally:
        torch.set_num_threads(suite_threads)
    assert res.returncode == 0 and res.stdout == "to stdout\n" and "to stderr" in res.stderr, res
    assert seen == {"cwd": str(REPO / "specs"), "env": "x", "argv": ["graphgen", "validate", str(TINY_QWEN3)],
                    "threads": 1}
    assert after[:6] == before[:6] and torch.equal(after[6], before[6])
    with warnings.catch_warnings(record=True) as caught:   # the command's simplefilter("error") was undone
        warnings.warn("not an error", UserWarning)
    assert len(caught) == 1


def test_start_only_variables_are_refused():
    with pytest.raises(ValueError, match="PYTHONHASHSEED take effect only when an interpreter starts"):
        cli_inproc("validate", TINY_QWEN3, env_extra={"PYTHONHASHSEED": "1"})


def test_timeout_raises_like_subprocess_run(monkeypatch):
    import time

    import graphgen.cli.build as build

    def forever(args):
        while True:
            time.sleep(0.05)

    monkeypatch.setattr(build, "cmd_validate", forever, raising=True)
    with pytest.raises(subprocess.TimeoutExpired):
        cli_inproc("validate", TINY_QWEN3, timeout=0.2)
