"""Stop strings: the server matches them on detokenized text (only the server has text) and aborts
the request when one appears; the engine handles stop *tokens*."""
from __future__ import annotations

from typing import Sequence

__all__ = ["find_stop", "first_stop", "holdback"]


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str]:
    """(index, stop string) of the earliest stop string in ``text`` (the longest at that index), or (-1, "")."""
    hits = [(text.find(s), -len(s), s) for s in stops if s and s in text]
    if not hits:
        return -1, ""
    i, _, s = min(hits)
    return i, s


def find_stop(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest stop string in ``text``, or -1."""
    return first_stop(text, stops)[0]


def holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` to hold back while streaming: the longest tail that
    is a proper prefix of some stop string (it may still become a stop), plus an undecodable tail."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    tail = len(text) - len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence decodes to U+FFFD
    return max(n, tail)
