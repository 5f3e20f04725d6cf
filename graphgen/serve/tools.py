"""Tool calling: the request side (``tools``, ``tool_choice``, ``tool`` and assistant ``tool_calls``
messages, checked and handed to the chat template), the tool-call parsers, the forced-call
grammars, and the chat output's assembly (reasoning, content, tool calls; streamed as deltas).

Parsers (``--tool-call-parser NAME``, else the spec family's (``graphgen.runtime.chat_parsers`` — the names
``graphgen/families/chat.py`` gives; switched on by the spec's ``features: [function_call]`` or the flag):

- ``hermes`` (Qwen3): ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``, repeatable;
- ``deepseek_v31`` (DeepSeek-V3.1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>ARGS
  <｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`` (vLLM's ``deepseekv31_tool_parser.py`` reads the same).

``parse(text, final)`` reads the whole output so far and returns ``(content, calls)``, each call
``[name or None, arguments text so far, complete]``; every field only grows as the text grows (a
partial marker at the end is held back), so `ChatOutput` streams the growth of each field as
OpenAI's delta shapes: ``{"role": "assistant"}`` first, ``reasoning_content``/``reasoning``,
``content``, and per call ``{"index", "id", "type": "function", "function": {"name", "arguments": ""}}``
once the name is known, then ``{"index", "function": {"arguments": piece}}``. The arguments are the
model's own JSON text (the same in a stream and in the whole message). A closed hermes block
that is no call stays content; a call cut off by ``max_tokens`` is dropped from the final message.

``tool_choice``: ``auto`` (default with tools) parses; ``none`` shows the tools to the template
but never parses; ``required`` and ``{"type": "function", "function": {"name": N}}`` force a call
in the family's format with an llguidance grammar (`serve/structured.py`) whose arguments follow
the function's ``parameters`` schema.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Optional

from .errors import ApiError
from .reasoning import PARSERS as REASONING_PARSERS, held_back

__all__ = ["PARSERS", "ChatSetup", "ChatOutput", "check_tools",
           "check_messages", "forced_call_lark"]



def _json_value_end(s: str, i: int) -> int:
    """End (exclusive) of the JSON value starting at ``s[i]`` (objects/arrays/strings/scalars), or
    -1 while it is still open."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(s)):
        c = s[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        elif depth == 0 and c in ",}\n " and j > i:
            return j
    return -1


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    _NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
    _ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')

    def parse(self, text: str, final: bool = False):
        content, calls, pos = [], [], 0
        while True:
            start = text.find(self.START, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail if final else tail[:len(tail) - held_back(tail, self.START)])
                break
            content.append(text[pos:start])
            body_at = start + len(self.START)
            end = text.find(self.END, body_at)
            body = text[body_at:] if end < 0 else text[body_at:end]
            call = self._call(body, end >= 0 or final)
            if end >= 0 and not call[2]:  # a closed block that is no call: it stays text
                content.append(text[start:end + len(self.END)])
            else:
                calls.append(call)
            if end < 0:
                break
            pos = end + len(self.END)
        return "".join(content), calls

    def _call(self, body: str, closed: bool):
        m = self._NAME.search(body)
        name = json.loads(f'"{m.group(1)}"') if m else None
        a = self._ARGS.search(body)
        args = ""
        if a:
            end = _json_value_end(body, a.end())
            args = body[a.end():] if end < 0 else body[a.end():end]
            if end < 0 and not closed:
                args = args.rstrip()
        complete = False
        if closed:
            try:
                obj = json.loads(body.strip())
                complete = isinstance(obj, dict) and isinstance(obj.get("name"), str) and \
                    isinstance(obj.get("arguments", obj.get("parameters")), dict)
            except ValueError:
                complete = False
        return [name, args, complete]


class DeepSeekV31Parser:
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def parse(self, text: str, final: bool = False):
        start = text.find(self.CALLS_BEGIN)
        if start < 0:
            return (text if final else text[:len(text) - held_back(text, self.CALLS_BEGIN)]), []
        content = text[:start]
        region = text[start + len(self.CALLS_BEGIN):]
        stop = region.find(self.CALLS_END)
        after = ""
        if stop >= 0:
            region, after = region[:stop], region[stop + len(self.CALLS_END):]
        calls = []
        for chunk in region.split(self.CALL_BEGIN)[1:]:
            closed = self.CALL_END in chunk
            chunk = chunk.split(self.CALL_END)[0]
            if self.SEP not in chunk:
                calls.append([None, "", False])
                continue
            name, args = chunk.split(self.SEP, 1)
            if not closed and not final:
                args = args[:len(args) - held_back(args, self.CALL_END)]
            ok = False
            if closed or final:
                try:
                    ok = isinstance(json.loads(args), dict)
                except ValueError:
                    ok = False
            calls.append([name.strip(), args, ok])
        return content + after, calls


PARSERS = {"hermes": HermesParser, "deepseek_v31": DeepSeekV31Parser}


class ChatSetup:
    """What the server was started with: the parsers' names (None: off)."""

    def __init__(self, tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None):
        if tool_parser is not None and tool_parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_parser!r} (known: {', '.join(PARSERS)})")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r} (known: {', '.join(REASONING_PARSERS)})")
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser


def check_tools(body: dict, setup: Optional[ChatSetup]):
    """(tools for the template or None, tool_choice: "none"/"auto"/"required"/a function name)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError("'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        return None, "none"
    if not isinstance(tools, list):
        raise ApiError("'tools' must be a list", param="tools", code="invalid_type")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(f, dict)
                and isinstance(f.get("name"), str) and f["name"]):
            raise ApiError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}",
                           param=f"tools[{i}]", code="invalid_type")
        if not isinstance(f.get("parameters", {}), dict):
            raise ApiError(f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters", code="invalid_type")
    if setup is None or setup.tool_parser is None:
        raise ApiError("'tools' needs a tool-call parser: start the server with --tool-call-parser NAME "
                       f"({', '.join(PARSERS)}) or a spec with features: [function_call]", param="tools",
                       code="no_tool_parser")
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        f = choice.get("function")
        if not (choice.get("type") == "function" and isinstance(f, dict) and isinstance(f.get("name"), str)):
            raise ApiError("'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                           "{'name': ...}}", param="tool_choice", code="invalid_value")
        if f["name"] not in names:
            raise ApiError(f"'tool_choice' names {f['name']!r}, which is not in 'tools'", param="tool_choice",
                           code="invalid_value")
        choice = ("function", f["name"])
    elif choice not in ("none", "auto", "required"):
        raise ApiError("'tool_choice' must be none, auto, required or a named function", param="tool_choice",
                       code="invalid_value")
    return tools, choice


def forced_call_lark(parser: str, tools: list, only: Optional[str] = None) -> str:
    """A lark grammar (llguidance's, with ``%json``) for one call in the parser's format, to one of
    ``tools`` (or ``only``), arguments valid against its ``parameters``. The format's markers are
    single tokens of the family's tokenizer, named as tokens (``<tool_call>``): llguidance matches
    an added token only that way, not by its text."""
    fs = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if parser == "hermes":
        p = HermesParser
        alts = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  "arguments": f.get("parameters") or {"type": "object"}},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in fs]
        schema = alts[0] if len(alts) == 1 else {"anyOf": alts}
        return f'start: {p.START} "\\n" call "\\n" {p.END}\ncall: %json {json.dumps(schema)}\n'
    p = DeepSeekV31Parser
    rules = [f"start: {p.CALLS_BEGIN} {p.CALL_BEGIN} call {p.CALL_END} {p.CALLS_END}",
             "call: " + " | ".join(f"c{i}" for i in range(len(fs)))]
    for i, f in enumerate(fs):
        rules.append(f"c{i}: {json.dumps(f['name'])} {p.SEP} a{i}")
        rules.append(f"a{i}: %json {json.dumps(f.get('parameters') or {'type': 'object'})}")
    return "\n".join(rules) + "\n"


def check_messages(msgs) -> list[dict]:
    """Messages for the chat template: system/user/developer/assistant/tool, text content (a string
    or text parts), assistant ``tool_calls`` (``content`` may then be null), ``reasoning_content``."""
    if not (isinstance(msgs, list) and msgs):
        raise ApiError("'messages' must be a non-empty list", param="messages", code="invalid_type")
    clean = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"{where} must be an object with a string 'role'", param=where, code="invalid_type")
        role, content = m["role"], m.get("content")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise ApiError(f"{where}.role {role!r} is not one of system, user, assistant, developer, tool",
                           param=f"{where}.role", code="invalid_value")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str)
                       for x in content):
                raise ApiError(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                               param=f"{where}.content", code="unsupported_value")
            content = "".join(x["text"] for x in content)
        out = {"role": role}
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            if not isinstance(calls, list):
                raise ApiError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls", code="invalid_type")
            for j, c in enumerate(calls):
                f = c.get("function") if isinstance(c, dict) else None
                if not (isinstance(f, dict) and isinstance(f.get("name"), str)
                        and isinstance(f.get("arguments"), (str, dict))):
                    raise ApiError(f"{where}.tool_calls[{j}] must have function.name and function.arguments",
                                   param=f"{where}.tool_calls[{j}]", code="invalid_type")
            out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                  "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                                 for c in calls]
            if content is None:
                content = ""
        if not isinstance(content, str):
            raise ApiError(f"{where} must have a string 'content'", param=f"{where}.content", code="invalid_type")
        out["content"] = content
        if role == "tool":
            tid = m.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise ApiError(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id",
                               code="invalid_type")
            out["tool_call_id"] = tid
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            out["reasoning_content"] = m["reasoning_content"]
        clean.append(out)
    return clean


class ChatOutput:
    """One chat choice's text → reasoning, content and tool calls; ``delta(text)`` gives the streamed
    chunk's new parts, ``message(text)`` the whole message."""

    def __init__(self, tool_parser: Optional[str], reasoning_parser: Optional[str], opened_thought: bool):
        self.tools = PARSERS[tool_parser]() if tool_parser else None
        self.reasoning = REASONING_PARSERS[reasoning_parser](opened_thought) if reasoning_parser else None
        self.sent = {"reasoning": 0, "content": 0}
        self.calls_sent: list[list] = []  # per call: [id, header sent, arguments sent]

    def _parse(self, text: str, final: bool):
        reasoning, rest = self.reasoning.split(text, final) if self.reasoning else ("", text)
        content, calls = self.tools.parse(rest, final) if self.tools else (rest, [])
        if final:  # a call that never closed, or whose arguments are no JSON object, is dropped
            calls = [c for c in calls if c[2]]
        return reasoning, content, calls

    def delta(self, text: str, final: bool) -> dict:
        reasoning, content, calls = self._parse(text, final)
        d = {}
        r = reasoning[self.sent["reasoning"]:]
        if r:
            d["reasoning_content"] = d["reasoning"] = r
            self.sent["reasoning"] = len(reasoning)
        c = content[self.sent["content"]:]
        if c:
            d["content"] = c
            self.sent["content"] = len(content)
        out = []
        for i, (name, args, _complete) in enumerate(calls):
            if i >= len(self.calls_sent):
                self.calls_sent.append([f"call_{secrets.token_hex(12)}", False, 0])
            st = self.calls_sent[i]
            if name is None:
                continue
            piece = {"index": i}
            if not st[1]:
                piece.update(id=st[0], type="function", function={"name": name, "arguments": ""})
                st[1] = True
            a = args[st[2]:]
            if a:
                piece.setdefault("function", {})["arguments"] = a
                st[2] = len(args)
            if len(piece) > 1:
                out.append(piece)
        if out:
            d["tool_calls"] = out
        return d

    def message(self, text: str) -> tuple[dict, bool]:
        reasoning, content, calls = self._parse(text, True)
        msg = {"role": "assistant", "content": content if (content or not calls) else None}
        if self.reasoning is not None:
            msg["reasoning_content"] = msg["reasoning"] = reasoning or None
        if calls:
            msg["tool_calls"] = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                                  "function": {"name": n, "arguments": a}} for n, a, _ in calls]
        return msg, bool(calls)
