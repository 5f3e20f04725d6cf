"""Where things are: the repository root (``generated/`` and ``specs/`` live there) and the tiny specs."""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
SPECS = REPO / "specs"
TINY_QWEN3 = SPECS / "tiny_qwen3.yaml"
TINY_DSV3 = SPECS / "tiny_deepseek_v3.yaml"
TINY_DSV3_MTP = SPECS / "tiny_deepseek_v3_mtp.yaml"


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a test's child process: the repo (this checkout's ``graphgen``) and
    ``tests/`` (``support``) first on ``PYTHONPATH``, plus ``extra``."""
    path = os.pathsep.join(p for p in (str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)
