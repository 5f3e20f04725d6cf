"""``graphgen checkpoint --spec SPEC --out DIR [--seed S]``: a random Hugging Face checkpoint for a spec.

``config.json`` + ``model.safetensors`` with random weights scaled to keep activations O(1)
(`graphgen.runtime.write_random_hf_checkpoint`), plus a tokenizer: for the chat specs (vocab >= 512,
``specs/tiny_*_chat.yaml``) with the family's special tokens and chat template, so tools, reasoning
and chat work; the MTP layers too when the spec has an ``mtp:`` section. Deterministic for a seed.
What ``graphgen serve`` / ``graphgen run --weights DIR`` take; the weights are random, so the text is
noise, but every token path is real. Written shard by shard (``--shard-gb``, default 5: one shard in memory
at a time, ``model.safetensors`` when one holds it all, else shards and their index as ``save_pretrained``
writes them); a model the disk or the memory here cannot hold is refused before anything is written,
naming ``scripts/sparse_checkpoint.py`` (the published layout with no data on disk).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .common import EXIT_INVALID, EXIT_OK, err, usage_error


# what the writer puts in a folder: a folder holding only these is a checkpoint it wrote (rewritten)
WRITTEN = {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
           "tokenizer_config.json", "generation_config.json"}
GIB = 1 << 30


def _written(name: str) -> bool:
    from ..runtime.checkpoint.hf import SHARD_NAME

    return name in WRITTEN or SHARD_NAME.match(name) is not None


def cmd_checkpoint(args) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return usage_error("checkpoint", f"--out {out}: not a folder")
    others = sorted(p.name for p in out.iterdir() if not _written(p.name)) if out.is_dir() else []
    if others and not args.force:
        return usage_error("checkpoint", f"--out {out}: holds files this command did not write "
                                         f"({', '.join(others[:3])}); pick another folder or add --force")
    from ..modelspec.loader import load_spec

    spec = load_spec(args.spec)  # a spec error: file:line and the fix, exit 2 (cli/common.py)
    if not args.shard_gb > 0:
        return usage_error("checkpoint", f"--shard-gb must be > 0, got {args.shard_gb}")
    from ..runtime.checkpoint import hf

    dims, shard_bytes = dataclasses.asdict(spec.dims), int(args.shard_gb * 1e9)
    plan = hf.plan_random_checkpoint(spec.family, dims, mtp_layers=spec.mtp_layers, shard_bytes=shard_bytes)
    problem = hf.room_problem(plan, str(out), *hf.room_for(str(out)))
    if problem:  # before anything is written (the writer checks again: a library caller gets it too)
        err(f"graphgen checkpoint: {spec.name}: {problem}")
        return EXIT_INVALID
    shards = len(plan.files)
    err(f"graphgen checkpoint: writing a random {spec.family} checkpoint for {spec.name} to {out} "
        f"({plan.total_bytes / GIB:.2f} GiB{f' in {shards} shards' if shards > 1 else ''}) ...")
    done = [0]

    def progress(i: int, plan, held: int) -> None:  # a line per shard of a sharded write
        done[0] += held
        if shards > 1:
            err(f"graphgen checkpoint: shard {i + 1}/{shards} written ({done[0] / GIB:.2f} of "
                f"{plan.total_bytes / GIB:.2f} GiB)")

    hf.write_random_hf_checkpoint(str(out), spec.family, dims, seed=args.seed, mtp_layers=spec.mtp_layers,
                                  shard_bytes=shard_bytes, on_shard=progress)
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
    p.add_argument("--shard-gb", type=float, default=5.0, metavar="GB",
                   help="largest shard in GB (10^9 bytes; default 5, as save_pretrained's 5GB): the memory the "
                        "writer holds at once")
    p.add_argument("--force", action="store_true",
                   help="write into a folder that holds other files too (a previous checkpoint's are always rewritten)")
    p.set_defaults(handler=cmd_checkpoint)
