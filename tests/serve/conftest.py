"""A real server on 127.0.0.1: ``python -m graphgen.serve`` as a subprocess on a free port, on a tiny
random Qwen3 checkpoint written with its tokenizer (``ckpt``, a session fixture of tests/conftest.py).
Every wait is bounded."""

from __future__ import annotations

import pytest

import fastapi  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
import uvicorn  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
import prometheus_client  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
import openai  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)

from serve_util import Server  # noqa: E402


@pytest.fixture(scope="module")
def server(ckpt):
    """write: sync, so a repeated prompt deterministically hits what the first one saved."""
    s = Server(ckpt, "--write", "sync", "--num-blocks", "256")
    yield s
    rc = s.terminate()
    assert rc == 0, s.proc.stderr.read()[-3000:]
