"""One chat choice's output text -> reasoning, content and tool calls, by one state machine that
feeds both the streamed deltas and the whole message.

`ChatOutput.feed(text, final)` takes the next piece of the choice's text (what the server released:
stop strings cut, a possible stop held back) and returns the OpenAI delta of what it decided:
``reasoning`` (serve/reasoning.py) and then, from the rest, ``content`` and ``tool_calls``
(serve/tool_parsers.py). A tool call goes out whole, once it closed and parsed, as one delta
``{"index", "id", "type": "function", "function": {"name", "arguments"}}``: a stream never sends a
call it would have to take back. `message()` is the sum of everything fed, so a non-streamed answer
is exactly what a client merging the deltas has. ``parallel_tool_calls: false``: the output ends
with the first call (`ended`; the server then stops the request, as at a stop string).
``include_reasoning: false``: the thought is still parsed out of the content, but not returned.
"""

from __future__ import annotations

import secrets
from typing import Optional

from .reasoning import PARSERS as REASONING_PARSERS
from .tool_parsers import PARSERS as TOOL_PARSERS

__all__ = ["ChatOutput"]


class ChatOutput:
    def __init__(self, tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
                 opened_thought: bool = False, tool_names=None, parallel_tool_calls: bool = True,
                 include_reasoning: bool = True):
        self.tools = TOOL_PARSERS[tool_parser](tool_names) if tool_parser else None
        self.thinking = REASONING_PARSERS[reasoning_parser](opened_thought) if reasoning_parser else None
        self.parallel, self.include_reasoning = parallel_tool_calls, include_reasoning
        self.reasoning, self.content = "", ""
        self.calls: list[dict] = []  # OpenAI tool_calls entries, in order
        self.ended = False  # the first call came and parallel_tool_calls is false: nothing after it

    def feed(self, text: str, final: bool) -> dict:
        """The delta of this piece: ``reasoning``, ``content`` and ``tool_calls`` where non-empty."""
        if self.ended:
            return {}
        reasoning, rest = self.thinking.feed(text, final) if self.thinking else ("", text)
        pieces = self.tools.feed(rest, final) if self.tools else [("content", rest)]
        d: dict = {}
        if reasoning and self.include_reasoning:
            d["reasoning"] = reasoning
            self.reasoning += reasoning
        for p in pieces:
            if self.ended:
                break
            if p[0] == "content":
                d["content"] = d.get("content", "") + p[1]
                self.content += p[1]
                continue
            call = {"id": f"call_{secrets.token_hex(12)}", "type": "function",
                    "function": {"name": p[1], "arguments": p[2]}}
            d.setdefault("tool_calls", []).append({"index": len(self.calls), **call})
            self.calls.append(call)
            self.ended = not self.parallel
        if not d.get("content"):
            d.pop("content", None)
        return d

    def message(self) -> tuple[dict, bool]:
        """The whole message (everything fed so far) and whether it made tool calls."""
        msg = {"role": "assistant", "content": self.content if (self.content or not self.calls) else None}
        if self.thinking is not None and self.include_reasoning:
            msg["reasoning"] = self.reasoning or None
        if self.calls:
            msg["tool_calls"] = [dict(c) for c in self.calls]
        return msg, bool(self.calls)
