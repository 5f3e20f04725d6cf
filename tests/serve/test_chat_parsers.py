"""The tool-call and reasoning parsers on strings (no model, no server).

The expected values follow the formats' own definitions: Qwen3's chat template (hermes
``<tool_call>`` JSON blocks), DeepSeek-V3.1's tokenizer_config template (the ``<｜tool▁…｜>``
tokens; the same split vLLM's ``deepseekv31_tool_parser.py`` makes) and the ``<think>`` convention.
What the server relies on: nothing the model wrote is lost (a call that does not parse — malformed,
truncated, an unknown function — comes back as its raw text in ``content``), and the deltas streamed
over any split of the text add up to the message built from the whole text.
"""

from __future__ import annotations

import json
import random

import pytest

from graphgen.serve.chat_output import ChatOutput
from graphgen.serve.reasoning import ThinkParser, held_back
from graphgen.serve.tool_parsers import DeepSeekV31Parser, HermesParser

DS = DeepSeekV31Parser
NAMES = ("get_weather", "get_time")
HERMES_TWO_CALLS = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "fmt": [1, 2]}}'
                    '\n</tool_call>')
DS_TWO_CALLS = (f'Sure.{DS.CALLS_BEGIN}{DS.CALL_BEGIN}get_weather{DS.SEP}{{"city": "Paris"}}{DS.CALL_END}'
                f'{DS.CALL_BEGIN}get_time{DS.SEP}{{"tz": "CET"}}{DS.CALL_END}{DS.CALLS_END}')
H_OK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
H_BAD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'  # one brace short
H_UNKNOWN = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
H_CUT = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
D_OK = f'{DS.CALL_BEGIN}get_weather{DS.SEP}{{"city": "Paris"}}{DS.CALL_END}'
D_BAD = f'{DS.CALL_BEGIN}get_weather{DS.SEP}{{": "city": "Paris"}}{DS.CALL_END}'  # the newcomer's 3.7 shape
D_UNKNOWN = f'{DS.CALL_BEGIN}launch{DS.SEP}{{}}{DS.CALL_END}'


def parse(parser, text):
    """(content, [(name, arguments)]) of the whole text fed at once."""
    pieces = parser.feed(text, final=True)
    return "".join(p[1] for p in pieces if p[0] == "content"), [p[1:] for p in pieces if p[0] == "call"]


def test_held_back_counts_only_a_possible_marker_start():
    assert held_back("abc<to", "<tool_call>") == 3
    assert held_back("abc<tx", "<tool_call>") == 0
    assert held_back("<tool_call", "<tool_call>") == len("<tool_call")
    assert held_back("", "<think>") == 0
    # never the whole marker: a complete marker is found by the parser, not held back
    assert held_back("x<think>", "<think>") == 0


def test_hermes_two_calls_and_their_arguments_text():
    content, calls = parse(HermesParser(NAMES), HERMES_TWO_CALLS)
    assert content == "Let me check. \n"
    assert [c[0] for c in calls] == ["get_weather", "get_time"]
    assert [c[1] for c in calls] == ['{"city": "Paris"}', '{"tz": "CET", "fmt": [1, 2]}']  # the model's own text


def test_hermes_closed_block_that_is_no_call_stays_content():
    text = "a <tool_call>\nnot json\n</tool_call> b"
    assert parse(HermesParser(NAMES), text) == (text, [])


def test_hermes_accepts_parameters_as_the_arguments_key():
    assert parse(HermesParser(["f"]), '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>') == \
        ("", [("f", '{"x": 1}')])


def test_hermes_escaped_name_and_braces_inside_strings():
    text = '<tool_call>{"name": "a\\"b", "arguments": {"s": "}{\\"]"}}</tool_call>'
    _, calls = parse(HermesParser(['a"b']), text)
    assert calls[0][0] == 'a"b'
    assert json.loads(calls[0][1]) == {"s": '}{"]'}


def test_hermes_partial_marker_is_held_back_until_decided():
    assert HermesParser().feed("Hi <tool_ca") == [("content", "Hi ")]
    p = HermesParser()
    p.feed("Hi <tool_ca")
    assert p.feed("", final=True) == [("content", "<tool_ca")]
    assert HermesParser().feed("Hi <tool_cat") == [("content", "Hi <tool_cat")]  # no longer a marker: released


@pytest.mark.parametrize("what, text", [("malformed", H_BAD), ("truncated", H_CUT), ("unknown function", H_UNKNOWN),
                                        ("marker only", "<tool_call>")])
def test_hermes_call_that_does_not_parse_is_content(what, text):
    assert parse(HermesParser(NAMES), "before " + text) == ("before " + text, []), what


def test_hermes_final_call_without_its_end_tag_is_a_call_when_its_json_is_whole():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert parse(HermesParser(NAMES), text) == ("", [("get_weather", '{"city": "Paris"}')])


def test_hermes_two_calls_one_bad():
    content, calls = parse(HermesParser(NAMES), H_BAD + "\n" + H_OK)
    assert calls == [("get_weather", '{"city": "Paris"}')] and content == H_BAD + "\n"
    content, calls = parse(HermesParser(NAMES), H_OK + H_UNKNOWN)
    assert calls == [("get_weather", '{"city": "Paris"}')] and content == H_UNKNOWN


def test_deepseek_two_calls():
    assert parse(DS(NAMES), DS_TWO_CALLS) == ("Sure.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')])


def test_deepseek_text_after_the_calls_is_content():
    text = f"a{DS.CALLS_BEGIN}{DS.CALL_BEGIN}f{DS.SEP}{{}}{DS.CALL_END}{DS.CALLS_END}b"
    assert parse(DS(["f"]), text) == ("ab", [("f", "{}")])


@pytest.mark.parametrize("what, call", [
    ("malformed", D_BAD), ("arguments no object", f"{DS.CALL_BEGIN}get_weather{DS.SEP}[1, 2]{DS.CALL_END}"),
    ("unknown function", D_UNKNOWN), ("no separator", f"{DS.CALL_BEGIN}get_weather{DS.CALL_END}")])
def test_deepseek_call_that_does_not_parse_is_content_markers_included(what, call):
    text = f"x{DS.CALLS_BEGIN}{call}{DS.CALLS_END}y"
    assert parse(DS(NAMES), text) == (text, []), what


@pytest.mark.parametrize("cut", [1, 5, 30, 40, len(DS.CALLS_BEGIN + D_OK) - 2])
def test_deepseek_truncated_call_is_content(cut):
    text = (DS.CALLS_BEGIN + D_OK)[:cut]
    assert parse(DS(NAMES), "x" + text) == ("x" + text, [])


def test_deepseek_two_calls_one_bad():
    # the first parses: the region's markers are structure; the bad one is its raw text
    content, calls = parse(DS(NAMES), DS.CALLS_BEGIN + D_OK + D_BAD + DS.CALLS_END)
    assert calls == [("get_weather", '{"city": "Paris"}')] and content == D_BAD
    # the first does not: it and both region markers are content; the good one is still a call
    content, calls = parse(DS(NAMES), DS.CALLS_BEGIN + D_UNKNOWN + D_OK + DS.CALLS_END)
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert content == DS.CALLS_BEGIN + D_UNKNOWN + DS.CALLS_END
    # a second call cut off after a good one: its text is content
    content, calls = parse(DS(NAMES), DS.CALLS_BEGIN + D_OK + D_OK[:12])
    assert calls == [("get_weather", '{"city": "Paris"}')] and content == D_OK[:12]


@pytest.mark.parametrize("opened, text, want", [
    (False, "<think>\nplan\n</think>\n\nanswer", ("plan\n", "answer")),
    (False, "no thought here", ("", "no thought here")),
    (False, "  <think>x", ("x", "")),  # leading whitespace before the thought
    (True, "plan</think>answer", ("plan", "answer")),  # the prompt opened the thought
    (True, "still thinking", ("still thinking", "")),
    (False, "\n\n", ("", "\n\n")),  # blank output is content, not lost
])
def test_think_parser_final(opened, text, want):
    assert ThinkParser(opened).feed(text, final=True) == want


def test_think_parser_holds_back_a_possible_start_and_end():
    assert ThinkParser().feed("<thi") == ("", "")
    p = ThinkParser()
    p.feed("<thi")
    assert p.feed("", final=True) == ("", "<thi")
    assert ThinkParser().feed("<think>abc</th") == ("abc", "")


def _stream(out: ChatOutput, text: str, cuts: list[int]) -> dict:
    """Feed ``text`` in pieces ending at ``cuts``; merge the deltas as an OpenAI client does."""
    merged = {"reasoning": "", "content": "", "tool_calls": {}}
    start = 0
    for i, end in enumerate(cuts):
        d = out.feed(text[start:end], final=i == len(cuts) - 1)
        start = end
        merged["reasoning"] += d.get("reasoning", "")
        merged["content"] += d.get("content", "")
        for piece in d.get("tool_calls", []):
            assert piece["index"] not in merged["tool_calls"], "a call is sent once, whole"
            merged["tool_calls"][piece["index"]] = piece["function"]
    return merged


CASES = [
    ("hermes", "qwen3", "<think>\nweather first\n</think>\n\n" + HERMES_TWO_CALLS),  # reasoning before calls
    ("deepseek_v31", "deepseek_r1", "<think>hm</think>" + DS_TWO_CALLS),
    ("hermes", None, "plain answer with a < sign and <tool_call>\nbroken\n</tool_call> end"),
    ("hermes", "qwen3", "<think>\nplan\n</think>\n\n" + H_BAD + H_OK),
    ("hermes", None, "text " + H_CUT),
    ("deepseek_v31", "deepseek_r1", "<think>hm</think>" + DS.CALLS_BEGIN + D_BAD + D_OK + DS.CALLS_END + "tail"),
    ("deepseek_v31", None, "a" + DS.CALLS_BEGIN + D_OK[:-3]),
]


@pytest.mark.parametrize("tool_parser, reasoning_parser, text", CASES)
def test_streamed_deltas_add_up_to_the_message_over_random_splits(tool_parser, reasoning_parser, text):
    out = ChatOutput(tool_parser, reasoning_parser, False, NAMES)
    out.feed(text, final=True)
    whole, has_calls = out.message()
    rng = random.Random(0)
    for trial in range(30):
        k = rng.randint(1, len(text))
        cuts = sorted(set(rng.sample(range(1, len(text) + 1), k)) | {len(text)})
        merged = _stream(ChatOutput(tool_parser, reasoning_parser, False, NAMES), text, cuts)
        assert merged["content"] == (whole["content"] or ""), trial
        assert merged["reasoning"] == (whole.get("reasoning") or ""), trial
        calls = [merged["tool_calls"][i] for i in sorted(merged["tool_calls"])]
        assert calls == [c["function"] for c in whole.get("tool_calls", [])], trial
    assert has_calls == bool(whole.get("tool_calls"))
    # nothing lost: reasoning + content + the calls' text cover the model's words
    for word in ("weather", "plan", "broken", "tail", " end", "ci"):
        if word in text:
            assert word in (whole.get("reasoning") or "") + (whole["content"] or "") + json.dumps(
                whole.get("tool_calls", [])), word


def test_message_content_is_null_only_with_calls_and_a_cut_call_is_content():
    out = ChatOutput("hermes", None, False, ["f"])
    out.feed('hello <tool_call>\n{"name": "f", "arguments": {"x"', final=True)
    msg, has_calls = out.message()
    assert not has_calls and "tool_calls" not in msg
    assert msg["content"] == 'hello <tool_call>\n{"name": "f", "arguments": {"x"'
    out = ChatOutput("hermes", None, False, ["f"])
    out.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>', final=True)
    msg, has_calls = out.message()
    assert has_calls and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert msg["tool_calls"][0]["id"].startswith("call_")


def test_parallel_tool_calls_false_ends_the_output_at_the_first_call():
    out = ChatOutput("hermes", None, False, NAMES, parallel_tool_calls=False)
    d = out.feed(HERMES_TWO_CALLS, final=False)
    assert out.ended and [c["function"]["name"] for c in d["tool_calls"]] == ["get_weather"]
    assert out.feed(" more", final=True) == {}
    msg, _ = out.message()
    assert len(msg["tool_calls"]) == 1 and msg["content"] == "Let me check. "
    both = ChatOutput("hermes", None, False, NAMES)  # the default: every call
    assert len(both.feed(HERMES_TWO_CALLS, final=True)["tool_calls"]) == 2 and not both.ended
