"""``graphgen checkpoint --spec SPEC --out DIR [--seed S]``: a random Hugging Face checkpoint for a spec.

``config.json`` + ``model.safetensors`` with random weights scaled to keep activations O(1)
(`graphgen.runtime.write_random_hf_checkpoint`), plus a tokenizer: for the chat specs (vocab >= 512,
``specs/tiny_*_chat.yaml``) with the family's special tokens and chat template, so tools, reasoning
and chat work; the MTP layers too when the spec has an ``mtp:`` section. Deterministic for a seed.
What ``graphgen serve`` / ``graphgen run --weights DIR`` take; the weights are random, so the text is
noise, but every token path is real.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .common import EXIT_OK, err, usage_error


# what the writer puts in a folder: a folder holding only these is a checkpoint it wrote (rewritten)
WRITTEN = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}


def cmd_checkpoint(args) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return usage_error("checkpoint", f"--out {out}: not a folder")
    others = sorted(p.name for p in out.iterdir() if p.name not in WRITTEN) if out.is_dir() else []
    if others and not args.force:
        return usage_error("checkpoint", f"--out {out}: holds files this command did not write "
                                         f"({', '.join(others[:3])}); pick another folder or add --force")
    from ..modelspec.loader import load_spec

    spec = load_spec(args.spec)  # a spec error: file:line and the fix, exit 2 (cli/common.py)
    from ..runtime import write_random_hf_checkpoint

    err(f"graphgen checkpoint: writing a random {spec.family} checkpoint for {spec.name} to {out} ...")
    write_random_hf_checkpoint(str(out), spec.family, dataclasses.asdict(spec.dims), seed=args.seed,
                               mtp_layers=spec.mtp_layers)
    tok = "with a tokenizer" if (out / "tokenizer.json").exists() else "without a tokenizer (vocab under 256)"
    chat = " and a chat template" if (out / "tokenizer_config.json").exists() and "chat_template" in \
        (out / "tokenizer_config.json").read_text() else ""
    print(f"{out}: {spec.name} (seed {args.seed}), {tok}{chat}")
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="write a random Hugging Face checkpoint (and tokenizer) for a spec",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="model spec (YAML)")
    p.add_argument("--out", required=True, help="the checkpoint folder to write")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.add_argument("--force", action="store_true",
                   help="write into a folder that holds other files too (a previous checkpoint's are always rewritten)")
    p.set_defaults(handler=cmd_checkpoint)
