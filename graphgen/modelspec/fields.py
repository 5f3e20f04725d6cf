"""Field metadata shared by every spec dataclass (the spec model and the family dims).

Kept apart from ``model.py`` so the family modules (``graphgen.families``) can declare their dims
with the same metadata without importing the spec model, which imports them.
"""

from __future__ import annotations


def doc(text: str, **extra) -> dict:
    """``metadata`` of a spec field: its documentation plus rules the loader and schema read."""
    return {"doc": text, **extra}
