"""Helpers shared by the IR/CLI tests (a plain module, not a conftest: test folders share no conftest name)."""

import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, cwd=REPO, env_extra=None):
    """Run `python -m graphgen.cli ARGS` in a fresh process (like a user would)."""
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "graphgen.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def golden_files():
    return sorted((REPO / "generated").rglob("*.graph"))
