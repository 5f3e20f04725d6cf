"""The CI rule on skips (tests/support/skips.py), on a throwaway test file run by a child pytest:
an unexpected skip fails the run under GRAPHGEN_NO_SKIPS=1, an allowed reason does not, and without
the variable a skip is only reported."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.paths import TESTS

BODY = '''
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip({reason!r})
'''


def _run(tmp_path, reason: str, strict: bool) -> subprocess.CompletedProcess:
    (tmp_path / "test_x.py").write_text(BODY.format(reason=reason))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "GRAPHGEN_NO_SKIPS")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if strict:
        env["GRAPHGEN_NO_SKIPS"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "support.skips",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("strict,reason,rc", [
    (True, "some extra is missing", 1),                       # the rule
    (True, "real torch_npu installed; stand-in not used", 0),  # an allowed reason
    (False, "some extra is missing", 0),                      # not under CI: reported only
])
def test_unexpected_skip_fails_the_run_only_under_ci(tmp_path, strict, reason, rc):
    res = _run(tmp_path, reason, strict)
    assert res.returncode == rc, res.stdout[-2000:] + res.stderr[-2000:]
    assert "1 passed, 1 skipped" in res.stdout
    assert ("unexpected skip" in res.stdout) == (rc == 1)
