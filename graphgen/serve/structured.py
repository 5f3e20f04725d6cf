"""The one grammar builder: ``response_format`` and forced tool calls become llguidance grammars with
the same strictness. The engine's half (`graphgen.runtime.StructuredOutput`, a per-request matcher
masking the logits before sampling) lives in ``runtime/engine/grammar.py``; compiling a grammar
against the tokenizer happens off the engine's loop (serve/grammar_worker.py).

Every JSON value a grammar allows is built by `json_rule` from a JSON schema made strict by
`strict_schema` (xgrammar's and vLLM's default):

- no free whitespace: separators are exactly ``", "`` and ``": "`` (what the chat templates'
  ``tojson`` writes), so a model cannot spend its tokens on blank space;
- an object schema that lists ``properties`` and says nothing of ``additionalProperties`` /
  ``patternProperties`` gets ``additionalProperties: false`` (no keys outside the schema); one
  without ``properties`` (``{"type": "object"}``: ``json_object``) still takes any keys;
- ``required`` keys are required (JSON schema's own rule, enforced by llguidance).

- ``response_format``: ``{"type": "text"}`` no grammar (some SDKs always send it); ``json_object``
  any JSON object; ``json_schema`` JSON valid against ``json_schema.schema`` (a schema llguidance
  cannot compile is a 400 naming ``response_format.json_schema.schema``);
- forced calls (``tool_choice: required`` or a named function): one call in the parser's format
  (serve/tool_parsers.py) to one of the tools (or the named one), its arguments valid against the
  function's ``parameters`` (none given: no arguments, ``{}``). The format's markers are single
  tokens of the family's tokenizer, named as tokens (``<tool_call>``): llguidance matches an added
  token only that way, not by its text.

Compiled grammar texts are cached by their lark source (so by schema). Every problem is an
`ApiError` naming the field.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Optional

from ..runtime import StructuredOutput
from .errors import ApiError
from .tool_parsers import DeepSeekV31Parser, HermesParser

__all__ = ["strict_schema", "json_rule", "response_format_grammar", "forced_call_grammar", "structured",
           "JSON_OPTIONS"]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def strict_schema(schema):
    """A copy of ``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and leaves extra keys unsaid."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        s = stack.pop()
        if not isinstance(s, dict):
            continue
        if "properties" in s and "additionalProperties" not in s and "patternProperties" not in s:
            s["additionalProperties"] = False
        for k in _SUBSCHEMA_LISTS:
            if isinstance(s.get(k), list):
                stack.extend(s[k])
        for k in _SUBSCHEMA_MAPS:
            if isinstance(s.get(k), dict):
                stack.extend(s[k].values())
        stack.extend(s[k] for k in _SUBSCHEMAS if isinstance(s.get(k), dict))
    return schema


def json_rule(schema) -> str:
    """The lark right-hand side of one JSON value valid against the strict ``schema``."""
    s = strict_schema(schema) if isinstance(schema, dict) else schema
    if isinstance(s, dict):
        s = {**s, "x-guidance": JSON_OPTIONS}
    elif s is True:
        s = {"x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(s)


@functools.lru_cache(maxsize=256)
def _compiled(lark: str) -> tuple[Optional[str], Optional[str]]:
    """(llguidance grammar text, None) or (None, the compiler's error): cached by the lark source."""
    import llguidance

    try:
        g = llguidance.LLMatcher.grammar_from_lark(lark)
        err = llguidance.LLMatcher.validate_grammar(g)
    except Exception as e:  # noqa: BLE001 - the compiler's own message
        return None, str(e) or type(e).__name__
    return (None, err) if err else (g, None)


def _grammar(lark: str, param: str) -> str:
    g, err = _compiled(lark)
    if err:
        raise ApiError(f"'{param}' cannot be compiled to a grammar: {err}"[:400], param=param, code="invalid_value")
    return g


def response_format_grammar(rf) -> Optional[str]:
    """The grammar ``response_format`` asks for, or None (absent, or ``text``)."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ApiError("'response_format' must be an object", param="response_format", code="invalid_type")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _grammar("start: " + json_rule({"type": "object"}), "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ApiError("'response_format.json_schema' must be an object with a 'schema'",
                           param="response_format.json_schema", code="invalid_type")
        schema = js.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise ApiError("'response_format.json_schema.schema' must be a JSON schema object",
                           param="response_format.json_schema.schema", code="invalid_type")
        return _grammar("start: " + json_rule(schema), "response_format.json_schema.schema")
    raise ApiError(f"'response_format.type' must be text, json_object or json_schema, got {json.dumps(kind)[:40]}",
                   param="response_format.type", code="invalid_value")


def _parameters(f: dict) -> dict:
    return f.get("parameters") or {"type": "object", "properties": {}}


def forced_call_grammar(parser: str, tools: list, only: Optional[str] = None) -> str:
    """The grammar of one call in ``parser``'s format to one of ``tools`` (or ``only``)."""
    fs = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if parser == "hermes":
        p = HermesParser
        alts = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                 "required": ["name", "arguments"]} for f in fs]
        lark = f'start: {p.START} "\\n" call "\\n" {p.END}\ncall: {json_rule(alts[0] if len(alts) == 1 else {"anyOf": alts})}\n'
    else:
        p = DeepSeekV31Parser
        rules = [f"start: {p.CALLS_BEGIN} {p.CALL_BEGIN} call {p.CALL_END} {p.CALLS_END}",
                 "call: " + " | ".join(f"c{i}" for i in range(len(fs)))]
        for i, f in enumerate(fs):
            rules.append(f"c{i}: {json.dumps(f['name'])} {p.SEP} a{i}")
            rules.append(f"a{i}: {json_rule(_parameters(f))}")
        lark = "\n".join(rules) + "\n"
    return _grammar(lark, "tool_choice")


def structured(grammar: Optional[str], tokenizer_dir: Optional[str], param: str) -> Optional[StructuredOutput]:
    if grammar is None:
        return None
    if not tokenizer_dir:
        raise ApiError(f"'{param}' needs a tokenizer in the checkpoint folder", param=param, code="no_tokenizer")
    return StructuredOutput(grammar, str(tokenizer_dir))
