"""Tool calling and reasoning end to end, with the official openai client, on a tiny checkpoint
trained to answer a fixed prompt with a thought and a tool call (``chat_ckpt``), in both families'
formats: Qwen3's hermes ``<tool_call>`` JSON and DeepSeek-V3.1's tool-call tokens. The servers are
started with the spec's ``features: [function_call, reasoning_parser]`` (no flags).

A call that does not parse loses nothing: greedy decoding gives a valid call (the trained answer),
a truncated one (``max_tokens`` six short of it) and a malformed one (Qwen3: ``}`` banned by
``logit_bias``, so the JSON never closes before ``</tool_call>``; DeepSeek: thinking off, the
newcomer trial's 3.7), and for each the client sees the same final message streamed and not; the
two that do not parse come back as their raw text in ``content``."""

from __future__ import annotations

import json
import re

import pytest

from serve_util import ROOT
from support.chat_ckpt import ARGS, MESSAGES, TEMPLATE_KWARGS, THOUGHT, TOOLS

FAMILIES = {"tiny_qwen3_chat": "qwen3_dense", "tiny_deepseek_v3_chat": "deepseek_v3"}


@pytest.fixture(params=list(FAMILIES))
def server(request, servers, chat_ckpt):
    out, family, _, _ = chat_ckpt(request.param)
    s = servers.get(out, "--num-blocks", "256", spec=ROOT / "specs" / f"{request.param}.yaml")
    s.family = family
    return s


def _ask(server, **kw):
    kw.setdefault("extra_body", {}).setdefault("chat_template_kwargs", TEMPLATE_KWARGS[server.family])
    kw.setdefault("max_tokens", 96)
    return server.client().chat.completions.create(model=server.client().models.list().data[0].id,
                                                   messages=MESSAGES, tools=TOOLS, temperature=0, **kw)


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
    assert extra["reasoning"].strip() == THOUGHT  # vLLM's one name for it
    assert "reasoning_content" not in extra


def test_streamed_deltas_equal_the_message(server):
    whole = _ask(server).choices[0]
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in _ask(server, stream=True):
        for ch in chunk.choices:
            d = ch.delta
            reasoning += (d.model_extra or {}).get("reasoning") or ""
            assert "reasoning_content" not in (d.model_extra or {})
            content += d.content or ""
            for tc in d.tool_calls or ():
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert c["id"] is None, "a call's id and name come once, in its first delta"
                    c["id"], c["name"] = tc.id, tc.function.name
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert reasoning == whole.message.model_extra["reasoning"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_choice_none_returns_text(server):
    ch = _ask(server, tool_choice="none").choices[0]
    assert not ch.message.tool_calls and ch.finish_reason == "stop"
    assert "get_weather" in ch.message.content  # the call's text, not parsed


def test_named_tool_choice_is_forced_by_the_grammar(server):
    # the trained answer starts with its thought; the grammar forces the call first, as strictly as
    # response_format: exactly the schema's keys (the newcomer trial's Qwen3 got {"city": "city",
    # "Paris": "Paris"}), no free whitespace (its random model spent 60 tokens on "\r")
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        ch = _ask(server, tool_choice=choice).choices[0]
        assert ch.message.tool_calls, ch
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather" and ch.finish_reason == "tool_calls"
        assert re.fullmatch(r'\{"city": "(?:[^"\\]|\\.)*"\}', call.function.arguments), call.function.arguments


def test_tool_messages_go_through_the_template(server):
    c = server.client()
    msgs = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = c.chat.completions.create(model="x" if False else c.models.list().data[0].id, messages=msgs,
                                  tools=TOOLS, max_tokens=4, temperature=0, reasoning_effort="low")
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _merged(stream) -> dict:
    """The final message a client builds from the deltas."""
    msg = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            msg["content"] += d.content or ""
            msg["reasoning"] += (d.model_extra or {}).get("reasoning") or ""
            for tc in d.tool_calls or ():
                c = msg["calls"].setdefault(tc.index, {"name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            msg["finish"] = ch.finish_reason or msg["finish"]
    return {"content": msg["content"] or None, "reasoning": msg["reasoning"] or None, "finish": msg["finish"],
            "calls": [(c["name"], c["arguments"]) for _, c in sorted(msg["calls"].items())]}


def _whole(r) -> dict:
    ch = r.choices[0]
    return {"content": ch.message.content or None, "reasoning": (ch.message.model_extra or {}).get("reasoning"),
            "finish": ch.finish_reason,
            "calls": [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or ()]}


def _cases(server):
    """(name, request fields, whether a call parses) for the valid, truncated and malformed answers."""
    valid = _ask(server)
    n = valid.usage.completion_tokens
    if server.family == "qwen3_dense":  # no "}": the call's JSON stays open up to </tool_call>
        brace = _ask(server).choices[0].model_extra["token_ids"][-4]  # the answer ends '}}\n</tool_call><|im_end|>'
        malformed = {"logit_bias": {str(brace): -100}}
    else:  # thinking off: the trained model writes a broken call (newcomer trial 3.7)
        malformed = {"extra_body": {"chat_template_kwargs": {}}}
    return [("valid", {}, True), ("truncated", {"max_tokens": n - 6}, False), ("malformed", malformed, False)]


def test_streamed_and_whole_messages_agree_and_a_call_that_does_not_parse_is_content(server):
    marker = "<tool_call>" if server.family == "qwen3_dense" else "<｜tool▁calls▁begin｜>"
    for name, kw, parses in _cases(server):
        whole = _whole(_ask(server, **kw))
        assert _merged(_ask(server, stream=True, **kw)) == whole, name
        if parses:
            assert whole["finish"] == "tool_calls" and whole["calls"] == [("get_weather", ARGS)], (name, whole)
            continue
        assert whole["calls"] == [] and whole["finish"] in ("stop", "length"), (name, whole)
        assert marker in whole["content"] and "get_weather" in whole["content"], (name, whole)  # the raw text
