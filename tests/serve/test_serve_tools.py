"""Tool calling and reasoning end to end, with the official openai client, on a tiny checkpoint
trained to answer a fixed prompt with a thought and a tool call (``chat_ckpt``), in both families'
formats: Qwen3's hermes ``<tool_call>`` JSON and DeepSeek-V3.1's tool-call tokens. The servers are
started with the spec's ``features: [function_call, reasoning_parser]`` (no flags)."""

from __future__ import annotations

import json

import pytest

from serve_util import ROOT, Server
from support.chat_ckpt import ARGS, MESSAGES, TEMPLATE_KWARGS, THOUGHT, TOOLS

FAMILIES = {"tiny_qwen3_chat": "qwen3_dense", "tiny_deepseek_v3_chat": "deepseek_v3"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def server(request, chat_ckpt):
    out, family, _, _ = chat_ckpt(request.param)
    s = Server(out, "--num-blocks", "256", spec=ROOT / "specs" / f"{request.param}.yaml")
    s.family = family
    yield s
    rc = s.terminate()
    assert rc == 0, s.proc.stderr.read()[-3000:]


def _ask(server, **kw):
    kw.setdefault("extra_body", {})["chat_template_kwargs"] = TEMPLATE_KWARGS[server.family]
    return server.client().chat.completions.create(model=server.client().models.list().data[0].id,
                                                   messages=MESSAGES, tools=TOOLS, temperature=0,
                                                   max_tokens=96, **kw)


def test_tool_call_and_reasoning(server):
    r = _ask(server)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(ARGS)
    extra = ch.message.model_extra
    assert extra["reasoning_content"].strip() == THOUGHT == extra["reasoning"].strip()


def test_streamed_deltas_equal_the_message(server):
    whole = _ask(server).choices[0]
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in _ask(server, stream=True):
        for ch in chunk.choices:
            d = ch.delta
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for tc in d.tool_calls or ():
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert c["id"] is None, "a call's id and name come once, in its first delta"
                    c["id"], c["name"] = tc.id, tc.function.name
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert reasoning == whole.message.model_extra["reasoning_content"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_choice_none_returns_text(server):
    ch = _ask(server, tool_choice="none").choices[0]
    assert not ch.message.tool_calls and ch.finish_reason == "stop"
    assert "get_weather" in ch.message.content  # the call's text, not parsed


def test_named_tool_choice_is_forced_by_the_grammar(server):
    # the trained answer starts with its thought; the grammar forces the call first
    ch = _ask(server, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert ch.message.tool_calls, ch
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments).get("city"), str)
    ch = _ask(server, tool_choice="required", stream=False).choices[0]
    assert ch.message.tool_calls[0].function.name == "get_weather"


def test_tool_messages_go_through_the_template(server):
    c = server.client()
    msgs = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = c.chat.completions.create(model="x" if False else c.models.list().data[0].id, messages=msgs,
                                  tools=TOOLS, max_tokens=4, temperature=0, reasoning_effort="low")
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
