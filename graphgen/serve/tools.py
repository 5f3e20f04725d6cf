"""Tool calling, the request side: ``tools``, ``tool_choice``, and the ``tool`` / assistant
``tool_calls`` messages, checked and handed to the chat template.

``tool_choice``: ``auto`` (default with tools) parses the output (serve/tool_parsers.py, through
serve/chat_output.py); ``none`` shows the tools to the template but never parses; ``required`` and
``{"type": "function", "function": {"name": N}}`` force a call in the family's format with a
grammar (serve/structured.py, `forced_call_grammar`) whose arguments follow the function's
``parameters``. An assistant message's thought may come as ``reasoning`` (vLLM's name) or
``reasoning_content`` (the chat templates read it under that name).
"""

from __future__ import annotations

from typing import Optional

from .errors import ApiError
from .reasoning import PARSERS as REASONING_PARSERS
from .tool_parsers import PARSERS

__all__ = ["PARSERS", "ChatSetup", "check_tools", "check_messages"]


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
        thought = m.get("reasoning", m.get("reasoning_content")) if role == "assistant" else None
        if isinstance(thought, str):
            out["reasoning_content"] = thought  # the templates' name
        clean.append(out)
    return clean
