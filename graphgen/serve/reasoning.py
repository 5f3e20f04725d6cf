"""Reasoning parsers: a model's ``<think>…</think>`` becomes ``reasoning_content`` (and
``reasoning``, the name newer clients read) instead of ``content``.

`ThinkParser.split(text, final)` parses the whole output so far and gives ``(reasoning, content)``;
both only ever grow as the text grows (a partial ``</think>`` at the end is held back until it is
decided, unless ``final``), so the streaming deltas are the growth of each field. A prompt that
already opened the thought (DeepSeek-V3.1 in thinking mode ends its prompt with ``<think>``;
``opened`` is then true) starts inside it. Without a ``</think>``: Qwen3's parser
(``qwen3``) calls the output content unless it opened with ``<think>``; DeepSeek's (``deepseek_v3``,
``deepseek_r1``) calls it reasoning when the prompt opened the thought. Named by
``--reasoning-parser NAME`` or the family (``graphgen/families/chat.py``).
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
        self.opened = opened  # the prompt ends inside a thought

    def split(self, text: str, final: bool = False) -> tuple[str, str]:
        inside = self.opened
        body = text
        stripped = text.lstrip()
        if stripped.startswith(START):
            inside, body = True, stripped[len(START):]
        elif not inside and not final and START.startswith(stripped) and stripped:
            return "", ""  # could still become "<think>"
        if not inside:
            return "", text
        cut = body.find(END)
        if cut < 0:
            keep = len(body) if final else len(body) - held_back(body, END)
            return body[:keep].lstrip("\n"), ""
        return body[:cut].lstrip("\n"), body[cut + len(END):].lstrip("\n")


PARSERS = {"qwen3": ThinkParser, "deepseek_r1": ThinkParser}  # DeepSeek-V3.1 thinks in the R1 format
