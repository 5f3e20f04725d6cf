"""Units under the server: the sampler, the checkpoint tokenizer, the trace recorder."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch

from graphgen.runtime.engine.sampling import Sampler, SamplingParams
from graphgen.runtime.engine.engine_core import EngineCore
from graphgen.serve.stops import find_stop, holdback
from graphgen.trace import TraceRecorder


def _logits(seed=0, n=256):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_temperature_zero_is_argmax():
    for seed in range(5):
        row = _logits(seed)
        assert Sampler(SamplingParams(temperature=0.0))(row) == int(torch.argmax(row))


def test_top_k_1_and_tiny_top_p_are_argmax_and_seed_is_reproducible():
    row = _logits(1)
    assert Sampler(SamplingParams(temperature=1.0, top_k=1, seed=3))(row) == int(torch.argmax(row))
    assert Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=3))(row) == int(torch.argmax(row))
    a, b = Sampler(SamplingParams(temperature=1.5, seed=42)), Sampler(SamplingParams(temperature=1.5, seed=42))
    assert [a(row) for _ in range(20)] == [b(row) for _ in range(20)]
    # high temperature over 256 flat-ish logits: 20 draws are not all one token (a seeded fact)
    s = Sampler(SamplingParams(temperature=2.0, seed=7))
    assert len({s(row) for _ in range(20)}) > 1


def test_top_k_restricts_to_the_k_best():
    row = _logits(2)
    best = set(torch.topk(row, 3).indices.tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=3, seed=0))
    assert {s(row) for _ in range(50)} <= best


@pytest.mark.parametrize("kw", [dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.2),
                                dict(top_k=-2), dict(max_tokens=1.5)])
def test_bad_sampling_params_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def _stop_ids(params, eos=()):
    """The stop tokens the engine gives a request (what `Scheduler.update` finishes it on)."""
    import types

    sched = types.SimpleNamespace(max_num_batched_tokens=64, add=lambda r, fork_of=None: None)
    llm = EngineCore(sched, types.SimpleNamespace(), vocab_size=16, eos_token_ids=eos)
    return llm.add_request(None, [1, 2], params).stop_token_ids


def test_stops():
    assert _stop_ids(SamplingParams(max_tokens=3, stop_token_ids=(9,)), eos=(0,)) == {9, 0}
    assert find_stop("abc STOP def", ["STOP", "def"]) == 4 and find_stop("abc", ["x"]) == -1
    assert holdback("abc ST", ["STOP"]) == 2 and holdback("abc", ["STOP"]) == 0
    assert holdback("ab\ufffd", []) == 1


@pytest.mark.parametrize("vocab", [256, 700])
def test_tokenizer_has_exactly_the_vocab_and_is_deterministic(tmp_path, vocab):
    from transformers import AutoTokenizer

    from graphgen.runtime.checkpoint.tokenizer import write_tokenizer

    p1 = write_tokenizer(tmp_path / "a", vocab)
    p2 = write_tokenizer(tmp_path / "b", vocab)
    digest = [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in (p1, p2)]
    assert digest[0] == digest[1]
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert len(tok) == vocab
    text = "Prefix caching: héllo wörld — 1234 {json}"
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < vocab and tok.decode(ids) == text
    if vocab > 256:  # real merges learned from the docs: fewer tokens than bytes
        assert len(ids) < len(text.encode())
        assert tok.eos_token == "<|endoftext|>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "hi" in chat and "assistant" in chat
    assert write_tokenizer(tmp_path / "c", 255) is None  # no byte-level tokenizer fits


def test_trace_recorder_writes_chrome_json_from_many_threads(tmp_path):
    path = tmp_path / "t.json"
    tr = TraceRecorder(str(path))

    def work(i):
        for j in range(20):
            with tr.span("forward" if i % 2 else "save", f"op{j}", i=i):
                pass

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    tr.begin("host", "commit")
    tr.end("host", "commit")
    tr.instant("scheduler", "tick")
    assert tr.close() == str(path)
    doc = json.loads(path.read_text())
    ev = doc["traceEvents"]
    names = {e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert {"scheduler", "forward", "save", "host", "server"} <= names
    assert sum(1 for e in ev if e["ph"] == "X") == 80
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in ev if e["ph"] == "X")
    assert [e["ph"] for e in ev if e["name"] == "commit"] == ["B", "E"]
    tr.complete("forward", "late", 0.0, 1.0)  # after close: ignored, file unchanged
    assert json.loads(path.read_text()) == doc


def test_render_trace_draws_one_lane_per_track(tmp_path):
    """scripts/render_trace.py on a small recorded trace: a PNG comes out, and the lanes it would draw
    are exactly the tracks that have spans, in the recorder's order."""
    import importlib.util
    from pathlib import Path

    import matplotlib  # noqa: F401  (an extra ./dev installs: a missing one fails, never skips)
    path = Path(__file__).resolve().parents[2] / "scripts" / "render_trace.py"
    spec = importlib.util.spec_from_file_location("render_trace", path)
    rt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rt)
    rec = TraceRecorder(str(tmp_path / "t.json"))
    rec.complete("forward", "forward:decode", 1.0, 1.010)
    rec.complete("save", "kv_save", 1.002, 1.006)
    rec.complete("host", "commit", 1.011, 1.012)
    rec.close()
    doc = json.loads((tmp_path / "t.json").read_text())
    tracks, spans = rt.load_spans(doc)
    assert tracks == ["forward", "save", "host"] and len(spans) == 3
    out = tmp_path / "t.png"
    rt.render(doc, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ignore_eos_drops_only_the_eos_stop():
    assert _stop_ids(SamplingParams(max_tokens=9), eos=(7, 8)) == {7, 8}      # a list of EOS ids
    assert _stop_ids(SamplingParams(max_tokens=9, ignore_eos=True), eos=(7,)) == set()
    assert _stop_ids(SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=(7,)), eos=(7,)) == {7}
