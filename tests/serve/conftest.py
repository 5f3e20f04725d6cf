"""A real server on 127.0.0.1: ``python -m graphgen.serve`` as a subprocess on a free port, on a tiny
random Qwen3 checkpoint written with its tokenizer. Every wait is bounded."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("openai")

from serve_util import SPEC, Server  # noqa: E402


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.hf import write_random_hf_checkpoint

    spec = load_spec(SPEC)
    d = tmp_path_factory.mktemp("serve_ckpt")
    write_random_hf_checkpoint(str(d), spec.family, dataclasses.asdict(spec.dims), seed=0)
    assert (d / "tokenizer.json").exists()
    return d


@pytest.fixture(scope="module")
def server(ckpt):
    """write: sync, so a repeated prompt deterministically hits what the first one saved."""
    s = Server(ckpt, "--write", "sync", "--num-blocks", "256")
    yield s
    rc = s.terminate()
    assert rc == 0, s.proc.stderr.read()[-3000:]
