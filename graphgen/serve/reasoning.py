"""Reasoning parsers: a model's ``<think>…</think>`` becomes the message's ``reasoning`` (vLLM's
field name since its ``reasoning_content`` was removed) instead of ``content``.

`ThinkParser` is an incremental state machine: ``feed(text, final)`` takes the next piece of the
output and returns ``(reasoning, content)`` decided by it; a marker that may still be completing is
held back until it is decided (or ``final``), so the pieces fed in any split add up to the same two
fields. A prompt that already opened the thought (DeepSeek-V3.1 in thinking mode ends its prompt
with ``<think>``; ``opened`` is then true) starts inside it. Without a ``</think>``: the output is
content unless it opened with ``<think>`` (after blank space) or the prompt opened the thought. The
newlines right after ``<think>`` and right after ``</think>`` are dropped, as the chat templates
write them. Named by ``--reasoning-parser NAME`` or the family (``graphgen/families/chat.py``).
"""

from __future__ import annotations

__all__ = ["ThinkParser", "PARSERS", "held_back"]

START, END = "<think>", "</think>"


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkParser:
    def __init__(self, opened: bool = False):
        # "start": nothing decided yet; "think": inside the thought; "answer": content from here
        self.state = "think" if opened else "start"
        self.buf = ""
        self.trim = True  # drop the newlines at the start of the current field

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(START):
                self.state, self.buf = "think", head[len(START):]
            elif final or (head and not START.startswith(head)):  # no thought: all of it is content
                self.state, self.trim = "answer", False
            else:  # blank space, or a part of "<think>": undecided
                return "", ""
        if self.state == "think":
            cut = self.buf.find(END)
            if cut < 0:
                keep = 0 if final else held_back(self.buf, END)
                reasoning = self._take(len(self.buf) - keep, final)
                return reasoning, ""
            reasoning = self._take(cut, True)
            self.buf, self.state, self.trim = self.buf[len(END):], "answer", True
        content = self._take(len(self.buf), final)
        return reasoning, content

    def _take(self, n: int, decided: bool) -> str:
        """``buf[:n]`` out (minus leading newlines while ``trim``); a trimmed all-newline head is
        held unless ``decided``: it may still be followed by text."""
        piece, self.buf = self.buf[:n], self.buf[n:]
        if self.trim:
            stripped = piece.lstrip("\n")
            if not stripped and not decided:
                self.buf = piece + self.buf
                return ""
            piece, self.trim = stripped, not stripped and not decided
        return piece


PARSERS = {"qwen3": ThinkParser, "deepseek_r1": ThinkParser}  # DeepSeek-V3.1 thinks in the R1 format
