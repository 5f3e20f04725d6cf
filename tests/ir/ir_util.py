"""Helpers shared by the IR/CLI tests. ``run_cli`` runs ``graphgen`` in this interpreter
(`support.inproc.cli_inproc`: same return shape as a subprocess); the entry point itself and what
only a fresh interpreter shows (no torch imported, PYTHONHASHSEED) use `support.cli.run_cli`."""

from support.cli import cli_inproc as run_cli  # noqa: F401
from support.paths import REPO


def golden_files():
    return sorted((REPO / "generated").rglob("*.graph"))
