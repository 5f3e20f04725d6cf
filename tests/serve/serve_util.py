"""Shared helpers of the serve tests: paths, bounds and a real ``graphgen serve`` subprocess.
(A plain module, not conftest: test modules import it by its unique name.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "tiny_qwen3.yaml"
STARTUP_S = 120
STOP_S = 60


class Server:
    def __init__(self, ckpt, *extra, trace=None, cli=False, spec=SPEC, env=None):
        """``cli``: start it as ``python -m graphgen serve`` (the CLI's subcommand) instead of
        ``python -m graphgen.serve`` (the module alone); the same code behind both."""
        entry = ["-m", "graphgen", "serve"] if cli else ["-m", "graphgen.serve"]
        args = [sys.executable, *entry, "--spec", str(spec), "--weights", str(ckpt),
                "--port", "0", "--torch-threads", "1", *extra]
        if trace:
            args += ["--trace", str(trace)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.monotonic() + STARTUP_S
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # the server prints one line once it accepts
            if "listening on" in line or self.proc.poll() is not None:
                break
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()[-3000:]}")
        self.base = line.strip().rsplit(" ", 1)[-1]
        self.port = int(self.base.rsplit(":", 1)[-1])

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
