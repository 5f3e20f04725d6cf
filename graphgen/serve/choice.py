"""One choice of a request: its tokens, its text (detokenized incrementally), stop strings, chat
parsing and logprobs.

`Detokenizer` turns a growing token list into text at a cost per new token bounded by a small
window, not by the choice's length (vLLM's prefix/read offsets): it decodes ``ids[prefix:]`` and
``ids[prefix:read]`` and emits the difference once it does not end in an incomplete UTF-8 sequence
(U+FFFD), then slides the window. Special tokens are skipped (EOS is not text, as vLLM), so the
pieces add up to ``tokenizer.decode(ids, skip_special_tokens=True)``.

`Choice.feed(output)` takes the engine's next `RequestOutput` and returns the text it releases:
stop strings are searched in the text not released yet (released text never ends with the start
of a stop string: that tail is held back, so a stop cannot straddle the two), so each feed costs
the new text, not the whole. A stop string ends the choice (``stopped``: the server aborts its
engine request, and it counts as ``stop``); with chat parsing the released text goes through
`ChatOutput` (serve/chat_output.py), whose delta the stream sends.
"""

from __future__ import annotations

from typing import Optional

from .chat_output import ChatOutput
from .engine_api import RequestOutput
from .logprobs import LogprobFormatter
from .sampling_fields import FanOut
from .protocol import TextRules
from .stops import first_stop, holdback

__all__ = ["Choice", "Detokenizer"]


class Detokenizer:
    def __init__(self, tokenizer, skip_special: bool = True):
        self.tok, self.skip = tokenizer, skip_special
        self.ids: list[int] = []
        self.prefix = 0  # start of the window: the text before it is out
        self.read = 0  # the tokens before it are decoded into the text out

    def push(self, new_ids, final: bool = False) -> str:
        """The text ``new_ids`` complete (held while it ends in half a character, unless ``final``)."""
        self.ids.extend(new_ids)
        if self.read == len(self.ids):
            return ""
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip)
        text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=self.skip)
        if len(text) <= len(before) and not final:
            return ""
        if text.endswith("\ufffd") and not final:
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


class Choice:
    """One prompt's output: tokens, released text (stop strings held back), chat parsing, logprobs."""

    def __init__(self, index: int, prompt=(), tokenizer=None, stops=(), fan: FanOut = FanOut(), copy: int = 0,
                 fmt: Optional[LogprobFormatter] = None, chat: Optional[dict] = None, rules: TextRules = TextRules()):
        self.index, self.prompt, self.prompt_len, self.copy = index, tuple(prompt), len(prompt), copy
        self.tok, self.stops, self.fan, self.rules = tokenizer, tuple(stops), fan, rules
        self.fmt = fmt or LogprobFormatter(tokenizer)
        self.detok = Detokenizer(tokenizer, rules.skip_special) if tokenizer is not None else None
        self.chat = ChatOutput(**chat) if chat else None  # tool calls / reasoning
        self.tokens: list[int] = []
        self.pieces: list[str] = []  # the released text, in pieces
        self.unsent = ""  # decoded, held back (it may still become a stop string)
        self.lps: list = []  # per generated token: the engine's logprob entry (when asked)
        self.new_lps: list = []  # entries of the last feed's tokens (streaming)
        self.prompt_lps: Optional[tuple] = None  # echo with logprobs: per prompt token
        self.echo_text: Optional[str] = None  # echo: the prompt's text (decoded at the first output)
        self.offset = 0  # text offset of the next streamed token (completions logprobs)
        self.chat_delta: dict = {}  # the last feed's chat delta
        self.finish_reason: Optional[str] = None
        self.cached = 0
        self.error: Optional[str] = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, o: RequestOutput) -> tuple[str, list[int], bool]:
        """(released text, new token ids, stopped by the server: a stop string, or the first tool
        call with ``parallel_tool_calls: false``). Detokenizes: called off the event loop."""
        new = [] if self.fan.drop_generated else list(o.new_token_ids)  # max_tokens 0 (echo)
        self.tokens.extend(new)
        self.new_lps = [] if self.fan.drop_generated else list(o.logprobs or ())
        self.lps.extend(self.new_lps)
        if o.prompt_logprobs is not None:
            self.prompt_lps = o.prompt_logprobs
        self.cached = max(self.cached, o.num_cached_tokens)
        if self.detok is None:
            self._finish(o, False)
            return "", new, False
        if self.fan.echo and self.echo_text is None:
            self.echo_text = self.tok.decode(list(self.prompt))
        delta, stopped = self._release(self.detok.push(new, final=o.finished), o.finished)
        if self.chat is not None:
            self.chat_delta = self.chat.feed(delta, final=stopped or o.finished)
            stopped = stopped or self.chat.ended
        self._finish(o, stopped)
        return delta, new, stopped

    def _release(self, text: str, finished: bool) -> tuple[str, bool]:
        buf = self.unsent + text
        if self.stops and len(self.tokens) > self.fan.min_tokens:
            cut, stop = first_stop(buf, self.stops)
            if cut >= 0:
                cut += len(stop) if self.rules.include_stop else 0
                self.unsent = ""
                self.pieces.append(buf[:cut])
                return buf[:cut], True
        keep = 0 if finished else holdback(buf, self.stops)
        out, self.unsent = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self.pieces.append(out)
        return out, False

    def _finish(self, o: RequestOutput, stopped: bool) -> None:
        if stopped:
            self.finish_reason = "stop"
        elif o.finished:
            self.finish_reason, self.error = o.finish_reason, o.error

    def client_finish_reason(self) -> Optional[str]:
        """What the client sees: ``tool_calls`` for a chat choice that ended with calls."""
        if self.finish_reason == "stop" and self.chat is not None and self.chat.calls:
            return "tool_calls"
        return self.finish_reason

    # ---- logprobs (shapes in logprobs.py) ----
    def _echoed(self, ids, entries):
        return [*self.prompt, *ids], [*(self.prompt_lps or (None,) * len(self.prompt)), *entries]

    def full_logprobs(self, chat: bool) -> Optional[dict]:
        if self.fan.logprobs is None:
            return None
        if chat:
            return self.fmt.chat(self.lps)
        if self.fan.echo:
            return self.fmt.completion(*self._echoed(self.tokens, self.lps))
        return self.fmt.completion(self.tokens, self.lps)

    def chunk_logprobs(self, new_ids: list, first: bool, chat: bool) -> Optional[dict]:
        """The logprobs of a streamed chunk: its new tokens (and the echoed prompt in the first)."""
        if self.fan.logprobs is None:
            return None
        if chat:
            return self.fmt.chat(self.new_lps)
        ids, entries = list(new_ids), list(self.new_lps)
        if first and self.fan.echo:
            ids, entries = self._echoed(ids, entries)
        out = self.fmt.completion(ids, entries, self.offset)
        self.offset += sum(len(t) for t in out["tokens"])
        return out
