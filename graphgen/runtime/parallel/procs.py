"""Starting rank processes: the warm forkserver and the body every child runs first (docs/parallel.md,
"Runtime"). Torch-free: a follower node's main process (`graphgen.runtime.parallel.follower`) starts its
ranks without importing torch itself (the forkserver imports it, once).

The rank and pool processes are forked from a forkserver (`_process_context`) that imported torch and
the rank modules once, when this process first started ranks: a rank skips the fresh interpreter's torch
import (about 3 s of CPU each here). The forkserver runs no torch op, so no thread pool is forked. Each
child first takes the environment of this process at its launch (`_child`: as a spawned interpreter
would; ``ASCEND_RT_VISIBLE_DEVICES``, ``GLOO_SOCKET_IFNAME`` and the rest are read after it); a variable a
preloaded module reads at import (`_READ_AT_IMPORT`) that changed since the forkserver started makes
that launch spawn fresh interpreters instead.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
from typing import Callable, Optional, Union

from .links import LocalRank

__all__ = ["start_ranks", "RANK_MAIN"]

# what the forkserver imports once (a rank's imports: rank_main's lazy ones included)
_PRELOAD = ["torch", "torch.distributed", "graphgen.runtime.parallel.launcher", "graphgen.runtime.parallel.rank_process",
            "graphgen.runtime.checkpoint.hf"]
# environment read at import by a preloaded module (runtime/core/matmul.py): fixed in the forkserver
_READ_AT_IMPORT = ("GRAPHGEN_CPU_MATMUL",)
_forkserver_env: Optional[dict] = None  # those variables when this process's forkserver started
RANK_MAIN = "graphgen.runtime.parallel.rank_process:rank_main"  # a rank process's body, by name (imported in the child)


def _process_context():
    """The forkserver context (started with `_PRELOAD` on first use), or spawn when a variable of
    `_READ_AT_IMPORT` differs from the forkserver's (its modules would hold the old value)."""
    global _forkserver_env
    now = {k: os.environ.get(k) for k in _READ_AT_IMPORT}
    if _forkserver_env is None:
        _forkserver_env = now
        mp.set_forkserver_preload(_PRELOAD)
    return mp.get_context("forkserver" if now == _forkserver_env else "spawn")


def _child(env: dict, target: Union[Callable, str], *args) -> None:  # the body of every process started here
    os.environ.clear()  # forked from the forkserver: its environment, not this launch's
    os.environ.update(env)
    if isinstance(target, str):  # "module:function": imported here, not in the parent
        module, _, name = target.partition(":")
        getattr(importlib.import_module(module), name)(*args)
    else:
        target(*args)


@contextlib.contextmanager
def _started_in(ctx, env: dict):
    """A spawned interpreter inherits this process's environment at ``start()`` and imports torch (unpickling
    `_child` imports graphgen) before `_child` sets ``env``: so it starts in ``env``.  A variable read during
    ``import torch`` (torch_npu's backend autoload, audit 4 M9) is then there from the first instruction.
    The forkserver's children need nothing: `_child` sets ``env`` before they import anything new."""
    if ctx.get_start_method() != "spawn":
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def start_ranks(ctx, env: dict, ranks, cfg: dict) -> list[LocalRank]:
    """A process per rank of ``ranks`` (`graphgen.runtime.parallel.rank_process.rank_main` with ``cfg``), each on a
    pipe of its own."""
    ends = []
    for r in ranks:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(env, RANK_MAIN, r, cfg, child), daemon=True, name=f"graphgen-rank{r}")
        with _started_in(ctx, env):
            p.start()
        child.close()  # the rank holds its end: its death closes the pipe here
        ends.append(LocalRank(r, parent, p))
    return ends
