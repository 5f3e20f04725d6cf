"""Every request field of OpenAI's and vLLM's APIs works or is a 400 naming it (serve/fields.py).

- docs/serve.md's field table is `fields.table()`'s output, so the two cannot drift;
- the registry against the parsers: every field they read from a request body is in it, and every
  field it calls supported is read by them (a supported field nobody reads would be a silent
  no-op), found in the parsers' source;
- every refused field set to something that asks for more than nothing is a 400 naming it, on its
  route, and its do-nothing values (``use_beam_search: false``) are accepted; ignored fields are
  accepted;
- the fields this issue implemented, by their effect: ``min_p`` (1.0 keeps only the likeliest token:
  sampling equals greedy; without it the same seed does not), ``continue_final_message`` /
  ``add_generation_prompt`` (the template's own rendering of an open final message, and a 400 for
  both at once), ``chat_template`` / ``documents`` (what the template renders), ``include_stop_str_in_output``,
  ``skip_special_tokens`` and the stop string counted as ``stop`` in the metrics (vLLM's label).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import http_util as h
from graphgen.serve.chat_request import parse_chat
from graphgen.serve.errors import ApiError
from graphgen.serve.fields import FIELDS, check_refused, fields_of, table
from graphgen.serve.protocol import Context, parse_completion
from serve_util import ROOT

SERVE = ROOT / "graphgen" / "serve"
PARSERS = ("protocol.py", "chat_request.py", "sampling_fields.py", "tools.py", "structured.py", "pd.py", "app.py")
READERS = ("get", "_get", "_flag", "_number", "_num", "_count")


@pytest.fixture(scope="module")
def ctx(ckpt):
    from graphgen.runtime import load_tokenizer

    c = Context("tiny_qwen3", 256, 1024, load_tokenizer(ckpt))
    c.tokenizer_dir = str(ckpt)
    return c


def test_docs_table_is_the_registrys():
    doc = (ROOT / "docs" / "serve.md").read_text()
    block = re.search(r"<!-- fields:begin.*?-->\n(.*?)\n<!-- fields:end -->", doc, re.S)
    assert block, "docs/serve.md has no fields:begin / fields:end block"
    assert block.group(1).strip() == table().strip(), "regenerate it: python -m graphgen.serve.fields"


def _body_reads() -> set[str]:
    """Field names the parsers read from a request body: ``body.get("x")``, ``_get(body, "x", ...)``,
    ``"x" in body``."""
    names = set()
    for f in PARSERS:
        for node in ast.walk(ast.parse((SERVE / f).read_text())):
            if isinstance(node, ast.Call) and node.args:
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                on_body = (isinstance(fn, ast.Attribute) and getattr(fn.value, "id", "") == "body") or (
                    isinstance(node.args[0], ast.Name) and node.args[0].id == "body")
                args = node.args if isinstance(fn, ast.Attribute) else node.args[1:]
                if name in READERS and on_body and args and isinstance(args[0], ast.Constant) \
                        and isinstance(args[0].value, str):
                    names.add(args[0].value)
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and \
                    isinstance(node.ops[0], ast.In) and getattr(node.comparators[0], "id", "") == "body":
                names.add(node.left.value)
    return names


def test_the_parsers_read_exactly_the_registrys_supported_fields():
    reads = _body_reads()
    assert {"prompt", "messages", "temperature", "min_p", "continue_final_message"} <= reads  # the scan works
    known = {f.name for f in FIELDS}
    assert reads - known == set(), "read from a request but not in serve/fields.py"
    source = "".join((SERVE / f).read_text() for f in PARSERS)
    unread = {f.name for f in FIELDS if f.status == "supported" and f'"{f.name}"' not in source}
    assert unread == set(), "called supported, but no parser reads it"


def _refusing_value(f):
    return {"x": 1} if f.noop != (None, {}) else {"x": 2}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_refused_fields_are_400s_naming_them_and_their_noop_values_pass(route):
    refused = [f for f in fields_of(route).values() if f.status == "refused"]
    assert len(refused) > 10
    for f in refused:
        with pytest.raises(ApiError) as e:
            check_refused({f.name: _refusing_value(f)}, route)
        assert e.value.param == f.name and e.value.status == 400 and e.value.code == "unsupported_value"
        for ok in f.noop:
            check_refused({f.name: ok}, route)  # asks for nothing: accepted


def test_ignored_fields_and_unknown_ones_are_accepted(ctx):
    ignored = {f.name: "x" for f in FIELDS if f.status == "ignored" and "completions" in f.routes}
    parse_completion({"prompt": [1, 2], "frobnicate": 1, **ignored}, ctx)
    ignored = {f.name: "x" for f in FIELDS if f.status == "ignored" and "chat" in f.routes}
    parse_chat({"messages": [{"role": "user", "content": "hi"}], **ignored}, ctx)


def _prompt_text(ctx, parsed) -> str:
    return ctx.tokenizer.decode(list(parsed.prompts[0]))


def test_continue_final_message_and_add_generation_prompt_go_to_the_template(ctx):
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The"}]
    tok = ctx.tokenizer
    cont = parse_chat({"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}, ctx)
    assert _prompt_text(ctx, cont) == tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)
    assert _prompt_text(ctx, cont).endswith("The")  # the assistant's message is left open
    new_turn = parse_chat({"messages": msgs}, ctx)  # default: a new assistant turn after it
    assert _prompt_text(ctx, new_turn) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert _prompt_text(ctx, new_turn) != _prompt_text(ctx, cont)
    bare = parse_chat({"messages": msgs[:1], "add_generation_prompt": False}, ctx)
    assert _prompt_text(ctx, bare) == tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=False)
    for body, param in (({"messages": msgs, "continue_final_message": True}, "continue_final_message"),
                        ({"messages": msgs[:1], "continue_final_message": True, "add_generation_prompt": False},
                         "continue_final_message"),
                        ({"messages": msgs, "add_generation_prompt": "no"}, "add_generation_prompt")):
        with pytest.raises(ApiError) as e:
            parse_chat(body, ctx)
        assert e.value.param == param


def test_chat_template_and_documents_reach_the_template(ctx):
    tmpl = "{% for d in documents %}[{{ d.title }}]{% endfor %}{{ messages[0].content }}!"
    p = parse_chat({"messages": [{"role": "user", "content": "hi"}], "chat_template": tmpl,
                    "documents": [{"title": "doc1", "text": "t"}]}, ctx)
    assert _prompt_text(ctx, p) == "[doc1]hi!"
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "documents": [1]}, ctx)
    assert e.value.param == "documents"


def test_sampling_and_text_fields_reach_the_request(ctx):
    p = parse_completion({"prompt": [1], "min_p": 0.25, "include_stop_str_in_output": True,
                          "skip_special_tokens": False}, ctx)
    assert p.params.min_p == 0.25 and p.text.include_stop and not p.text.skip_special
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": [1], "min_p": 1.5}, ctx)
    assert e.value.param == "min_p"


def test_min_p_one_keeps_only_the_likeliest_token(server):
    c = server.client()
    kw = dict(model="tiny_qwen3", prompt=[9, 8, 7, 6], max_tokens=12)
    greedy = c.completions.create(temperature=0, **kw).choices[0].model_extra["token_ids"]
    sampled = c.completions.create(temperature=1.0, seed=5, extra_body={"min_p": 1.0}, **kw)
    assert sampled.choices[0].model_extra["token_ids"] == greedy
    control = c.completions.create(temperature=1.0, seed=5, **kw).choices[0].model_extra["token_ids"]
    assert control != greedy  # negative control: the same seed without min_p draws other tokens


def test_stop_string_is_counted_as_stop_and_include_stop_str_keeps_it(server):
    c = server.client()
    full = c.completions.create(model="tiny_qwen3", prompt="hello", max_tokens=12, temperature=0).choices[0].text
    stop = next(ch for ch in full[1:] if ch.isascii() and ch.isprintable())
    m = h.metrics(server.base)

    def count(name, label, reason):
        return m.get((name, frozenset({(label, reason), *({("model_name", "tiny_qwen3")} if "vllm" in name else ())})), 0)

    before = {r: (count("graphgen_requests_total", "finish_reason", r),
                  count("vllm:request_success_total", "finished_reason", r)) for r in ("stop", "abort")}
    cut = c.completions.create(model="tiny_qwen3", prompt="hello", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:full.find(stop)]
    kept = c.completions.create(model="tiny_qwen3", prompt="hello", max_tokens=12, temperature=0, stop=[stop],
                                extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.find(stop) + 1]
    m = h.metrics(server.base)
    assert count("graphgen_requests_total", "finish_reason", "stop") == before["stop"][0] + 2
    assert count("vllm:request_success_total", "finished_reason", "stop") == before["stop"][1] + 2
    assert count("graphgen_requests_total", "finish_reason", "abort") == before["abort"][0]  # (was +2)


def test_skip_special_tokens_false_keeps_the_eos_text(server, ctx):
    c = server.client()
    kw = dict(model="tiny_qwen3", prompt=[1, 2, 3], max_tokens=1, temperature=0,
              extra_body={"allowed_token_ids": [188], "ignore_eos": True})  # 188: the byte tokenizer's EOS
    assert c.completions.create(**kw).choices[0].text == ""
    kw["extra_body"]["skip_special_tokens"] = False
    eos_text = ctx.tokenizer.decode([188], skip_special_tokens=False)  # transformers' own: the NUL byte
    assert eos_text and c.completions.create(**kw).choices[0].text == eos_text


def test_parallel_tool_calls_and_include_reasoning_reach_the_output_parser(ctx):
    import copy

    from graphgen.serve.chat_output import ChatOutput
    from graphgen.serve.tools import ChatSetup

    c = copy.copy(ctx)
    c.chat_setup = ChatSetup("hermes", "qwen3")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    p = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "parallel_tool_calls": False,
                    "include_reasoning": False}, c)
    assert p.chat["parallel_tool_calls"] is False and p.chat["include_reasoning"] is False
    out = ChatOutput(**p.chat)  # what the server builds per choice (behaviour: test_chat_parsers.py)
    out.feed('<think>x</think><tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>', final=False)
    msg, called = out.message()
    assert called and out.ended and len(msg["tool_calls"]) == 1 and "reasoning" not in msg
    default = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": tools}, c)
    assert default.chat["parallel_tool_calls"] is True and default.chat["include_reasoning"] is True
