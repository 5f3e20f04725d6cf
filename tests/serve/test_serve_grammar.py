"""The one grammar builder (serve/structured.py) and the grammar compile off the engine's loop.

Judged by llguidance itself (nobody here wrote it): a forced call's grammar and a ``response_format``
grammar of the same schema accept and refuse the same texts — the compact, schema-true call; not
a key outside the schema (the newcomer trial's ``{"city": "city", "Paris": "Paris"}``), not free
whitespace (its ``{"name"\\r\\r\\r``), not a missing required key; ``{"type": "object"}`` alone still
takes any keys. The engine's mask (`allowed_tokens`) equals llguidance's own per-token verdict.
`GrammarWorker.ready` compiles on its own thread, and a compiled grammar is reused.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from graphgen.runtime import StructuredOutput, compiled_matcher
from graphgen.runtime.engine.grammar import allowed_tokens
from graphgen.serve.grammar_worker import GrammarWorker
from graphgen.serve.structured import forced_call_grammar, response_format_grammar, strict_schema
from graphgen.serve.tool_parsers import DeepSeekV31Parser as DS
from support.paths import SPECS

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family parser -> (tokenizer folder, vocab) of the chat specs: the family's own tokens and template, as
    graphgen's checkpoint writer makes them (the chat checkpoints' tokenizer is this one, untouched by their
    training: only the grammar's tokens matter here, so no model is trained for them)."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.tokenizer import write_tokenizer

    out = {}
    for parser, name in (("hermes", "tiny_qwen3_chat"), ("deepseek_v31", "tiny_deepseek_v3_chat")):
        spec = load_spec(SPECS / f"{name}.yaml")
        folder = tmp_path_factory.mktemp(f"tok_{name}")
        assert write_tokenizer(folder, spec.dims.vocab_size, family=spec.family) is not None
        out[parser] = (str(folder), spec.dims.vocab_size)
    return out


def _accepts(grammar: str, folder: str, vocab: int, text: str) -> bool:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).encode(text, add_special_tokens=False)
    m = compiled_matcher(StructuredOutput(grammar, folder), vocab).deep_copy()
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_strict_schema_closes_objects_that_list_properties():
    s = strict_schema({"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "c": {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {"d": {}}}, {"type": "null"}]}},
        "e": {"type": "object", "properties": {}, "additionalProperties": True}},
        "$defs": {"x": {"type": "object", "properties": {"y": {}}}}})
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["c"]["items"]["anyOf"][0]["additionalProperties"] is False
    assert s["properties"]["e"]["additionalProperties"] is True  # the schema allows more: kept
    assert s["$defs"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in strict_schema({"type": "object"})  # json_object: any keys


@pytest.mark.parametrize("parser", ["hermes", "deepseek_v31"])
def test_forced_calls_are_as_strict_as_response_format(tokenizers, parser):
    folder, vocab = tokenizers[parser]
    forced = forced_call_grammar(parser, TOOLS)
    rf = response_format_grammar({"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})

    def call(args: str) -> str:
        if parser == "hermes":
            return f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
        return f"{DS.CALLS_BEGIN}{DS.CALL_BEGIN}get_weather{DS.SEP}{args}{DS.CALL_END}{DS.CALLS_END}"

    for args, ok in (('{"city": "Paris"}', True), ('{"city": "city", "Paris": "Paris"}', False),
                     ('{"city":\r\r "Paris"}', False), ('{ "city": "Paris"}', False), ("{}", False)):
        assert _accepts(forced, folder, vocab, call(args)) is ok, (parser, args)
        assert _accepts(rf, folder, vocab, args) is ok, ("response_format", args)
    any_object = response_format_grammar({"type": "json_object"})
    assert _accepts(any_object, folder, vocab, '{"anything": [1, 2], "else": null}')
    if parser == "hermes":  # the name is the tool's, and the whitespace inside {"name" is not free
        assert not _accepts(forced, folder, vocab, call('{"city": "Paris"}').replace("get_weather", "launch"))
        assert not _accepts(forced, folder, vocab, '<tool_call>\n{"name"\r\r: "get_weather"')


def test_the_engines_mask_is_llguidances_own_verdict(tokenizers):
    from transformers import AutoTokenizer

    folder, vocab = tokenizers["hermes"]
    m = compiled_matcher(StructuredOutput(forced_call_grammar("hermes", TOOLS), folder), vocab).deep_copy()
    prefix = AutoTokenizer.from_pretrained(folder).encode('<tool_call>\n{"name": "get_weather", "arguments": {"ci',
                                                          add_special_tokens=False)
    assert m.consume_tokens(prefix)
    mask = allowed_tokens(m.compute_bitmask(), vocab)
    verdict = [m.validate_tokens([t]) == 1 for t in range(vocab)]
    assert mask.tolist() == verdict and 0 < sum(verdict) < vocab


def test_the_worker_compiles_off_the_callers_thread_and_the_grammar_is_reused(tokenizers, monkeypatch):
    import graphgen.runtime as rt

    folder, vocab = tokenizers["hermes"]
    spec = StructuredOutput(response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object", "properties": {
            "worker": {"type": "integer"}}}}}), folder)
    threads = []
    real = rt.compiled_matcher

    def spy(s, n):
        threads.append(threading.current_thread().name)
        return real(s, n)

    monkeypatch.setattr(rt, "compiled_matcher", spy)
    w = GrammarWorker(folder, vocab)
    w.start()
    try:
        asyncio.run(w.ready(spec, "response_format"))
    finally:
        w.stop()
    assert threads and threads[0].startswith("grammar") and threads[0] != threading.current_thread().name
    assert real(spec, vocab) is real(spec, vocab)  # cached by grammar: compiled once
