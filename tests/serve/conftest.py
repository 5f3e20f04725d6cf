"""A real server on 127.0.0.1: ``python -m graphgen.serve`` as a subprocess on a free port, on a tiny
random Qwen3 checkpoint written with its tokenizer. Every wait is bounded."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "specs" / "tiny_qwen3.yaml"
STARTUP_S = 120
STOP_S = 60


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.weights import write_random_hf_checkpoint

    spec = load_spec(SPEC)
    d = tmp_path_factory.mktemp("serve_ckpt")
    write_random_hf_checkpoint(str(d), spec.family, dataclasses.asdict(spec.dims), seed=0)
    assert (d / "tokenizer.json").exists()
    return d


class Server:
    def __init__(self, ckpt, *extra, trace=None, cli=False):
        """``cli``: start it as ``python -m graphgen serve`` (the CLI's subcommand) instead of
        ``python -m graphgen.serve`` (the module alone); the same code behind both."""
        entry = ["-m", "graphgen", "serve"] if cli else ["-m", "graphgen.serve"]
        args = [sys.executable, *entry, "--spec", str(SPEC), "--weights", str(ckpt),
                "--port", "0", "--torch-threads", "1", *extra]
        if trace:
            args += ["--trace", str(trace)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
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

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def server(ckpt):
    """write: sync, so a repeated prompt deterministically hits what the first one saved."""
    s = Server(ckpt, "--write", "sync", "--num-blocks", "256")
    yield s
    rc = s.terminate()
    assert rc == 0, s.proc.stderr.read()[-3000:]
