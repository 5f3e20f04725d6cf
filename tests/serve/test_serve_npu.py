"""``graphgen serve --target npu --standin``: the server over the NPU model runner (CPU stand-in), driven by the
official ``openai`` client. A wiring check of the server over the NPU runner against the CPU target and
transformers, never an NPU result (docs/npu.md).

One server for the module, with what serve turns on by default and what the seed ran with the async write:
``--write async`` (the spec's), async scheduling (serve's default), chunked prefill (a 128-token step budget: the
chat prompt's 380 tokens run in chunks), the prefix cache (a repeat hits the first's two 128-token blocks),
the hermes tool-call and qwen3 reasoning parsers, and grammar-forced output (a named ``tool_choice``). Its
checkpoint is tiny_qwen3_npu's shape trained to answer support.chat_ckpt's prompt with a thought and a tool call
(``chat_ckpt``: the training asserts transformers' greedy answer is exactly that), so the NPU server's tokens
are held to an implementation nobody here wrote; ``graphgen run --target npu --standin`` (async scheduling off)
gives the server's tokens (the composition matrix's NPU cells of these features: docs/composition.md)."""
from __future__ import annotations

import json
import re

import pytest

from serve_util import ROOT
from support.chat_ckpt import ARGS, MESSAGES, TARGET, TEMPLATE_KWARGS, THOUGHT, TOOLS
from support.cli import graphgen, run_args

SPEC = ROOT / "specs" / "tiny_qwen3_npu.yaml"
PROMPT = list(range(5, 40))
FLAGS = ("--target", "npu", "--standin", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
         "--max-num-batched-tokens", "128", "--num-blocks", "16")


@pytest.fixture(scope="module")
def chat(chat_ckpt):
    return chat_ckpt("tiny_qwen3_npu")  # (dir, family, prompt length, the trained answer's ids)


@pytest.fixture(scope="module")
def server(servers, chat):
    return servers.get(chat[0], *FLAGS, spec=SPEC, cli=True)


def _ask(server, **kw):
    kw.setdefault("max_tokens", 96)
    return server.client().chat.completions.create(
        model="tiny_qwen3_npu", messages=MESSAGES, tools=TOOLS, temperature=0,
        extra_body={"chat_template_kwargs": TEMPLATE_KWARGS["qwen3_dense"]}, **kw)


def _metric(server, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(server.base + "/metrics", timeout=30).read().decode()
    names = (name, name + "_total")  # a counter's sample: NAME_total
    got = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
           if line.split("{")[0].split(" ")[0] in names]
    assert got, f"no sample {name} in /metrics"
    return sum(got)


def test_serve_target_npu_standin_async_scheduling_gives_the_tokens_of_run_without_it(server, chat):
    """serve (async scheduling on, serve's default) = ``graphgen run --target npu --standin`` (off)."""
    r = server.client().completions.create(model="tiny_qwen3_npu", prompt=PROMPT, max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    got = list(r.choices[0].model_extra["token_ids"])
    err = server.stderr(10**6)
    assert "not an NPU result" in err  # the one line on what is verified (its exit 0: the factory's)
    assert "async scheduling is off" not in err  # one rank: nothing turned off
    res = graphgen(*run_args(SPEC, chat[0], [PROMPT], 3, "--target", "npu", "--standin", "--ignore-eos",
                             "--no-async-scheduling"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert got == json.loads(res.stdout.splitlines()[0])["tokens"]


def test_tool_call_and_reasoning_equal_the_trained_answer_chunked_and_after_a_prefix_hit(server, chat):
    """The answer transformers' greedy decoding gives (the training's assert), token for token, its thought in
    ``reasoning`` and its call parsed; the prompt ran in chunks; a repeat, once the first's async saves have
    landed, hits its two full blocks and answers alike, streamed too."""
    steps = _metric(server, "graphgen_engine_steps")
    first = _ask(server)
    ch = first.choices[0]
    assert list(ch.model_extra["token_ids"]) == chat[3]  # = transformers' greedy answer
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == json.loads(ARGS)
    assert ch.message.model_extra["reasoning"].strip() == THOUGHT
    assert first.usage.prompt_tokens == chat[2] > 2 * 128
    # 380 prompt tokens at a 128-token budget: at least 3 prefill steps, then the answer's decode steps
    assert _metric(server, "graphgen_engine_steps") - steps >= 3 + len(chat[3]) - 1
    hits = _metric(server, "graphgen_prefix_cache_hit_tokens") + 128 * _metric(server,
                                                                               "graphgen_device_prefix_hit_blocks")
    import time

    deadline = time.monotonic() + 60
    while _metric(server, "graphgen_kv_saves_pending") and time.monotonic() < deadline:
        time.sleep(0.05)  # the async write's commits: landed before the repeat looks them up
    again = _ask(server)
    assert again.usage.prompt_tokens_details.cached_tokens == 256, again.usage
    assert list(again.choices[0].model_extra["token_ids"]) == chat[3]
    assert _metric(server, "graphgen_prefix_cache_hit_tokens") + 128 * _metric(
        server, "graphgen_device_prefix_hit_blocks") - hits == 256
    reasoning, calls = "", {}
    for chunk in _ask(server, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            for tc in c.delta.tool_calls or ():
                calls[tc.index] = calls.get(tc.index, "") + (tc.function.arguments or "")
    assert reasoning == ch.message.model_extra["reasoning"] and list(calls.values()) == [call.function.arguments]


def test_named_tool_choice_is_forced_by_the_grammar(server):
    """Structured output on the NPU engine: the grammar forces the call first (the trained answer thinks first),
    exactly the schema's keys; the control: without it the answer starts with its thought."""
    ch = _ask(server, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and ch.finish_reason == "tool_calls"
    assert re.fullmatch(r'\{"city": "(?:[^"\\]|\\.)*"\}', call.function.arguments), call.function.arguments
    assert not (ch.message.model_extra or {}).get("reasoning")  # forced: no thought before the call
    assert TARGET["qwen3_dense"].startswith("<think>")  # the control: unforced, it thinks first (the test above)
