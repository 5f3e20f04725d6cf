"""The tool-call and reasoning parsers on strings (no model, no server).

The expected values follow the formats' own definitions: Qwen3's chat template (hermes
``<tool_call>`` JSON blocks), DeepSeek-V3.1's tokenizer_config template (the ``<｜tool▁…｜>``
tokens; the same split vLLM's ``deepseekv31_tool_parser.py`` makes) and the ``<think>`` convention.
The streaming tests check the property the server relies on: fed any prefix of the output, every
field only grows, and the deltas streamed over any split of the text add up to the final message.
"""

from __future__ import annotations

import json
import random

import pytest

from graphgen.serve.reasoning import ThinkParser, held_back
from graphgen.serve.tools import ChatOutput, DeepSeekV31Parser, HermesParser

DS = DeepSeekV31Parser
HERMES_TWO_CALLS = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "fmt": [1, 2]}}'
                    '\n</tool_call>')
DS_TWO_CALLS = (f'Sure.{DS.CALLS_BEGIN}{DS.CALL_BEGIN}get_weather{DS.SEP}{{"city": "Paris"}}{DS.CALL_END}'
                f'{DS.CALL_BEGIN}get_time{DS.SEP}{{"tz": "CET"}}{DS.CALL_END}{DS.CALLS_END}')


def test_held_back_counts_only_a_possible_marker_start():
    assert held_back("abc<to", "<tool_call>") == 3
    assert held_back("abc<tx", "<tool_call>") == 0
    assert held_back("<tool_call", "<tool_call>") == len("<tool_call")
    assert held_back("", "<think>") == 0
    # never the whole marker: a complete marker is found by the parser, not held back
    assert held_back("x<think>", "<think>") == 0


def test_hermes_two_calls_and_their_arguments_text():
    content, calls = HermesParser().parse(HERMES_TWO_CALLS, final=True)
    assert content == "Let me check. \n"
    assert [c[0] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c[1]) for c in calls] == [{"city": "Paris"}, {"tz": "CET", "fmt": [1, 2]}]
    assert all(c[2] for c in calls)


def test_hermes_closed_block_that_is_no_call_stays_content():
    text = "a <tool_call>\nnot json\n</tool_call> b"
    content, calls = HermesParser().parse(text, final=True)
    assert content == text and calls == []


def test_hermes_accepts_parameters_as_the_arguments_key():
    _, calls = HermesParser().parse('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', final=True)
    assert calls == [["f", '{"x": 1}', True]]


def test_hermes_escaped_name_and_braces_inside_strings():
    text = '<tool_call>{"name": "a\\"b", "arguments": {"s": "}{\\"]"}}</tool_call>'
    _, calls = HermesParser().parse(text, final=True)
    assert calls[0][0] == 'a"b'
    assert json.loads(calls[0][1]) == {"s": '}{"]'}
    assert calls[0][2]


def test_hermes_partial_marker_is_held_back_until_decided():
    p = HermesParser()
    assert p.parse("Hi <tool_ca")[0] == "Hi "
    assert p.parse("Hi <tool_ca", final=True)[0] == "Hi <tool_ca"
    assert p.parse("Hi <tool_cat")[0] == "Hi <tool_cat"  # no longer a marker: released


def test_hermes_call_cut_off_is_incomplete():
    _, calls = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": {"x": 1', final=True)
    assert calls == [["f", '{"x": 1', False]]


def test_deepseek_two_calls():
    content, calls = DS().parse(DS_TWO_CALLS, final=True)
    assert content == "Sure."
    assert calls == [["get_weather", '{"city": "Paris"}', True], ["get_time", '{"tz": "CET"}', True]]


def test_deepseek_arguments_that_are_no_object_are_incomplete():
    text = f"{DS.CALLS_BEGIN}{DS.CALL_BEGIN}f{DS.SEP}[1, 2]{DS.CALL_END}{DS.CALLS_END}"
    assert DS().parse(text, final=True)[1] == [["f", "[1, 2]", False]]


def test_deepseek_text_after_the_calls_is_content():
    text = f"a{DS.CALLS_BEGIN}{DS.CALL_BEGIN}f{DS.SEP}{{}}{DS.CALL_END}{DS.CALLS_END}b"
    assert DS().parse(text, final=True) == ("ab", [["f", "{}", True]])


@pytest.mark.parametrize("opened, text, want", [
    (False, "<think>\nplan\n</think>\n\nanswer", ("plan\n", "answer")),
    (False, "no thought here", ("", "no thought here")),
    (False, "  <think>x", ("x", "")),  # leading whitespace before the thought
    (True, "plan</think>answer", ("plan", "answer")),  # the prompt opened the thought
    (True, "still thinking", ("still thinking", "")),
])
def test_think_parser_final(opened, text, want):
    assert ThinkParser(opened).split(text, final=True) == want


def test_think_parser_holds_back_a_possible_start_and_end():
    assert ThinkParser().split("<thi") == ("", "")
    assert ThinkParser().split("<thi", final=True) == ("", "<thi")
    assert ThinkParser().split("<think>abc</th") == ("abc", "")


def _prefixes_grow(parse, text):
    """Every field of ``parse(prefix)`` is a prefix of the same field one character later."""
    prev = None
    for i in range(len(text) + 1):
        cur = parse(text[:i], i == len(text))
        if prev is not None:
            for a, b in zip(prev, cur):
                assert b.startswith(a), (text[:i], prev, cur)
        prev = cur


def _flatten_hermes(text, final):
    content, calls = HermesParser().parse(text, final)
    return [content] + [x for name, args, _ in calls for x in ((name or ""), args)]


def _flatten_ds(text, final):
    content, calls = DS().parse(text, final)
    return [content] + [x for name, args, _ in calls for x in ((name or ""), args)]


@pytest.mark.parametrize("flatten, text", [(_flatten_hermes, HERMES_TWO_CALLS), (_flatten_ds, DS_TWO_CALLS)])
def test_tool_parser_fields_only_grow(flatten, text):
    _prefixes_grow(flatten, text)


def test_think_fields_only_grow():
    _prefixes_grow(lambda t, f: ThinkParser().split(t, f), "<think>\nplan a </thinx> b\n</think>\n\ndone")
    _prefixes_grow(lambda t, f: ThinkParser(True).split(t, f), "plan</think>done")


def _stream(out: ChatOutput, text: str, cuts: list[int]) -> dict:
    """Feed ``text`` in pieces ending at ``cuts``; merge the deltas as an OpenAI client does."""
    merged = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for i, end in enumerate(cuts):
        d = out.delta(text[:end], final=i == len(cuts) - 1)
        merged["reasoning_content"] += d.get("reasoning_content", "")
        merged["content"] += d.get("content", "")
        for piece in d.get("tool_calls", []):
            call = merged["tool_calls"].setdefault(piece["index"], {"name": None, "arguments": ""})
            fn = piece.get("function", {})
            if "name" in fn:
                assert call["name"] is None, "a call's name is sent once"
                call["name"] = fn["name"]
            call["arguments"] += fn.get("arguments", "")
    return merged


@pytest.mark.parametrize("tool_parser, reasoning_parser, text", [
    ("hermes", "qwen3", "<think>\nweather first\n</think>\n\n" + HERMES_TWO_CALLS),
    ("deepseek_v31", "deepseek_r1", "<think>hm</think>" + DS_TWO_CALLS),
    ("hermes", None, "plain answer with a < sign and <tool_call>\nbroken\n</tool_call> end"),
])
def test_streamed_deltas_add_up_to_the_message_over_random_splits(tool_parser, reasoning_parser, text):
    whole, has_calls = ChatOutput(tool_parser, reasoning_parser, False).message(text)
    rng = random.Random(0)
    for trial in range(20):
        k = rng.randint(1, len(text))
        cuts = sorted(set(rng.sample(range(1, len(text) + 1), k)) | {len(text)})
        merged = _stream(ChatOutput(tool_parser, reasoning_parser, False), text, cuts)
        assert merged["content"] == (whole["content"] or ""), trial
        assert merged["reasoning_content"] == (whole.get("reasoning_content") or ""), trial
        calls = [merged["tool_calls"][i] for i in sorted(merged["tool_calls"])]
        want = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in whole.get("tool_calls", [])]
        assert calls == want, trial
    assert has_calls == bool(whole.get("tool_calls"))


def test_message_drops_a_call_cut_off_and_keeps_content_null_only_with_calls():
    out = ChatOutput("hermes", None, False)
    msg, has_calls = out.message('hello <tool_call>\n{"name": "f", "arguments": {"x"')
    assert not has_calls and "tool_calls" not in msg
    assert msg["content"] == "hello "
    msg, has_calls = ChatOutput("hermes", None, False).message(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert has_calls and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert msg["tool_calls"][0]["id"].startswith("call_")
