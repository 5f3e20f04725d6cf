"""``graphgen ARGS`` run by ``graphgen.cli.main`` in this interpreter: what a CLI test gets from a
subprocess (exit status, stdout, stderr), without the ~3 s of CPU a fresh interpreter pays to import
torch (docs/testing.md: a subprocess proves the entry point; keep one per command, run the rest here).

`cli_inproc` guarantees, for each call:

* the return shape of ``subprocess.run(..., capture_output=True, text=True)``: a
  ``subprocess.CompletedProcess`` with ``args``, ``returncode``, ``stdout``, ``stderr`` (text);
* ``returncode`` as the interpreter would give it: ``main``'s return value (None: 0); a
  ``SystemExit``'s code (argparse's 2, ``--help``'s 0; None: 0; a message: printed to stderr, 1); an
  uncaught exception: its traceback on the captured stderr and 1 (a "no traceback" check still sees it);
* captured output: everything written to ``sys.stdout``/``sys.stderr`` during the call; log records
  reach stderr as in a fresh interpreter (the root logger has no handler and level WARNING during the
  call: ``logging.lastResort`` prints WARNING and above); warnings are printed to stderr under
  Python's default filters, not recorded by pytest;
* restored after the call, whatever it did: the working directory (``cwd`` during the call),
  ``os.environ`` (``env_extra`` added during the call), ``sys.argv``, ``sys.stdout``/``sys.stderr``,
  the root logger's handlers and level (a ``basicConfig`` of the command is undone), the warning
  filters, torch's intra-op threads (1 during the call, as ``CLI_ENV``'s ``OMP_NUM_THREADS=1`` gives
  a subprocess, when torch is imported before the call), torch's global RNG state and default dtype,
  Python's ``random`` state;
* ``timeout``: ``subprocess.TimeoutExpired`` as ``subprocess.run`` raises it (a SIGALRM timer; only
  on the main thread, where pytest runs tests).

What it does not do: modules the command imports stay imported (``sys.modules`` is not restored, so
a module-level cache or registry keeps its state); output a C library or a child process writes to
file descriptor 1 or 2 is not captured; a variable read only at interpreter start cannot be set
(``PYTHONHASHSEED``, ``PYTHONPATH``, ...: a ``ValueError`` says to use a subprocess, `support.cli.cli`).
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import traceback
import warnings

from .paths import REPO

__all__ = ["cli_inproc", "run_tokens_inproc"]

# read by the interpreter when it starts, not later: setting them in-process would prove nothing
_START_ONLY = ("PYTHONHASHSEED", "PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE",
               "PYTHONOPTIMIZE", "PYTHONDONTWRITEBYTECODE", "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONUTF8")


def _exit_code(e: SystemExit, stderr) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=stderr)  # sys.exit("message"): printed, status 1 (as the interpreter does)
    return 1


@contextlib.contextmanager
def _torch_state():
    """One intra-op thread during the call; threads, RNG and default dtype restored after (torch only
    when it was imported before the call: importing it here would make torch-free tests import it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    threads, rng, dtype = torch.get_num_threads(), torch.get_rng_state(), torch.get_default_dtype()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        torch.set_default_dtype(dtype)


@contextlib.contextmanager
def _process_state(argv: list[str], cwd, env_extra: dict):
    """argv, cwd, environment, logging, warnings and ``random`` as a fresh interpreter has them; restored."""
    saved_argv, saved_cwd, saved_env = sys.argv[:], os.getcwd(), dict(os.environ)
    root = logging.getLogger()
    saved_handlers, saved_level, saved_random = root.handlers[:], root.level, random.getstate()
    sys.argv = argv
    os.chdir(cwd)
    os.environ.update(env_extra)
    root.handlers, root.level = [], logging.WARNING
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()  # Python's default filters, shown on stderr (not pytest's recorder)
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
            warnings.showwarning = warnings._showwarning_orig  # type: ignore[attr-defined]
            yield
    finally:
        root.handlers, root.level = saved_handlers, saved_level
        random.setstate(saved_random)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv


class _Expired(BaseException):
    """The call's timer went off (a BaseException: a command's ``except Exception`` does not eat it)."""


@contextlib.contextmanager
def _deadline(timeout, argv):
    """``subprocess.TimeoutExpired`` after ``timeout`` seconds (main thread only: SIGALRM)."""
    if not timeout or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise _Expired()

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    except _Expired:
        raise subprocess.TimeoutExpired(argv, timeout) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def cli_inproc(*args, cwd=REPO, env_extra: dict | None = None, timeout: float | None = 120
               ) -> subprocess.CompletedProcess:
    """``graphgen ARGS`` by ``graphgen.cli.main`` in this process (the guarantees: the module doc)."""
    env_extra = {k: str(v) for k, v in (env_extra or {}).items()}
    fixed = sorted(set(env_extra) & set(_START_ONLY))
    if fixed:
        raise ValueError(f"{', '.join(fixed)} take effect only when an interpreter starts: "
                         f"run this command in a subprocess (support.cli.cli / run_cli)")
    from graphgen.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with _process_state(["graphgen", *argv], cwd, env_extra), _torch_state(), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _deadline(timeout, ["graphgen", *argv]):
        try:
            code = main(argv)
            code = 0 if code is None else code
        except SystemExit as e:
            code = _exit_code(e, err)
        except Exception:  # what the interpreter does with an uncaught exception
            traceback.print_exc(file=err)
            code = 1
    return subprocess.CompletedProcess(["graphgen", *argv], code, out.getvalue(), err.getvalue())


def run_tokens_inproc(spec, ckpt, prompts, n_new: int, *extra, timeout: float = 180) -> list[list[int]]:
    """`support.cli.run_tokens` in this process: the tokens ``graphgen run --json`` prints; asserts exit 0."""
    import json

    from .cli import run_args

    res = cli_inproc(*run_args(spec, ckpt, prompts, n_new, *extra), timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(s)["tokens"] for s in res.stdout.splitlines() if s.startswith("{")]
