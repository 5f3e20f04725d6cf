"""README's serving quickstart, run as written: its ``bash`` block under "## Serving" (a random
checkpoint from ``graphgen checkpoint``, ``graphgen serve`` on port 8000, the official ``openai``
client, ``kill``) in a private network namespace — so its fixed port 8000 is its own — from the
repository root, with the checkout's ``graphgen`` and ``python`` first on ``PATH``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from serve_util import ROOT
from support.netns import Namespace, _env


def _quickstart() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Serving\n", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def _log() -> str:
    log = ROOT / ".cache" / "serve.log"
    return log.read_text()[-3000:] if log.exists() else "(no .cache/serve.log)"


def test_readme_serving_quickstart_runs_as_written():
    block = _quickstart()
    assert "graphgen checkpoint" in block and "graphgen serve" in block and "openai" in block
    try:
        ns = Namespace()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)  # never a silent skip, as the Mooncake tests
    try:
        env = dict(_env(), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   OMP_NUM_THREADS="1")
        try:
            res = subprocess.run(ns.argv("bash", "-e", "-c", block), cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=300)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the quickstart did not finish in 300 s: {e.stdout!r} {e.stderr!r} {_log()}")
    finally:
        ns.close()
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-3000:], _log())  # the server's exit too (wait)
    assert res.stdout.count("\n") >= 2, res.stdout  # the completion's text, then the chat answer
