"""Safety of ``graphgen serve`` (issue 16, item 5), against one real server with API keys and a 1 MiB
body limit: every ``/v1/*`` route needs a key (``/health`` and ``/metrics`` do not), a body over the
limit is a 413 decided from its headers (the body is never read), parsing and tokenization run off
the event loop (a parse held open by a test gate while ``/health`` and another request are
answered), every bad value is a 400 naming the field, and a seeded fuzz of bad bodies never gets a
5xx nor changes a concurrent good request's tokens."""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import socket
import threading
import time

import pytest

import http_util as h

KEY, KEY2 = "sk-test-one", "sk-test-two"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 1 << 20
GOOD = {"prompt": [7, 3, 99, 120, 5], "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    return tmp_path_factory.mktemp("gate") / "release"


@pytest.fixture
def server(servers, ckpt, gate):
    return servers.get(ckpt, "--write", "off", "--num-blocks", "256", "--api-key", KEY, "--api-key", KEY2,
                       "--max-request-bytes", str(LIMIT), env={"GRAPHGEN_SERVE_PARSE_GATE": str(gate)})


def _post(server, body, path="/v1/completions", **kw):
    return h.post(server.base, path, body, headers=AUTH, **kw)


def _post_any(server, path, body, timeout=60):
    """(status, JSON body or None): a fuzzed body may be a valid streaming request (SSE, not JSON)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={**AUTH, "Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, None
    finally:
        conn.close()


# ---- API keys ---------------------------------------------------------------------------------

def test_every_v1_route_needs_a_key_health_and_metrics_do_not(server):
    import openai

    want = {"error": {"message": "Incorrect API key provided: send 'Authorization: Bearer <key>'",
                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Bearer "}):
        assert h.post(server.base, "/v1/completions", GOOD, headers=headers) == (401, want)
        assert h.post(server.base, "/v1/chat/completions", {"messages": []}, headers=headers) == (401, want)
        status, text = h.get(server.base, "/v1/models", headers=headers)
        assert (status, json.loads(text)) == (401, want)
    assert h.get(server.base, "/health")[0] == 200
    assert h.get(server.base, "/metrics")[0] == 200
    # the official client: the right key (either one) works, a wrong one is an AuthenticationError
    for key in (KEY, KEY2):
        r = server.client(key).completions.create(model="tiny_qwen3", **GOOD)
        assert len(r.choices[0].model_extra["token_ids"]) == 24
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-wrong").models.list()


# ---- sizes and the event loop -----------------------------------------------------------------

def _raw_headers_only(server, length: int) -> tuple[int, dict]:
    """Announce a ``length``-byte body and send none of it: the answer must come from the headers."""
    port = server.port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                      f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {length}\r\n\r\n").encode())
        data = b""
        while True:  # the 413 says "connection: close": read to the end
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_a_10mb_body_is_a_413_from_its_headers_and_health_answers(server):
    status, body = _raw_headers_only(server, 10 * 1000 * 1000)  # the body is never sent
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert "--max-request-bytes" in body["error"]["message"]
    assert h.get(server.base, "/health")[0] == 200
    # negative control: a body under the limit is read and parsed (a 400 for its content, not a 413)
    status, body = _post(server, b'{"prompt": []}')
    assert status == 400 and body["error"]["param"] == "prompt"


def test_a_chunked_body_over_the_limit_is_a_413(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    piece = b" " * 65536

    def chunks():  # no Content-Length: counted as it streams in
        yield b'{"prompt": "'
        for _ in range(LIMIT // len(piece) + 2):
            yield piece
        yield b'"}'

    try:
        conn.request("POST", "/v1/completions", body=chunks(), headers={**AUTH, "Content-Type": "application/json"},
                     encode_chunked=True)
        r = conn.getresponse()
        status, body = r.status, json.loads(r.read())
    finally:
        conn.close()
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert h.get(server.base, "/health")[0] == 200


def test_health_and_other_requests_are_answered_while_a_large_prompt_is_parsed(server, gate):
    """The gate holds the parse (and the tokenization after it) of one request on its worker thread;
    /health and a completion are answered meanwhile — they could not be if parsing ran on the event
    loop. Released, the large prompt is tokenized and refused for its length."""
    entered = gate.parent / (gate.name + ".entered")
    big = {"user": "parse-gate", "prompt": "graphgen " * 100_000, "max_tokens": 4}  # ~900 KB of text
    result = {}

    def send():
        result["r"] = _post(server, big, timeout=120)

    t = threading.Thread(target=send)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while not entered.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert entered.exists(), "the parse gate was never reached"
        assert h.get(server.base, "/health", timeout=30)[0] == 200
        status, body = _post(server, GOOD, timeout=60)
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 24
        assert "r" not in result  # the gated request is still being parsed
    finally:
        gate.touch()
        t.join(120)
    status, body = result["r"]
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body


# ---- bad values -----------------------------------------------------------------------------

BAD = [  # (what, raw body, param or code)
    ("temperature that underflows", b'{"prompt": [1], "temperature": 1e-300}', "temperature"),
    ("temperature overflowing a float", b'{"prompt": [1], "temperature": 1e400}', "temperature"),
    ("temperature a huge int", b'{"prompt": [1], "temperature": 1' + b"0" * 400 + b"}", "temperature"),
    ("temperature NaN", b'{"prompt": [1], "temperature": NaN}', "temperature"),
    ("top_p Infinity", b'{"prompt": [1], "top_p": Infinity}', "top_p"),
    ("seed 2**64", json.dumps({"prompt": [1], "temperature": 1, "seed": 2 ** 64}).encode(), "seed"),
    ("seed below int64", json.dumps({"prompt": [1], "temperature": 1, "seed": -2 ** 63 - 1}).encode(), "seed"),
    ("max_tokens huge", json.dumps({"prompt": [1], "max_tokens": 10 ** 300}).encode(), "max_tokens"),
    ("a number too long to parse", b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),
    ("lone surrogate in the prompt", b'{"prompt": "abc\\ud800def"}', "prompt"),
    ("lone surrogate in a prompt list", b'{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
    ("lone surrogate in the model", b'{"model": "\\ud800", "prompt": [1]}', "model"),
    ("lone surrogate in a stop string", b'{"prompt": [1], "stop": ["\\ud800"]}', "stop[0]"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', "invalid_json"),
    ("nested 1000 deep", b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", "invalid_json"),
    ("nested 100000 deep, unbalanced", b'{"prompt": ' + b"[" * 100000, "invalid_json"),
    ("stop_token_ids out of the vocab", b'{"prompt": [1], "stop_token_ids": [1000000]}', "stop_token_ids"),
]


@pytest.mark.parametrize("what,raw,param", BAD, ids=[b[0] for b in BAD])
def test_bad_value_is_a_400_naming_the_field(server, what, raw, param):
    status, resp = _post(server, raw)
    assert status == 400, resp
    err = resp["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert param in (err["param"], err["code"]), err


def test_lone_surrogate_in_a_chat_message_is_a_400(server):
    status, resp = _post(server, b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}',
                         path="/v1/chat/completions")
    assert status == 400 and resp["error"]["param"] == "messages[0].content", resp
    # negative control: a surrogate *pair* is one valid character
    status, resp = _post(server, b'{"messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}], '
                                 b'"max_tokens": 2}', path="/v1/chat/completions")
    assert status == 200, resp


def test_a_tiny_temperature_is_refused_and_greedy_zero_still_works(server):
    assert _post(server, {"prompt": [1, 2], "temperature": 1e-6, "max_tokens": 2})[0] == 400
    assert _post(server, {"prompt": [1, 2], "temperature": 1e-5, "max_tokens": 2, "seed": 1})[0] == 200
    assert _post(server, {"prompt": [1, 2], "temperature": 0, "max_tokens": 2})[0] == 200


# ---- fuzz -----------------------------------------------------------------------------------

FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
          "ignore_eos", "n", "model", "stream_options", "messages", "presence_penalty", "logit_bias",
          "logprobs", "top_logprobs", "echo", "best_of", "min_tokens", "repetition_penalty", "frequency_penalty",
          "bad_words", "allowed_token_ids")
BAD_VALUES = [None, True, False, -1, 0, 1.5, -1e308, 2 ** 63, 2 ** 64, 10 ** 200, "", "x", "\u0000", "\ud800",
              "é" * 300, [], [None], [[[]]], ["a"] * 50, [-1], [2 ** 70], {}, {"a": {"b": []}}, [1.0, 2.0],
              "1e-300", [[1, 2], "a"], {"include_usage": "yes"}]
RAW_SNIPPETS = [b"NaN", b"Infinity", b"-Infinity", b"1e-400", b"1e400", b"-0.0", b"0" * 30, b'"\\ud800"',
                b'"\\udc00\\ud800"', b"[" * 70 + b"]" * 70, b'"' + b"a" * 4096 + b'"', b"1" * 4400]


def _fuzz_bodies(seed: int, n: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        path = "/v1/chat/completions" if rng.random() < 0.3 else "/v1/completions"
        base = ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if "chat" in path
                else {"prompt": [1, 2, 3], "max_tokens": 2})
        kind = rng.random()
        if kind < 0.6:  # one field, a bad value
            body = json.dumps(dict(base, **{rng.choice(FIELDS): rng.choice(BAD_VALUES)})).encode()
        elif kind < 0.85:  # one field, a raw JSON value json.dumps would not write
            doc = json.dumps(dict(base, **{rng.choice(FIELDS): "@@"})).encode()
            body = doc.replace(b'"@@"', rng.choice(RAW_SNIPPETS))
        else:  # broken bytes: a truncated or corrupted valid body
            doc = bytearray(json.dumps(base).encode())
            if rng.random() < 0.5:
                doc = doc[:rng.randrange(len(doc))]
            else:
                doc[rng.randrange(len(doc))] = rng.randrange(256)
            body = bytes(doc)
        out.append((path, body))
    return out


def test_fuzz_of_bad_bodies_never_a_5xx_and_a_concurrent_request_is_unchanged(server):
    alone = _post(server, GOOD)[1]["choices"][0]["token_ids"]
    bodies = _fuzz_bodies(seed=16, n=160)
    statuses = []
    with cf.ThreadPoolExecutor(4) as ex:
        good = ex.submit(_post, server, dict(GOOD, max_tokens=24))
        for status, resp in ex.map(lambda pb: _post_any(server, *pb), bodies, timeout=300):
            statuses.append(status)
            assert status < 500, resp
            if status != 200:
                assert resp["error"]["type"] == "invalid_request_error" and resp["error"]["message"]
        status, resp = good.result(timeout=120)
    assert status == 200 and resp["choices"][0]["token_ids"] == alone
    assert statuses.count(400) > len(bodies) // 2, statuses  # the fuzz does send mostly bad bodies
    assert h.get(server.base, "/health")[0] == 200
