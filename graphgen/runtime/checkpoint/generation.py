"""A checkpoint's end-of-sequence ids: where ``graphgen run`` and ``graphgen serve`` stop.

``eos_token_ids(ckpt_dir)`` reads ``generation_config.json``'s ``eos_token_id`` over
``config.json``'s (an int or a list: Qwen3 ships two, ``<|im_end|>`` and ``<|endoftext|>``) and adds
the tokenizer's own EOS (``tokenizer_config.json``'s ``eos_token``, looked up in ``tokenizer.json``),
de-duplicated, in that order. No torch, no transformers: plain JSON files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

__all__ = ["eos_token_ids", "tokenizer_eos_id", "load_tokenizer"]


def _read(path: Path) -> Optional[dict]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _ids(v) -> list[int]:
    if isinstance(v, bool):
        return []
    if isinstance(v, int):
        return [v] if v >= 0 else []
    if isinstance(v, (list, tuple)):
        return [t for t in v if isinstance(t, int) and not isinstance(t, bool) and t >= 0]
    return []


def tokenizer_eos_id(ckpt_dir) -> Optional[int]:
    """The id of ``tokenizer_config.json``'s ``eos_token`` in ``tokenizer.json`` (added tokens first,
    then the model's vocab), or None."""
    d = Path(ckpt_dir)
    cfg = _read(d / "tokenizer_config.json") or {}
    eos = cfg.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str) or not eos:
        return None
    tok = _read(d / "tokenizer.json") or {}
    for a in tok.get("added_tokens") or ():
        if isinstance(a, dict) and a.get("content") == eos and isinstance(a.get("id"), int):
            return a["id"]
    for a in (cfg.get("added_tokens_decoder") or {}).items():
        k, v = a
        if isinstance(v, dict) and v.get("content") == eos and str(k).isdigit():
            return int(k)
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(eos), int):
        return vocab[eos]
    return None


def eos_token_ids(ckpt_dir) -> list[int]:
    """Every EOS id of the checkpoint in ``ckpt_dir``: ``generation_config.json`` over
    ``config.json`` (either may give an int or a list), then the tokenizer's EOS; [] when none."""
    d = Path(ckpt_dir)
    gen = _read(d / "generation_config.json") or {}
    ids = _ids(gen.get("eos_token_id"))
    if not ids:
        ids = _ids((_read(d / "config.json") or {}).get("eos_token_id"))
    tok = tokenizer_eos_id(d)
    if tok is not None:
        ids.append(tok)
    return list(dict.fromkeys(ids))


def load_tokenizer(ckpt_dir):
    """The checkpoint folder's tokenizer (``transformers.AutoTokenizer``), or None when it has none."""
    d = Path(ckpt_dir)
    if not ((d / "tokenizer.json").exists() or (d / "tokenizer_config.json").exists()):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def chat_parsers(family: str) -> tuple:
    """``(tool_parser, reasoning_parser)`` names of the family's chat format (``(None, None)``
    without one): the family module is their one home (`graphgen.families.chat`)."""
    from ...families.chat import chat_format

    fmt = chat_format(family)
    return (fmt.tool_parser, fmt.reasoning_parser) if fmt is not None else (None, None)
