"""README's serving quickstart, run as written: its ``bash`` block under "## Serving" (a random
checkpoint from ``graphgen checkpoint``, ``graphgen serve`` on port 8000, the official ``openai``
client, ``kill``) in a private network namespace — so its fixed port 8000 is its own — from the
repository root, with the checkout's ``graphgen`` and ``python`` first on ``PATH``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
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
        # its own process group, output to files: a server the block leaves behind (a failed step ends
        # `bash -e` before its `kill`) is killed with it and holds no pipe the test would wait on
        with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
            p = subprocess.Popen(ns.argv("bash", "-e", "-c", block), cwd=ROOT, env=env, stdout=fout, stderr=ferr,
                                 text=True, start_new_session=True)
            try:
                p.wait(timeout=300)
            except subprocess.TimeoutExpired:
                pass
            finally:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
            fout.seek(0), ferr.seek(0)
            out, err = fout.read(), ferr.read()
    finally:
        ns.close()
    assert p.returncode == 0, (out[-2000:], err[-3000:], _log())  # the server's exit too (wait)
    assert out.count("\n") >= 2, out  # the completion's text, then the chat answer
