"""Real Mooncake processes for the tests, all inside one private network namespace.

A sleeper process is started with ``unshare -n`` (after ``ip link set lo up``) and holds the
namespace; every master, segment holder and pool client is started with ``nsenter -t PID -n`` into
it, so whatever Mooncake binds (some listeners take 0.0.0.0) is reachable from loopback in that
namespace only, while the test itself stays outside and talks to the processes through pipes.
Every wait is bounded."""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

from .paths import REPO, TESTS, subprocess_env

ROOT = str(REPO)
WORKER = str(TESTS / "mooncake" / "worker.py")
ENGINE_WORKER = str(TESTS / "mooncake" / "engine_worker.py")
SERVER = "graphgen.runtime.pool.mooncake_server"


def _env():
    return subprocess_env()   # the repo and tests/ (``support``) first on PYTHONPATH


class _Proc:
    """A child with its stdout lines in a queue (read by a thread: waits can time out)."""

    def __init__(self, argv, *, stdin=False, log=None):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=log or subprocess.DEVNULL,
                                  text=True, env=_env(), start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {prefix!r} line from {self.p.args[-3:]} in {timeout} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.p.args[-3:]} exited ({self.p.wait()}) before {prefix!r}")
            if line.startswith(prefix):
                return line

    def kill(self, sig=signal.SIGKILL):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)   # its own session: the master child of `serve` too
            except ProcessLookupError:
                pass
        try:
            self.p.wait(5)
        except subprocess.TimeoutExpired:
            pass


class Worker(_Proc):
    def call(self, timeout: float = 20.0, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.result(timeout)

    def send(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def result(self, timeout: float = 20.0):
        return json.loads(self.wait_line("@@", timeout)[2:])


class Namespace:
    def __init__(self):
        for tool in ("unshare", "nsenter", "ip"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"the Mooncake tests need `{tool}` (util-linux / iproute2) and root "
                                   f"to run Mooncake in a private network namespace; it is missing")
        self.holder = _Proc(["unshare", "-n", "--", "sh", "-c",
                             "ip link set lo up && echo up && exec sleep 3600"])
        try:
            self.holder.wait_line("up", 10)
        except Exception as e:
            raise RuntimeError("could not create a private network namespace with `unshare -n` "
                               f"(needs root or CAP_SYS_ADMIN): {e}") from None
        self.procs: list[_Proc] = []
        self.logdir = None

    def argv(self, *args):
        return ["nsenter", "-t", str(self.holder.p.pid), "-n", "--", *args]

    def _log(self, name):
        return open(os.path.join(self.logdir, name + ".log"), "a") if self.logdir else None

    def server(self, cmd: str, *args, timeout: float = 15.0, name="server") -> tuple[_Proc, str]:
        p = _Proc(self.argv(sys.executable, "-m", SERVER, cmd, *args), log=self._log(name))
        self.procs.append(p)
        return p, p.wait_line("ready", timeout)

    def serve(self, port: int, segment: str = "64MiB", *extra):
        """master + segment holder; the `ready` line names the master's pid (killable alone)."""
        p, line = self.server("serve", "--port", str(port), "--segment", segment, *extra)
        fields = dict(f.split("=", 1) for f in line.split()[1:])
        return p, int(fields["pid"])

    def worker(self, master: str, name="worker", **opts) -> Worker:
        w = Worker(self.argv(sys.executable, WORKER), stdin=True, log=self._log(name))
        self.procs.append(w)
        assert w.call(op="open", master=master, opts=opts, timeout=30)["ok"]
        return w

    def engine(self, pool: str, name="engine", **opts) -> Worker:
        """An engine process on ``pool`` (a URL); ``opts``: spec, weights, write, granularity, faults."""
        w = Worker(self.argv(sys.executable, ENGINE_WORKER), stdin=True, log=self._log(name))
        self.procs.append(w)
        assert w.call(op="open", pool=pool, timeout=60, **opts)["ok"]
        return w

    def run(self, *args, timeout: float = 90.0) -> subprocess.CompletedProcess:
        """``graphgen ARGS`` (the CLI, as a user runs it) inside the namespace."""
        return subprocess.run(self.argv(sys.executable, "-m", "graphgen", *args), env=_env(),
                              capture_output=True, text=True, timeout=timeout)

    def close(self):
        for p in reversed(self.procs):
            p.kill()
        self.holder.kill()
