"""``response_format`` (and forced tool calls) as llguidance grammars: the server's half of
structured output. The engine's half (`graphgen.runtime.StructuredOutput`, a per-request matcher
masking the logits before sampling) lives in ``runtime/engine/grammar.py``.

- ``{"type": "text"}``: no grammar (some SDKs always send it);
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``: JSON
  valid against the schema (llguidance's JSON-schema compiler; a schema it cannot compile is a 400
  naming ``response_format.json_schema.schema``).

JSON is compiled without flexible whitespace (compact separators), so a model cannot spend its
tokens on blank space. Every problem is an `ApiError` naming the field.
"""

from __future__ import annotations

import json
from typing import Optional

from ..runtime import StructuredOutput
from .errors import ApiError

__all__ = ["response_format_grammar", "lark_grammar", "structured"]

_JSON_OPTIONS = {"whitespace_flexible": False}


def _check(grammar: str, param: str) -> str:
    import llguidance

    try:
        err = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as e:  # noqa: BLE001 - the compiler's own message
        err = str(e)
    if err:
        raise ApiError(f"'{param}' cannot be compiled to a grammar: {err}"[:400], param=param, code="invalid_value")
    return grammar


def json_schema_grammar(schema, param: str) -> str:
    import llguidance

    try:
        g = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except Exception as e:  # noqa: BLE001
        raise ApiError(f"'{param}' is not a usable JSON schema: {e}"[:400], param=param, code="invalid_value") from None
    return _check(g, param)


def lark_grammar(lark: str, param: str) -> str:
    import llguidance

    try:
        g = llguidance.LLMatcher.grammar_from_lark(lark)
    except Exception as e:  # noqa: BLE001
        raise ApiError(f"'{param}' cannot be compiled to a grammar: {e}"[:400], param=param, code="invalid_value") from None
    return _check(g, param)


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
        return json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ApiError("'response_format.json_schema' must be an object with a 'schema'",
                           param="response_format.json_schema", code="invalid_type")
        schema = js.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise ApiError("'response_format.json_schema.schema' must be a JSON schema object",
                           param="response_format.json_schema.schema", code="invalid_type")
        return json_schema_grammar(json.dumps(schema), "response_format.json_schema.schema")
    raise ApiError(f"'response_format.type' must be text, json_object or json_schema, got {json.dumps(kind)[:40]}",
                   param="response_format.type", code="invalid_value")


def structured(grammar: Optional[str], tokenizer_dir: Optional[str], param: str) -> Optional[StructuredOutput]:
    if grammar is None:
        return None
    if not tokenizer_dir:
        raise ApiError(f"'{param}' needs a tokenizer in the checkpoint folder", param=param, code="no_tokenizer")
    return StructuredOutput(grammar, str(tokenizer_dir))
