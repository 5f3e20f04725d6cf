"""What every ``graphgen`` command shares: the exit codes and how errors are printed.

Exit codes (all commands):
  0  success (``check``: generated/ is up to date)
  1  ``check``: generated/ is stale or has orphans (a diff and the fix command are printed);
     ``verify``: the graph has races or event errors; ``compile --standin``: the structure check failed
  2  invalid input: a spec error, a failed pass, an unreadable or unparsable file, bad arguments;
     also a missing install extra (one sentence naming it, e.g. ``pip install 'graphgen[runtime]'``)
  3  ``compile``: the target's toolchain is not available here (e.g. no torch_npu)

This module is imported by every command module and imports none of them, so the CLI package has
no import circle.
"""

from __future__ import annotations

import sys

from ..engine_args import EXIT_INVALID as EXIT_INVALID, EXIT_OK as EXIT_OK, EXIT_STALE as EXIT_STALE  # one home,
from ..engine_args import EXIT_UNAVAILABLE as EXIT_UNAVAILABLE  # re-exported for the commands

EXIT_CODES_EPILOG = ("Exit codes: 0 ok; 1 stale (check) or races (verify); "
                     "2 invalid spec/graph/arguments; 3 toolchain unavailable.")


def err(msg: str) -> None:
    """One message for the user, on stderr (stdout carries only a command's results)."""
    print(msg, file=sys.stderr)


def usage_error(command: str, msg: str) -> int:
    """Print a bad-argument message the way argparse does for ``command``; return EXIT_INVALID."""
    err(f"graphgen {command}: error: {msg}")
    return EXIT_INVALID


def dispatch(args) -> int:
    """Run the handler a command module set on ``args``; a spec error, a failed pass or a missing
    install extra exits 2.

    The first two carry their own rendering (file:line:col and the fix for a spec; the failing pass
    and the ones before it for a pass), so they are printed as they are, with no traceback; a missing
    extra is the one sentence of ``graphgen.install`` naming the command and the extra.
    """
    from ..install import MissingExtra, extra_of, sentence
    from ..modelspec.errors import SpecError
    from ..passes.base import PassError

    who = f"graphgen {getattr(args, 'command', '')}".rstrip()
    try:
        return args.handler(args)
    except MissingExtra as e:  # checked up front by a command, or by importing graphgen.runtime
        err(sentence(who, e.extra, e.module))
        return EXIT_INVALID
    except ModuleNotFoundError as e:  # a lazy import of an extra's module that no check covered
        extra = extra_of(e.name or "")
        if extra is None:  # not an optional dependency: a real bug, shown as one
            raise
        err(sentence(who, extra, e.name.split(".")[0]))
        return EXIT_INVALID
    except SpecError as e:
        err(str(e))
        err(f"graphgen: {len(e.diagnostics)} error(s); nothing was written")
        return EXIT_INVALID
    except PassError as e:
        err(f"error: {e}")
        err("graphgen: nothing was written")
        return EXIT_INVALID
