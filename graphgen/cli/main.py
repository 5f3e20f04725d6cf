"""The ``graphgen`` command line.

The parser is built from ``COMMAND_MODULES``: each module registers its subcommands with
``register(subparsers)`` and sets a ``handler`` on each. Adding a command group is one new module
plus one line here. Handlers import what they need (torch included) lazily, so building the parser
and the build commands never import torch.
"""

from __future__ import annotations

import argparse

from ..serve import cli as serve
from . import build, checkpoint, npu, route, run
from .common import EXIT_CODES_EPILOG, dispatch

# Order is the order of `graphgen --help`.
COMMAND_MODULES = (build, checkpoint, run, serve, route, npu)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphgen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=EXIT_CODES_EPILOG)
    sub = p.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return dispatch(args)
