"""Paths of the serve tests (a plain module, not conftest: test modules import it by its unique
name); the server processes themselves are tests/support/servers.py's."""

from __future__ import annotations

from support.paths import REPO as ROOT  # noqa: F401
from support.servers import SPEC, STARTUP_S, STOP_S, Server  # noqa: F401
