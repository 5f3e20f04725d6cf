"""The OpenAI-compatible server, end to end: a real server process on 127.0.0.1 answering the
official ``openai`` client and plain HTTP. Tokens are compared with ``Engine.generate`` run in this
process on the same checkpoint (the server's engine is another instance: equal tokens show the
serving path adds nothing to, and loses nothing of, the engine's greedy decode)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

import http_util as h
from serve_util import SPEC

BS = 4  # tiny_qwen3's block_size


@pytest.fixture(scope="module")
def engine(ckpt):
    import torch

    from graphgen.runtime import Engine, open_engine

    torch.set_num_threads(1)
    with open_engine(SPEC, ckpt, write="off") as eng:
        yield eng


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


def _ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_models_and_health(server):
    assert h.get(server.base, "/health")[0] == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny_qwen3"]


def test_greedy_tokens_equal_engine_generate(server, engine):
    prompt = [5, 17, 33, 2, 9, 100, 41]
    want = engine.generate([prompt], max_new_tokens=8)[0].tokens
    r = server.client().completions.create(model="tiny_qwen3", prompt=prompt, max_tokens=8, temperature=0)
    assert _ids(r.choices[0]) == want
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 8)


def test_streaming_equals_non_streaming_and_ends_with_done(server):
    body = {"prompt": [3, 1, 4, 1, 5, 9, 2, 6], "max_tokens": 6, "temperature": 0}
    status, full = h.post(server.base, "/v1/completions", body)
    assert status == 200
    got = []
    stream = server.client().completions.create(model="tiny_qwen3", stream=True, **body)
    for chunk in stream:
        for c in chunk.choices:
            got.extend(c.model_extra["token_ids"])
    assert got == full["choices"][0]["token_ids"]
    conn, resp = h.open_stream(server.base, body)  # the raw SSE: data lines, last one [DONE]
    try:
        lines = [ln.strip() for ln in resp.read().decode().splitlines() if ln.strip()]
    finally:
        conn.close()
    assert resp.getheader("content-type").startswith("text/event-stream")
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert len(lines) == 6 + 1  # one chunk per token, then [DONE]


def test_text_prompt_goes_through_the_tokenizer(server, engine, tokenizer):
    text = "The engine hashes each full block of the prompt."
    ids = tokenizer.encode(text, add_special_tokens=False)
    r = server.client().completions.create(model="tiny_qwen3", prompt=text, max_tokens=5, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert _ids(r.choices[0]) == engine.generate([ids], max_new_tokens=5)[0].tokens
    assert r.choices[0].text == tokenizer.decode(_ids(r.choices[0]))


def test_list_of_prompts_gives_one_choice_each(server, engine):
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    r = server.client().completions.create(model="tiny_qwen3", prompt=prompts, max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [_ids(c) for c in r.choices] == [x.tokens for x in engine.generate(prompts, max_new_tokens=3)]


def test_chat_completion_uses_the_chat_template(server, engine, tokenizer):
    msgs = [{"role": "user", "content": "hi there"}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                           add_special_tokens=False)
    r = server.client().chat.completions.create(model="tiny_qwen3", messages=msgs, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    assert _ids(r.choices[0]) == engine.generate([ids], max_new_tokens=4)[0].tokens
    assert r.choices[0].message.role == "assistant"
    parts = [c.choices[0].delta.content or "" for c in server.client().chat.completions.create(
        model="tiny_qwen3", messages=msgs, max_tokens=4, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == r.choices[0].message.content


def test_repeated_prompt_hits_the_pool(server):
    prompt = [50 + i for i in range(4 * BS + 1)]  # 4 full blocks + 1 token, unseen so far
    before = h.metric(server.base, "graphgen_prefix_cache_hit_tokens_total")
    c = server.client()
    first = c.completions.create(model="tiny_qwen3", prompt=prompt, max_tokens=2, temperature=0)
    again = c.completions.create(model="tiny_qwen3", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 4 * BS  # write sync: committed before reply
    assert _ids(again.choices[0]) == _ids(first.choices[0])
    assert h.metric(server.base, "graphgen_prefix_cache_hit_tokens_total") == before + 4 * BS


def test_seeded_sampling_is_reproducible(server):
    c = server.client()
    kw = dict(model="tiny_qwen3", prompt=[9, 8, 7], max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    a, b = (_ids(c.completions.create(**kw).choices[0]) for _ in range(2))
    assert a == b and len(a) == 8


def test_stop_string_cuts_the_text(server, tokenizer):
    c = server.client()
    full = c.completions.create(model="tiny_qwen3", prompt="hello", max_tokens=12, temperature=0).choices[0]
    text = full.text
    stop = next((ch for ch in text[1:] if ch.isascii() and ch.isprintable()), None)
    if stop is None:
        pytest.skip("the random model produced no printable ASCII character to stop at")
    cut = c.completions.create(model="tiny_qwen3", prompt="hello", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.find(stop)]


BAD = [
    ("malformed JSON", b'{"prompt": [1, 2', "invalid_json"),
    ("body not an object", b"[1, 2, 3]", "invalid_json"),
    ("prompt of wrong type", {"prompt": 5}, "prompt"),
    ("prompt list of floats", {"prompt": [1.5, 2]}, "prompt"),
    ("max_tokens a string", {"prompt": [1], "max_tokens": "5"}, "max_tokens"),
    ("temperature a string", {"prompt": [1], "temperature": "hot"}, "temperature"),
    ("stream not a bool", {"prompt": [1], "stream": "yes"}, "stream"),
    ("token id too large", {"prompt": [1, 256]}, "prompt"),
    ("negative token id", {"prompt": [-1, 2]}, "prompt"),
    ("empty prompt", {"prompt": []}, "prompt"),
    ("over-long prompt", {"prompt": [1] * 1020, "max_tokens": 8}, "prompt"),
    ("max_tokens zero", {"prompt": [1], "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"prompt": [1], "max_tokens": -3}, "max_tokens"),
    ("n zero", {"prompt": [1], "n": 0}, "n"),
    ("n too large", {"prompt": [1], "n": 129}, "n"),
    ("best_of below n", {"prompt": [1], "n": 3, "best_of": 2}, "best_of"),
    ("logprobs over --max-logprobs", {"prompt": [1], "logprobs": 21}, "logprobs"),
    ("echo not a bool", {"prompt": [1], "echo": "yes"}, "echo"),
    ("suffix", {"prompt": [1], "suffix": "x"}, "suffix"),
    ("logit_bias id out of range", {"prompt": [1], "logit_bias": {"256": 1}}, "logit_bias"),
    ("logit_bias too large", {"prompt": [1], "logit_bias": {"3": 101}}, "logit_bias"),
    ("presence_penalty out of range", {"prompt": [1], "presence_penalty": 2.5}, "presence_penalty"),
    ("repetition_penalty zero", {"prompt": [1], "repetition_penalty": 0}, "repetition_penalty"),
    ("min_tokens over max_tokens", {"prompt": [1], "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("top_p out of range", {"prompt": [1], "top_p": 1.5}, "top_p"),
    ("negative temperature", {"prompt": [1], "temperature": -1}, "temperature"),
    ("too many stops", {"prompt": [1], "stop": ["a"] * 1025}, "stop"),
]


@pytest.mark.parametrize("what,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_request_is_a_400_with_an_openai_error(server, what, body, param):
    status, resp = h.post(server.base, "/v1/completions", body)
    assert status == 400, resp
    err = resp["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]
    assert param in (err["param"], err["code"])
    assert h.get(server.base, "/health")[0] == 200  # and the server keeps serving


def test_bad_chat_messages_are_400(server):
    for body in ({"messages": "hi"}, {"messages": []}, {"messages": [{"role": "user"}]},
                 {"messages": [{"role": "wizard", "content": "x"}]}):
        status, resp = h.post(server.base, "/v1/chat/completions", body)
        assert status == 400 and resp["error"]["type"] == "invalid_request_error", (body, resp)


def test_openai_client_raises_bad_request(server):
    import openai

    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="tiny_qwen3", prompt=[1], max_tokens=0)


def test_unknown_extra_fields_are_ignored(server):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "frobnicate": {"x": 1}, "user": "u1"}
    status, resp = h.post(server.base, "/v1/completions", body)
    assert status == 200 and len(resp["choices"][0]["token_ids"]) == 2


def test_metrics_parse_with_prometheus_parser(server):
    server.client().completions.create(model="tiny_qwen3", prompt=[4, 4, 4, 4, 4], max_tokens=3, temperature=0)
    m = h.metrics(server.base)
    names = {n for n, _ in m}
    for want in ("graphgen_time_to_first_token_seconds_count", "graphgen_inter_token_latency_seconds_count",
                 "graphgen_num_requests_running", "graphgen_num_requests_waiting",
                 "graphgen_prefix_cache_hit_tokens_total", "graphgen_kv_saves_pending",
                 "graphgen_kv_save_latency_seconds_count", "graphgen_kv_commit_latency_seconds_count",
                 "graphgen_pool_put_failures_total", "graphgen_pool_errors_total"):
        assert want in names, want
    assert m[("graphgen_time_to_first_token_seconds_count", frozenset())] >= 1
    assert m[("graphgen_inter_token_latency_seconds_count", frozenset())] >= 2
    assert m[("graphgen_kv_commit_latency_seconds_count", frozenset())] >= 1  # write sync: a save per prefill
    assert m[("graphgen_num_requests_running", frozenset())] == 0


def _wait_metric(base, name, pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = h.metric(base, name)
        if pred(v):
            return v
        time.sleep(0.05)
    raise AssertionError(f"{name} = {h.metric(base, name)} after {timeout}s")


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    _wait_metric(server.base, "graphgen_num_requests_running", lambda v: v == 0)
    free_before = h.metric(server.base, "graphgen_kv_blocks_free")
    aborted = h.metric(server.base, "graphgen_requests_total", finish_reason="abort") if (
        ("graphgen_requests_total", frozenset({("finish_reason", "abort")})) in h.metrics(server.base)) else 0
    conn, resp = h.open_stream(server.base, {"prompt": [11, 12, 13, 14, 15, 16], "max_tokens": 900,
                                             "temperature": 0})
    for _ in range(3):  # a few tokens arrive, then the client goes away
        assert resp.readline().startswith(b"data: ")
        resp.readline()
    assert h.metric(server.base, "graphgen_num_requests_running") == 1
    conn.sock.close()
    conn.close()
    _wait_metric(server.base, "graphgen_num_requests_running", lambda v: v == 0)
    assert h.metric(server.base, "graphgen_requests_total", finish_reason="abort") == aborted + 1
    assert _wait_metric(server.base, "graphgen_kv_blocks_free", lambda v: v == free_before) == free_before


def test_16_concurrent_requests_equal_single_runs(server, engine):
    """Continuous batching changes the batch each request runs in (and so float results in the last
    bits: tests/runtime/test_continuous_batching.py bounds the logits within 1e-4); the greedy tokens
    must not change. Fewer engine steps than tokens shows the requests were batched."""
    prompts = [[(7 * i + j) % 256 for j in range(3 + i)] for i in range(16)]
    want = [engine.generate([p], max_new_tokens=5)[0].tokens for p in prompts]
    c = server.client()
    steps0 = h.metric(server.base, "graphgen_engine_steps_total")

    def one(p):
        return _ids(c.completions.create(model="tiny_qwen3", prompt=p, max_tokens=5, temperature=0).choices[0])

    with cf.ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, prompts, timeout=120))
    assert got == want
    assert h.metric(server.base, "graphgen_engine_steps_total") - steps0 < 16 * 5


def test_chat_content_parts_are_joined_text_and_other_parts_are_400(server):
    """OpenAI's content-parts form (what load generators such as guidellm send): text parts equal the
    plain string; an image part is refused with a 400."""
    plain = [{"role": "user", "content": "hi there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    a = h.post(server.base, "/v1/chat/completions", {"messages": plain, "max_tokens": 3, "temperature": 0})
    b = h.post(server.base, "/v1/chat/completions", {"messages": parts, "max_tokens": 3, "temperature": 0,
                                                     "ignore_eos": True, "max_completion_tokens": 3})
    assert a[0] == b[0] == 200
    assert a[1]["choices"][0]["token_ids"] == b[1]["choices"][0]["token_ids"]
    img = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    status, resp = h.post(server.base, "/v1/chat/completions", {"messages": img})
    assert status == 400 and resp["error"]["code"] == "unsupported_value"
