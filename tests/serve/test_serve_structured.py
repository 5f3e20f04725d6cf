"""Structured output (``response_format``) through llguidance's mask, with the openai client, on the
random tiny Qwen3 (``ckpt``): the output parses and validates, greedy and sampled, streamed and not,
and the same requests without the mask do not; ``text`` is accepted; bad schemas and ``tools``
without a tool-call parser are 400s naming the field. On the shared server (conftest: structured output
does not depend on its write mode)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}
RF = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def _chat(server, **kw):
    return server.client().chat.completions.create(model="tiny_qwen3", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=40, **kw)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_json_schema_validates(server, sampling):
    r = _chat(server, response_format=RF, **sampling)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].message.content == json.dumps(json.loads(r.choices[0].message.content))  # no free whitespace
    streamed = "".join(c.choices[0].delta.content or "" for c in _chat(server, response_format=RF, stream=True,
                                                                        **sampling) if c.choices)
    assert streamed == r.choices[0].message.content
    control = _chat(server, **sampling).choices[0].message.content  # no mask: the random model's bytes
    with pytest.raises(ValueError):
        json.loads(control)


def test_json_object_and_text(server):
    r = _chat(server, response_format={"type": "json_object"}, temperature=0)
    assert r.choices[0].message.content.startswith("{")
    assert not _chat(server, temperature=0).choices[0].message.content.startswith("{")
    plain = _chat(server, response_format={"type": "text"}, temperature=0)
    assert plain.choices[0].message.content == _chat(server, temperature=0).choices[0].message.content
    c = server.client().completions.create(model="tiny_qwen3", prompt="x", max_tokens=40, temperature=0,
                                           extra_body={"response_format": RF})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
])
def test_bad_values_are_400s(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(server, extra_body=body)
    assert e.value.body["param"] == param
