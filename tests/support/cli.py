"""``graphgen`` in a subprocess, from the repo root (where ``generated/`` lives), as a user runs it;
`cli_inproc` (`support.inproc`): the same command in this interpreter, same return shape, for the
tests a subprocess proves nothing more for (docs/testing.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Iterable, Sequence

from .inproc import cli_inproc, run_tokens_inproc  # noqa: F401  (re-exported: one import for CLI tests)
from .paths import REPO, subprocess_env

# one intra-op thread in CLI subprocesses (tiny models; see tests/e2e/conftest.py)
CLI_ENV = subprocess_env(OMP_NUM_THREADS="1")


def cli_argv(*args) -> list[str]:
    return [sys.executable, "-m", "graphgen.cli", *map(str, args)]


def run_cli(*args, cwd=REPO, env_extra=None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m graphgen.cli ARGS`` in a fresh process, with this environment (+ ``env_extra``)."""
    env = subprocess_env(**(env_extra or {}))
    return subprocess.run(cli_argv(*args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def cli(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    """``graphgen <args>`` with one torch thread (``CLI_ENV``)."""
    return subprocess.run(cli_argv(*args), cwd=REPO, env=CLI_ENV, capture_output=True, text=True,
                          timeout=timeout)


def run_args(spec, ckpt, prompts: Iterable[Sequence[int]], n_new: int, *extra) -> list[str]:
    """``run --spec S --weights W --json --max-new-tokens N [extra] --prompt-ids ...`` (one per prompt)."""
    args = ["run", "--spec", str(spec), "--weights", str(ckpt), "--json", "--max-new-tokens", str(n_new),
            *map(str, extra)]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    return args


def graphgen(*args, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python -m graphgen ARGS`` (the package entry) with one torch thread."""
    return subprocess.run([sys.executable, "-m", "graphgen", *map(str, args)], cwd=REPO, env=CLI_ENV,
                          capture_output=True, text=True, timeout=timeout)


def run_tokens(spec, ckpt, prompts, n_new: int, *extra, timeout: float = 180) -> list[list[int]]:
    """The tokens ``graphgen run --json`` prints for ``prompts`` (one JSON line each); asserts exit 0."""
    res = graphgen(*run_args(spec, ckpt, prompts, n_new, *extra), timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(s)["tokens"] for s in res.stdout.splitlines() if s.startswith("{")]
