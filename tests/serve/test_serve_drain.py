"""SIGTERM with a stream that outlives ``--drain-timeout``: during the drain the socket still answers —
``/health`` is 503 (not connection-refused) and a new request is a 503 — and the stream that must be
cut ends with an error event, then ``data: [DONE]``; the process exits 0. The signal is sent once
the stream's first token has arrived (a gate, not a sleep); the stream asks for far more tokens than
the drain allows (every step is slowed by ``forward_delay``)."""

from __future__ import annotations

import json
import signal
import time

import http_util as h
from serve_util import Server


def test_drain_answers_503_and_cuts_a_stream_with_an_error_event_and_done(ckpt):
    # private: it is drained
    s = Server(ckpt, "--write", "off", "--num-blocks", "256", "--drain-timeout", "3",
               "--faults", "forward_delay=0.01")
    try:
        conn, resp = h.open_stream(s.base, {"prompt": [1, 2, 3], "max_tokens": 1000, "temperature": 0,
                                            "ignore_eos": True}, timeout=120)
        first = resp.readline()  # the gate: the first token is out, the request is running
        assert first.startswith(b"data: {"), first
        s.proc.send_signal(signal.SIGTERM)
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = h.get(s.base, "/health", timeout=30)[0]  # OSError here = refused: the bug
            seen.append(status)
            if status != 200:
                break
            time.sleep(0.02)
        assert seen[-1] == 503, seen
        status, body = h.post(s.base, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1}, timeout=30)
        assert status == 503 and body["error"]["type"] == "server_error", body
        rest = resp.read().decode()
        conn.close()
        lines = [ln for ln in (first.decode() + rest).splitlines() if ln.strip()]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        err = json.loads(lines[-2][len("data: "):])
        assert err["error"]["type"] == "server_error" and "shutting down" in err["error"]["message"], err
        tokens = [t for ln in lines[:-2] for t in json.loads(ln[len("data: "):])["choices"][0]["token_ids"]]
        assert 0 < len(tokens) < 1000
        assert s.proc.wait(60) == 0, s.stderr()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
