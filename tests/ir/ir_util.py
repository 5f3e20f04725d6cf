"""Helpers shared by the IR/CLI tests (``run_cli`` is `support.cli.run_cli`)."""

from support.cli import run_cli  # noqa: F401
from support.paths import REPO


def golden_files():
    return sorted((REPO / "generated").rglob("*.graph"))
