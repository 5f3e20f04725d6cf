"""The command loop of a test's worker process driven through a pipe: one JSON command per line on
stdin (``{"op": ..., ...}``), replies as ``@@{json}`` lines on stdout (anything else there is a
library's own output). ``exit`` is answered here and ends the process at once (``os._exit``:
Mooncake's close waits for a master that may be gone)."""
from __future__ import annotations

import json
import os
import sys
from typing import Iterator


def reply(**kw) -> None:
    sys.stdout.write("@@" + json.dumps(kw) + "\n")
    sys.stdout.flush()


def commands() -> Iterator[tuple[str, dict]]:
    """``(op, command)`` for each line on stdin until ``exit``."""
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            reply(ok=True)
            os._exit(0)
        yield cmd["op"], cmd
