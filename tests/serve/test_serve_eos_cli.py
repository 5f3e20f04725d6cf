"""EOS and the CLI's checks. ``graphgen run`` and ``graphgen serve`` stop at the checkpoint's EOS ids
(``generation_config.json`` over ``config.json``, a list allowed, the tokenizer's EOS added) unless
``--ignore-eos`` / ``ignore_eos``; ``run --json`` has ``finish_reason``; ``run --prompt TEXT`` is
the checkpoint tokenizer's ids. The serve CLI refuses bad arguments (exit 2, no traceback) before
the model loads — a busy port included — and ``--help`` shows the defaults."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from serve_util import SPEC
from support.inproc import cli_inproc

PROMPT = [9, 8, 7, 6, 5, 4, 3, 2]
N = 10


def _graphgen(*args, timeout=180) -> subprocess.CompletedProcess:
    """``graphgen ARGS`` in this interpreter (the entry points' own subprocesses: test_serve_run_parity.py)."""
    return cli_inproc(*args, timeout=timeout)


def _run_json(ckpt, *extra) -> list[dict]:
    res = _graphgen("run", "--spec", str(SPEC), "--weights", str(ckpt), "--json", "--max-new-tokens", str(N),
                    *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(s) for s in res.stdout.splitlines() if s.startswith("{")]


@pytest.fixture(scope="module")
def plain(ckpt):
    """The prompt's greedy tokens on the session checkpoint (whose EOS, 188, it never produces)."""
    (r,) = _run_json(ckpt, "--prompt-ids", ",".join(map(str, PROMPT)))
    assert r["finish_reason"] == "length" and len(r["tokens"]) == N and 188 not in r["tokens"]
    return r["tokens"]


@pytest.fixture(scope="module")
def eos_ckpt(ckpt, plain, tmp_path_factory):
    """The same weights with a generation_config.json whose EOS list holds the prompt's 4th token."""
    d = tmp_path_factory.mktemp("eos_ckpt")
    for f in os.listdir(ckpt):
        shutil.copy(ckpt / f, d / f)
    eos = plain[3]
    assert eos not in plain[:3]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [255 if eos != 255 else 254, eos]}))
    return d


def test_eos_token_ids_reads_generation_config_over_config_and_adds_the_tokenizers(ckpt, eos_ckpt, tmp_path):
    from graphgen.runtime.checkpoint.generation import eos_token_ids
    from graphgen.runtime.checkpoint.tokenizer import eos_token

    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["eos_token_id"] == eos_token(256)[1] == 188  # random checkpoints: a real id, their tokenizer's
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(ckpt)).eos_token_id == 188
    assert eos_token_ids(ckpt) == [188]
    gen = json.loads((eos_ckpt / "generation_config.json").read_text())["eos_token_id"]
    assert eos_token_ids(eos_ckpt) == gen + [188]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(tmp_path) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2, 1]}))
    assert eos_token_ids(tmp_path) == [1, 2]
    assert eos_token_ids(tmp_path / "missing") == []


def test_run_stops_at_the_checkpoints_eos_unless_ignore_eos(eos_ckpt, plain):
    ids = ",".join(map(str, PROMPT))
    (r,) = _run_json(eos_ckpt, "--prompt-ids", ids)
    assert r["tokens"] == plain[:4] and r["finish_reason"] == "stop"  # the EOS is kept, then it stops
    (r,) = _run_json(eos_ckpt, "--prompt-ids", ids, "--ignore-eos")
    assert r["tokens"] == plain and r["finish_reason"] == "length"


def test_run_prompt_text_is_the_tokenizers_ids(ckpt):
    from transformers import AutoTokenizer

    text = "The engine hashes each block."
    ids = AutoTokenizer.from_pretrained(str(ckpt)).encode(text, add_special_tokens=False)
    a, b = _run_json(ckpt, "--prompt", text, "--prompt-ids", ",".join(map(str, ids)))
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) == N


def test_serve_stops_at_the_checkpoints_eos_unless_ignore_eos(servers, eos_ckpt, plain):
    c = servers.get(eos_ckpt, "--write", "off", "--num-blocks", "64").client()  # (exit 0: the factory's)
    r = c.completions.create(model="tiny_qwen3", prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].model_extra["token_ids"] == plain[:4] and r.choices[0].finish_reason == "stop"
    r = c.completions.create(model="tiny_qwen3", prompt=PROMPT, max_tokens=N, temperature=0,
                             extra_body={"ignore_eos": True})
    assert r.choices[0].model_extra["token_ids"] == plain and r.choices[0].finish_reason == "length"


# ---- the CLI refuses bad arguments before loading the model ---------------------------------

def _serve(*args, timeout=120) -> subprocess.CompletedProcess:
    """``graphgen serve`` in this interpreter (every shared server is ``python -m graphgen.serve``)."""
    return cli_inproc("serve", "--spec", SPEC, *args, timeout=timeout)


@pytest.mark.parametrize("args,msg", [
    (["--num-blocks", "0"], "--num-blocks 0: one request needs at least 1 block"),
    (["--num-blocks", "-5"], "--num-blocks -5"),
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--pool-min-uses", "0"], "--pool-min-uses must be >= 1, got 0"),
    (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
])
def test_bad_serve_arguments_exit_2_without_a_traceback(ckpt, args, msg):
    res = _serve("--weights", str(ckpt), *args)
    assert res.returncode == 2, res.stderr[-2000:]
    assert msg in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


def test_a_busy_port_is_found_before_the_model_loads(ckpt, tmp_path):
    broken = tmp_path / "broken"  # config.json and a tokenizer, but weights that cannot load
    shutil.copytree(ckpt, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _serve("--weights", str(broken), "--port", str(port))
    assert res.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in res.stderr, res.stderr[-2000:]
    assert "safetensors" not in res.stderr.lower()
    # negative control: on a free port the same folder gets as far as loading the weights, and fails there
    res = _serve("--weights", str(broken), "--port", "0")
    assert res.returncode != 0 and "listening on" not in res.stdout
    assert "cannot listen" not in res.stderr


def test_help_shows_the_defaults():
    res = _serve("--help")
    assert res.returncode == 0
    out = " ".join(res.stdout.split())
    for want in ("--port PORT 0 = a free port (printed on stdout) (default: 8000)", "(default: 8388608)",
                 "(default: 127.0.0.1)", "(default: warning)", "(default: 512)", "--api-key KEY",
                 "GRAPHGEN_API_KEY", "--ignore-eos"):
        assert want in out, want


def test_checkpoint_refuses_a_folder_it_did_not_write(tmp_path):
    """``graphgen checkpoint`` (README's quickstart writes one end to end: test_readme_quickstart.py)
    rewrites a folder holding only what it writes (the quickstart run twice) but refuses one holding
    other files, in one sentence (exit 2), unless --force — before anything is loaded or written."""
    out = tmp_path / "ck"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    res = cli_inproc("checkpoint", "--spec", SPEC, "--out", out)
    assert res.returncode == 2 and "notes.txt" in res.stderr and "--force" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]  # nothing written
    res = cli_inproc("checkpoint", "--spec", SPEC, "--out", out / "config.json")
    assert res.returncode == 2 and "not a folder" in res.stderr
