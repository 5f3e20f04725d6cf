"""The per-token cost of a JSON-schema mask (llguidance), side by side with the same decode loop unmasked.

For each tokenizer (the tiny chat spec's 512-token vocabulary, and byte-level BPE vocabularies
trained here on the installed packages' Python sources, since no real tokenizer can be downloaded
offline), one "decode" loop of ``--tokens`` steps over random logits of that width:

- unmasked: ``argmax`` of the row (what the engine's greedy sampler costs without a grammar);
- masked: ``graphgen.runtime.engine.grammar.guided_sample`` — llguidance computes the allowed-token
  bitmask for the request's matcher, applies it to a copy of the row, the row is sampled and the
  matcher advanced — exactly the engine's per-step call, on a request whose grammar is the schema's.

A grammar that completes starts again with a fresh request (its matcher's creation is timed
apart: once per request, not per token), so every measured step is mid-JSON. Prints one row per
vocabulary: µs per token masked and unmasked, the difference (the mask's cost), the ratio, and the
matcher's creation per request. Run: ``PYTHONPATH=. python benchmarks/bench_structured.py [--tokens 400]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 6},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
}, "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def _corpus(limit_bytes: int):
    """Python sources of the installed packages (torch, transformers): real code text, offline."""
    import transformers
    roots = [Path(torch.__file__).parent, Path(transformers.__file__).parent]
    total = 0
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            try:
                text = f.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            total += len(text)
            yield text
            if total >= limit_bytes:
                return


def trained_tokenizer(vocab: int, out: Path, corpus_mb: int) -> Path:
    """A byte-level BPE tokenizer of ``vocab`` tokens (+ an EOS) saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(corpus_mb << 20), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    return out


def chat_tokenizer(out: Path) -> Path:
    """The tokenizer a random checkpoint of specs/tiny_qwen3_chat.yaml gets (vocab 512)."""
    from graphgen.modelspec.loader import load_spec
    from graphgen.runtime.checkpoint.tokenizer import write_tokenizer

    spec = load_spec(Path(__file__).resolve().parents[1] / "specs" / "tiny_qwen3_chat.yaml")
    write_tokenizer(out, spec.dims.vocab_size, family=spec.family)
    return out


class _Req:
    """The two fields `guided_sample` reads from an engine request."""

    def __init__(self, sampling, n):
        self.sampling, self.req_id, self.sampler = sampling, n, None


def measure(tok_dir: Path, n_vocab: int, tokens: int, seed: int = 0) -> dict:
    from graphgen.runtime import SamplingParams, StructuredOutput
    from graphgen.runtime.engine.grammar import _guide, guided_sample, tokenizer_for
    from graphgen.serve.structured import response_format_grammar

    tokenizer_for(str(tok_dir), n_vocab)  # built once per folder (cached), as in the engine
    params = SamplingParams(structured=StructuredOutput(response_format_grammar({"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}}), str(tok_dir)))
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, 1, n_vocab, generator=g)

    def greedy(logits, _samplers):
        return logits.argmax(-1).tolist(), 0

    t0 = time.perf_counter()
    for i in range(tokens):
        greedy(rows[i], None)
    plain = (time.perf_counter() - t0) / tokens

    warm = _Req(params, -1)  # first use: imports and the grammar's first compilation
    guided_sample(rows[0], [warm], greedy)
    per, starts = [], []
    req = None
    for i in range(tokens):
        if req is None or req._guide.failed or req._guide.matcher.is_stopped() or req._guide.matcher.is_accepting():
            req = _Req(params, len(starts))
            t = time.perf_counter()
            _guide(req, n_vocab)  # a new request's matcher (once per request, not per token)
            starts.append(time.perf_counter() - t)
        t = time.perf_counter()
        guided_sample(rows[i], [req], greedy)
        per.append(time.perf_counter() - t)
    return {"vocab": n_vocab, "plain_us": plain * 1e6, "masked_us": statistics.mean(per) * 1e6,
            "masked_p50_us": statistics.median(per) * 1e6, "masked_max_us": max(per) * 1e6,
            "matcher_ms": statistics.mean(starts) * 1e3, "requests": len(starts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=400, help="decode steps per vocabulary (default 400)")
    ap.add_argument("--vocabs", default="32000,128000", help="trained BPE sizes (default 32000,128000)")
    ap.add_argument("--corpus-mb", type=int, default=24, help="training text for the BPE vocabularies")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        tokenizers = [("tiny_qwen3_chat", chat_tokenizer(Path(d) / "chat"))]
        for v in (int(x) for x in a.vocabs.split(",") if x):
            t = time.perf_counter()
            tokenizers.append((f"BPE (asked {v})", trained_tokenizer(v, Path(d) / f"bpe{v}", a.corpus_mb)))
            print(f"# trained a BPE of up to {v} tokens in {time.perf_counter() - t:.0f} s (fewer when the "
                  "corpus runs out of merges: the vocab column says)", file=sys.stderr)
        print("| tokenizer | vocab | unmasked µs/token | masked µs/token (mean / p50 / max) | mask cost µs | ratio "
              "| matcher per request ms (requests) |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, path in tokenizers:
            from transformers import AutoTokenizer
            n_vocab = len(AutoTokenizer.from_pretrained(path))
            r = measure(path, n_vocab, a.tokens)
            print(f"| {name} | {r['vocab']} | {r['plain_us']:.1f} | {r['masked_us']:.1f} / {r['masked_p50_us']:.1f} / "
                  f"{r['masked_max_us']:.0f} | {r['masked_us'] - r['plain_us']:.1f} | "
                  f"{r['masked_us'] / r['plain_us']:.1f}× | {r['matcher_ms']:.2f} ({r['requests']}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
