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
``transformers.AutoTokenizer.from_pretrained(folder)`` loads. Deterministic: the same corpus and
vocab size give byte-identical files (the modules are read in sorted order).
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["write_tokenizer", "default_corpus", "eos_token", "CHAT_TEMPLATE_SPECIAL", "CHAT_TEMPLATE_PLAIN"]

BYTE_ALPHABET = 256
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _byte_alphabet() -> list[str]:
    """The byte-level pre-tokenizer's 256 characters (GPT-2's bytes -> unicode map), by byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def eos_token(vocab_size: int) -> Optional[tuple[str, int]]:
    """(text, id) of the EOS of the tokenizer `write_tokenizer` writes for ``vocab_size``, or None
    (no tokenizer fits). With the specials: ``<|endoftext|>``, id 0 (the trainer puts specials
    first); a byte vocabulary: the NUL byte's character, at its rank in the sorted alphabet."""
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


def write_tokenizer(out_dir, vocab_size: int, corpus: Optional[Iterable[str]] = None) -> Optional[str]:
    """Write a byte-level BPE tokenizer of exactly ``vocab_size`` tokens into ``out_dir``; returns
    the path of ``tokenizer.json``, or None when ``vocab_size < 256`` (no byte-level tokenizer fits:
    such checkpoints take token-id prompts only). ``corpus``: the texts to train on (default:
    :func:`default_corpus`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < BYTE_ALPHABET:
        return None
    specials = list(SPECIALS) if vocab_size >= BYTE_ALPHABET + len(SPECIALS) else []
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
    eos, eos_id = eos_token(vocab_size)
    if not specials:  # a byte vocabulary: its NUL byte's token is the EOS (marked special, no new id)
        tok.add_special_tokens([eos])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    if tok.token_to_id(eos) != eos_id:
        raise RuntimeError(f"tokenizer's EOS {eos!r} has id {tok.token_to_id(eos)}, expected {eos_id}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path, pretty=False)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "bos_token": None,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE_SPECIAL if specials else CHAT_TEMPLATE_PLAIN,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    return path
