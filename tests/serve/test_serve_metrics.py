"""``/metrics`` that vLLM's dashboards read (issue 16, item 6): the ``graphgen_*`` series stay, and
every vLLM-named alias (labelled ``model_name``) equals its graphgen twin; the gauges hold the
engine's numbers from start-up, before any step; per-request phases and HTTP status counts. Also
the API key from ``GRAPHGEN_API_KEY``. One server (the key from the environment)."""

from __future__ import annotations

import pytest

import http_util as h
from serve_util import Server

KEY = "sk-from-env"
AUTH = {"Authorization": f"Bearer {KEY}"}
M = {"model_name": "tiny_qwen3"}
BLOCKS = 256


@pytest.fixture(scope="module")
def server(ckpt):
    # private: its gauges are read before any request and its HTTP counts exactly (nobody else's requests)
    s = Server(ckpt, "--write", "sync", "--num-blocks", str(BLOCKS), env={"GRAPHGEN_API_KEY": KEY})
    yield s
    rc = s.terminate()
    assert rc == 0, s.stderr()


def test_gauges_are_set_at_start_up_before_any_step(server):
    m = h.metrics(server.base)  # nothing has been sent yet: no step has run
    assert m[("graphgen_engine_steps_total", frozenset())] == 0
    assert m[("graphgen_kv_blocks_free", frozenset())] == BLOCKS  # not 0 until the first step
    assert m[("vllm:kv_cache_usage_perc", frozenset(M.items()))] == 0.0
    assert m[("vllm:num_requests_running", frozenset(M.items()))] == 0
    assert m[("vllm:num_requests_waiting", frozenset(M.items()))] == 0


def test_api_key_from_the_environment(server):
    assert h.get(server.base, "/v1/models")[0] == 401
    assert h.get(server.base, "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
    assert server.client(KEY).models.list().data[0].id == "tiny_qwen3"


def test_vllm_aliases_equal_the_graphgen_series(server):
    c = server.client(KEY)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    r = c.completions.create(model="tiny_qwen3", prompt=prompt, max_tokens=6, temperature=0)
    toks = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].finish_reason == "length"
    # the same prompt with its 3rd token as a stop id: finish_reason stop (and a pool hit: write sync)
    r2 = c.completions.create(model="tiny_qwen3", prompt=prompt, max_tokens=6, temperature=0,
                              extra_body={"stop_token_ids": [toks[2]]})
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].model_extra["token_ids"] == toks[:3]
    assert h.post(server.base, "/v1/completions", {"prompt": []}, headers=AUTH)[0] == 400
    m = h.metrics(server.base)

    def g(name, **labels):
        return m[(name, frozenset(labels.items()))]

    def v(name, **labels):
        return m[(name, frozenset(dict(M, **labels).items()))]

    for reason, n in (("length", 1), ("stop", 1)):
        assert v("vllm:request_success_total", finished_reason=reason) == g("graphgen_requests_total",
                                                                            finish_reason=reason) == n
    assert v("vllm:prompt_tokens_total") == g("graphgen_prompt_tokens_total") == 2 * len(prompt)
    assert v("vllm:generation_tokens_total") == g("graphgen_generation_tokens_total") == 6 + 3
    assert v("vllm:num_preemptions_total") == g("graphgen_preemptions_total")
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        for part in ("_count", "_sum"):
            assert v(f"vllm:{name}{part}") == g(f"graphgen_{name}{part}"), name
    assert v("vllm:time_per_output_token_seconds_count") == g("graphgen_inter_token_latency_seconds_count") == 5 + 2
    for phase in ("queue", "prefill", "decode", "inference"):
        assert v(f"vllm:request_{phase}_time_seconds_count") == 2, phase
    # inference = prefill + decode, each request; e2e (from arrival) covers queue + inference
    total = v("vllm:request_prefill_time_seconds_sum") + v("vllm:request_decode_time_seconds_sum")
    assert v("vllm:request_inference_time_seconds_sum") == pytest.approx(total, rel=1e-6, abs=1e-9)
    assert v("vllm:request_inference_time_seconds_sum") <= g("graphgen_e2e_request_latency_seconds_sum")
    assert v("vllm:request_prompt_tokens_sum") == 2 * len(prompt)
    assert v("vllm:request_generation_tokens_sum") == 9
    assert 0.0 <= v("vllm:kv_cache_usage_perc") <= 1.0
    # HTTP status counts: graphgen's exact codes and vLLM's (prometheus-fastapi-instrumentator) groups
    assert g("graphgen_http_requests_total", route="/v1/completions", method="POST", status="200") == 2
    assert g("graphgen_http_requests_total", route="/v1/completions", method="POST", status="400") == 1
    assert g("graphgen_http_requests_total", route="/v1/models", method="GET", status="401") == 2
    assert g("http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 2
    assert g("http_requests_total", handler="/v1/completions", method="POST", status="4xx") == 1
    assert g("graphgen_http_requests_total", route="/metrics", method="GET", status="200") >= 1


@pytest.mark.slow  # a second server (pool.device_cache: true)
def test_device_prefix_hits_are_counted_apart_from_pool_hits(ckpt, tmp_path):
    from serve_util import SPEC

    # private: its counters are read exactly after two requests (and its spec is this test's own)
    spec = tmp_path / "tiny_qwen3_device_cache.yaml"
    text = SPEC.read_text()
    assert text.count("  granularity: forward\n") == 1
    spec.write_text(text.replace("  granularity: forward\n", "  granularity: forward\n  device_cache: true\n"))
    s = Server(ckpt, "--write", "sync", "--num-blocks", "64", spec=spec)
    try:
        c = s.client()
        prompt = list(range(1, 18))  # 17 tokens: 4 full blocks of 4 may hit
        for _ in range(2):
            c.completions.create(model="tiny_qwen3", prompt=prompt, max_tokens=2, temperature=0)
        m = h.metrics(s.base)
        assert m[("graphgen_device_prefix_hit_blocks_total", frozenset())] == 4
        assert m[("graphgen_prefix_cache_hit_tokens_total", frozenset())] == 16  # the device hit's tokens
        assert m[("graphgen_device_prefix_cached_blocks", frozenset())] > 0
    finally:
        assert s.terminate() == 0, s.stderr()
