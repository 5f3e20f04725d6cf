"""Tool-call parsers: incremental state machines that never lose a model's text.

A parser is fed the chat output's content text piece by piece (``feed(text, final)``) and returns
the pieces it could decide: ``("content", text)`` or ``("call", name, arguments)``. What is not
decided yet stays in its buffer (a marker that may still be completing, a call whose end has not
come). A call is decided once it closes: it becomes a call when it parses — its name is one of the
request's ``tools`` and its arguments are a JSON object — and otherwise its raw text (markers
included) becomes content, as vLLM returns the raw text when parsing fails. At ``final`` whatever
is still buffered (a call cut off by ``max_tokens``, a marker half written) is content too. So the
pieces are the whole text, in order, minus only the markers of calls that parsed; and since a call
is sent only once decided, the streamed deltas and the whole message are the same pieces — however
the text was split into feeds.

Formats (``--tool-call-parser NAME``, else the spec family's, ``graphgen/families/chat.py``):

- ``hermes`` (Qwen3): ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``, repeatable
  (``"parameters"`` is taken for ``"arguments"``). A final call whose ``</tool_call>`` never came
  but whose JSON is whole is a call (vLLM's regex takes it too).
- ``deepseek_v31`` (DeepSeek-V3.1): ``<｜tool▁calls▁begin｜>`` then per call
  ``<｜tool▁call▁begin｜>N<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``
  (vLLM's ``deepseekv31_tool_parser.py`` reads the same). The outer markers follow the region's
  first call: dropped when it parses, content (both of them) when it does not. Whitespace between
  calls of a region is dropped; other text there is content.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from .reasoning import held_back

__all__ = ["PARSERS", "HermesParser", "DeepSeekV31Parser", "Piece"]

Piece = tuple  # ("content", text) | ("call", name, arguments)


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _arguments_text(body: str, value) -> str:
    """The model's own text of a parsed call's arguments object (``value``) inside ``body``."""
    dec = json.JSONDecoder()
    for m in _ARGS_KEY.finditer(body):
        try:
            got, end = dec.raw_decode(body, m.end())
        except ValueError:
            continue
        if got == value:
            return body[m.end():end]
    return json.dumps(value, ensure_ascii=False)  # not found as written (cannot happen for valid JSON)


class _Parser:
    def __init__(self, names=None):
        self.names = frozenset(names) if names is not None else None  # the request's tools (None: any)
        self.buf = ""

    def known(self, name) -> bool:
        return isinstance(name, str) and bool(name) and (self.names is None or name in self.names)

    def feed(self, text: str, final: bool = False) -> list[Piece]:
        self.buf += text
        out: list[Piece] = []
        while self._step(out, final):
            pass
        if final:  # undecided at the end (cut off, half a marker): the model's text
            out.append(("content", self._flush()))
            self.buf = ""
        return [p for p in out if p[0] == "call" or p[1]]

    def _flush(self) -> str:
        return self.buf

    def _step(self, out: list, final: bool) -> bool:  # decide a prefix of buf; False: wait for more
        raise NotImplementedError

    def _until(self, marker: str, out: list, final: bool) -> bool:
        """Outside the calls: the text before ``marker`` is content (a tail that may still become the
        marker is held); True once the marker was found and dropped from buf."""
        i = self.buf.find(marker)
        if i < 0:
            keep = 0 if final else held_back(self.buf, marker)
            out.append(("content", self.buf[:len(self.buf) - keep]))
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        out.append(("content", self.buf[:i]))
        self.buf = self.buf[i + len(marker):]
        return True


class HermesParser(_Parser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, names=None):
        super().__init__(names)
        self.inside = False  # after a <tool_call> (dropped from buf) whose end has not come

    def _step(self, out: list, final: bool) -> bool:
        if not self.inside:
            self.inside = self._until(self.START, out, final)
            return self.inside
        j = self.buf.find(self.END)
        if j < 0:
            if final:  # no end tag: a call only if its JSON is whole (vLLM's regex takes it)
                call = self._call(self.buf)
                out.append(call if call else ("content", self.START + self.buf))
                self.buf, self.inside = "", False
            return False
        body = self.buf[:j]
        call = self._call(body)
        out.append(call if call else ("content", self.START + body + self.END))
        self.buf, self.inside = self.buf[j + len(self.END):], False
        return True

    def _flush(self) -> str:
        return (self.START if self.inside else "") + self.buf

    def _call(self, body: str) -> Optional[Piece]:
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return None
        if not isinstance(obj, dict) or not self.known(obj.get("name")):
            return None
        args = obj.get("arguments", obj.get("parameters"))
        return ("call", obj["name"], _arguments_text(body, args)) if isinstance(args, dict) else None


class DeepSeekV31Parser(_Parser):
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def __init__(self, names=None):
        super().__init__(names)
        self.region = False  # inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜> (the begin marker dropped from buf)
        self.opened: Optional[str] = None  # how the region's begin marker went: None (undecided), "call", "content"

    def _step(self, out: list, final: bool) -> bool:
        if not self.region:
            self.region, self.opened = self._until(self.CALLS_BEGIN, out, final), None
            return self.region
        end, call = self.buf.find(self.CALLS_END), self.buf.find(self.CALL_BEGIN)
        if end >= 0 and (call < 0 or end < call):  # the region ends
            between = self.buf[:end]
            if self.opened != "call":  # its begin went to content (or no call came): so does its end
                out.append(("content", self._opening() + between + self.CALLS_END))
            elif between.strip():
                out.append(("content", between))
            self.buf, self.region = self.buf[end + len(self.CALLS_END):], False
            return True
        if call < 0:
            return False
        return self._one_call(out, call)

    def _one_call(self, out: list, at: int) -> bool:
        """Decide the call whose begin marker is at ``at`` once its end (or the region's) came."""
        body_at = at + len(self.CALL_BEGIN)
        close = self.buf.find(self.CALL_END, body_at)
        region_end = self.buf.find(self.CALLS_END, body_at)
        if close < 0 and region_end < 0:
            return False
        unclosed = close < 0 or 0 <= region_end < close
        stop = region_end if unclosed else close
        body = self.buf[body_at:stop]
        raw = self.buf[at:stop] + ("" if unclosed else self.CALL_END)
        name, sep, args = body.partition(self.SEP)
        ok = sep and not unclosed and self.known(name.strip()) and _is_object(args)
        between = self.buf[:at]
        if ok:
            if self.opened is None:
                self.opened = "call"
            out.append(("content", between if between.strip() else ""))
            out.append(("call", name.strip(), args))
        else:
            out.append(("content", self._opening() + between + raw))
        self.buf = self.buf[stop if unclosed else close + len(self.CALL_END):]
        return True

    def _opening(self) -> str:
        """The region's begin marker as content, the first time its fate is content."""
        if self.opened is None:
            self.opened = "content"
            return self.CALLS_BEGIN
        return ""

    def _flush(self) -> str:
        return (self._opening() if self.region else "") + self.buf


PARSERS = {"hermes": HermesParser, "deepseek_v31": DeepSeekV31Parser}
