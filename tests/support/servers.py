"""Real ``graphgen serve`` processes for the tests: ``python -m graphgen.serve`` (or ``python -m
graphgen serve``) on 127.0.0.1, port 0, one torch thread.

`ServerFactory` (the session fixture ``servers`` of tests/serve/conftest.py) starts one server per
distinct set of (checkpoint, spec, flags, environment, entry point) the first time a test asks for
it and keeps it: test modules that differ in nothing a server is started with share it. At most
``keep`` servers stay up (the least recently used is stopped, and started again if asked for later),
so a session of many one-module servers does not hold them all in memory. A test that needs a server of its own — it kills, drains, restarts it, or reads state no other
request may have touched — starts a `Server` directly and says why in one line. Every wait is
bounded; a server's stderr goes to a file (a pipe nobody reads would fill and block it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .paths import REPO

SPEC = REPO / "specs" / "tiny_qwen3.yaml"
STARTUP_S = 120
STOP_S = 60

__all__ = ["Server", "ServerFactory", "SPEC"]


class Server:
    def __init__(self, ckpt, *extra, trace=None, cli=False, spec=SPEC, env=None):
        """``cli``: start it as ``python -m graphgen serve`` (the CLI's subcommand) instead of
        ``python -m graphgen.serve`` (the module alone); the same code behind both."""
        entry = ["-m", "graphgen", "serve"] if cli else ["-m", "graphgen.serve"]
        args = [sys.executable, *entry, "--spec", str(spec), "--weights", str(ckpt),
                "--port", "0", "--torch-threads", "1", *map(str, extra)]
        if trace:
            args += ["--trace", str(trace)]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env or {}))
        self.log = tempfile.NamedTemporaryFile("w+", prefix="graphgen-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        deadline = time.monotonic() + STARTUP_S
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # the server prints one line once it accepts
            if "listening on" in line or self.proc.poll() is not None:
                break
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.stderr()}")
        self.base = line.strip().rsplit(" ", 1)[-1]
        self.port = int(self.base.rsplit(":", 1)[-1])

    def stderr(self, tail: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-tail:]

    def terminate(self, timeout=STOP_S) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def client(self, api_key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, timeout=60, max_retries=0)

    def greedy(self, prompts, max_tokens: int, model: str, timeout: float = 180) -> list[list[int]]:
        """The token ids of greedy completions of ``prompts``, sent concurrently (the server batches them)."""
        import concurrent.futures as cf

        c = self.client()

        def one(p):
            r = c.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0)
            return list(r.choices[0].model_extra["token_ids"])

        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(one, prompts, timeout=timeout))


class ServerFactory:
    """One server per distinct start (``keep`` at most up at once); every stop must exit 0."""

    def __init__(self, keep: int = 3):
        self.keep = keep
        self._servers: dict[tuple, Server] = {}  # least recently used first
        self.started = 0  # servers started (a restart after an eviction counts again)

    def get(self, ckpt, *flags, spec=SPEC, env=None, cli=False) -> Server:
        key = (str(ckpt), str(spec), tuple(map(str, flags)), tuple(sorted((env or {}).items())), cli)
        s = self._servers.pop(key, None)
        if s is None:
            while len(self._servers) >= self.keep:
                self._stop(self._servers.pop(next(iter(self._servers))))
            s = Server(ckpt, *flags, spec=spec, env=env, cli=cli)
            self.started += 1
        self._servers[key] = s
        assert s.proc.poll() is None, f"a shared server exited ({s.proc.returncode}): {s.stderr()}"
        return s

    @staticmethod
    def _stop(s: Server) -> None:
        rc = s.terminate()
        assert rc == 0, f"{s.proc.args[-8:]} exited {rc} on SIGTERM: {s.stderr()}"

    def close(self) -> None:
        servers, self._servers = list(self._servers.values()), {}
        errors = []
        for s in servers:
            try:
                self._stop(s)
            except AssertionError as e:
                errors.append(str(e))
        assert not errors, "\n".join(errors)
