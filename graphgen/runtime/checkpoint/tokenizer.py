"""A tokenizer for the random checkpoints, so text prompts work end to end.

Byte-level BPE trained with ``tokenizers`` on the package's own prose (every docstring of
``graphgen/``: a wheel ships it as a checkout does, so both train the same tokenizer; the
repository's ``docs/`` are not in a wheel), to **exactly** the model's vocabulary size: 256 byte
tokens (any text is encodable), then, when the vocabulary has room, the special tokens, then
merges; if the text runs out of merges the rest is filled with ``<|reserved_N|>`` specials. A
vocabulary of exactly 256 (the tiny specs) is the byte alphabet alone: no merges, and one special
token, the EOS: the NUL byte's token (``Ā`` in the byte-level alphabet; text never contains NUL) —
the chat template then uses plain-text markers. :func:`eos_token` gives the EOS (text and id) of a
vocabulary size without the ``tokenizers`` package; ``write_random_hf_checkpoint`` writes that id as
``eos_token_id``. Saved as ``tokenizer.json`` + ``tokenizer_config.json`` (with a chat template), which
``transformers.AutoTokenizer.from_pretrained(folder)`` loads. With a ``family`` that has a chat format
(``graphgen/families/chat.py``) and a vocabulary of at least ``FAMILY_VOCAB`` (512) tokens, the
tokenizer instead carries that family's real special tokens (BOS/EOS, ``<|im_start|>``, ``<think>``,
``<tool_call>``, DeepSeek's tool-call tokens: ids 0.. in the table's order; the "text tokens" are not
special, so they survive detokenization for the tool and reasoning parsers) and its chat template.
Deterministic: the same corpus and
vocab size give byte-identical files (the modules are read in sorted order).
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["write_tokenizer", "default_corpus", "eos_token", "eos_token_ids_of", "CHAT_TEMPLATE_SPECIAL",
           "CHAT_TEMPLATE_PLAIN", "FAMILY_VOCAB"]

BYTE_ALPHABET = 256
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
FAMILY_VOCAB = 512  # from this vocabulary size on, a family's own special tokens and chat template


def _family_chat(vocab_size: int, family: Optional[str]):
    if family is None or vocab_size < FAMILY_VOCAB:
        return None
    from ...families.chat import chat_format

    return chat_format(family)


def _byte_alphabet() -> list[str]:
    """The byte-level pre-tokenizer's 256 characters (GPT-2's bytes -> unicode map), by byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _tokens(fmt) -> list[str]:
    return list(fmt.specials) + list(fmt.text_tokens)


def eos_token_ids_of(vocab_size: int, family: Optional[str] = None) -> list[int]:
    """Every EOS id of the tokenizer `write_tokenizer` writes (``config.json``'s ``eos_token_id``):
    a family format's EOS tokens (Qwen3: ``<|im_end|>``, ``<|endoftext|>``), else `eos_token`'s."""
    fmt = _family_chat(vocab_size, family)
    if fmt is not None:
        return [_tokens(fmt).index(e) for e in fmt.eos]
    eos = eos_token(vocab_size)
    return [eos[1]] if eos else []


def eos_token(vocab_size: int, family: Optional[str] = None) -> Optional[tuple[str, int]]:
    """(text, id) of the EOS of the tokenizer `write_tokenizer` writes for ``vocab_size``, or None
    (no tokenizer fits). A family format: its first EOS; with the specials: ``<|endoftext|>``, id 0
    (the trainer puts specials first); a byte vocabulary: the NUL byte's character, at its rank in
    the sorted alphabet."""
    fmt = _family_chat(vocab_size, family)
    if fmt is not None:
        return fmt.eos[0], _tokens(fmt).index(fmt.eos[0])
    if vocab_size < BYTE_ALPHABET:
        return None
    if vocab_size >= BYTE_ALPHABET + len(SPECIALS):
        return SPECIALS[0], 0
    alphabet = _byte_alphabet()
    return alphabet[0], sorted(alphabet).index(alphabet[0])

# The ChatML layout when the specials exist; plain-text role markers otherwise (byte vocabularies).
CHAT_TEMPLATE_SPECIAL = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_TEMPLATE_PLAIN = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}")


def default_corpus() -> list[str]:
    """The docstrings of every module, class and function of the graphgen package (modules sorted by
    their path inside it, so training is reproducible and independent of where it is installed)."""
    package = Path(__file__).resolve().parents[2]
    texts = []
    for path in sorted(package.rglob("*.py"), key=lambda p: p.relative_to(package).as_posix()):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    return texts


def write_tokenizer(out_dir, vocab_size: int, corpus: Optional[Iterable[str]] = None,
                    family: Optional[str] = None) -> Optional[str]:
    """Write a byte-level BPE tokenizer of exactly ``vocab_size`` tokens into ``out_dir``; returns
    the path of ``tokenizer.json``, or None when ``vocab_size < 256`` (no byte-level tokenizer fits:
    such checkpoints take token-id prompts only). ``corpus``: the texts to train on (default:
    :func:`default_corpus`). ``family``: its chat format's tokens and template (vocab >= 512)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < BYTE_ALPHABET:
        return None
    fmt = _family_chat(vocab_size, family)
    specials = (_tokens(fmt) if fmt is not None else
                list(SPECIALS) if vocab_size >= BYTE_ALPHABET + len(SPECIALS) else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    texts = list(default_corpus() if corpus is None else corpus)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    short = vocab_size - tok.get_vocab_size()
    if short > 0:  # the corpus ran out of merges: fill with reserved specials
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    eos, eos_id = eos_token(vocab_size, family)
    if not specials:  # a byte vocabulary: its NUL byte's token is the EOS (marked special, no new id)
        tok.add_special_tokens([eos])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    if tok.token_to_id(eos) != eos_id:
        raise RuntimeError(f"tokenizer's EOS {eos!r} has id {tok.token_to_id(eos)}, expected {eos_id}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path, pretty=False)
    if fmt is not None:  # the family's text tokens: single tokens, but not skipped when detokenizing
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        for a in doc["added_tokens"]:
            if a["content"] in fmt.text_tokens:
                a["special"] = False
        Path(path).write_text(json.dumps(doc, ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "bos_token": fmt.bos if fmt is not None else None,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": None,
        "chat_template": (fmt.chat_template if fmt is not None else
                          CHAT_TEMPLATE_SPECIAL if specials else CHAT_TEMPLATE_PLAIN),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return path
