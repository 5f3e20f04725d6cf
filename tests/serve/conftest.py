"""Real servers on 127.0.0.1: ``python -m graphgen.serve`` subprocesses on free ports, on tiny random
checkpoints written with their tokenizers (``ckpt`` and the others: session fixtures of
tests/conftest.py). ``servers`` (tests/support/servers.py) starts one per distinct set of flags for
the whole session; ``server`` is the one most modules share. Every wait is bounded."""

from __future__ import annotations

import pytest

import fastapi  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
import uvicorn  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
import prometheus_client  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
import openai  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)

from support.servers import ServerFactory

# write: sync, so a repeated prompt deterministically hits what the first one saved
SHARED = ("--write", "sync", "--num-blocks", "256")


@pytest.fixture(scope="session")
def servers():
    factory = ServerFactory()
    yield factory
    factory.close()  # each must exit 0 on SIGTERM


@pytest.fixture
def server(servers, ckpt):
    """The tiny Qwen3 server most modules share (tests/serve/test_serve_api.py and others)."""
    return servers.get(ckpt, *SHARED)
