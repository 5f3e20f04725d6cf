"""The engine flags `graphgen run` and `graphgen serve` share, declared once.

Each command keeps its own defaults where they differ on purpose: ``serve`` admits 64 requests at
once and schedules asynchronously (a server's steady state), ``run`` admits 256 and runs steps one
after another (a reproducible batch job). Torch-free: building the parsers and checking the numbers
happens before anything heavy is imported.
"""

from __future__ import annotations

import argparse
from typing import Optional

__all__ = ["add_engine_arguments", "check_engine_arguments", "engine_options", "target_note", "EXIT_OK", "EXIT_STALE",
           "EXIT_INVALID", "EXIT_UNAVAILABLE"]

# every command's exit codes (cli/common.py documents them; the server uses the same ones)
EXIT_OK, EXIT_STALE, EXIT_INVALID, EXIT_UNAVAILABLE = 0, 1, 2, 3


def add_engine_arguments(p: argparse.ArgumentParser, *, max_num_seqs: int, async_scheduling: bool) -> None:
    """The flags that build an engine (`graphgen.runtime.open_engine`'s arguments)."""
    p.add_argument("--spec", required=True, help="model spec (YAML)")
    p.add_argument("--weights", required=True,
                   help="Hugging Face checkpoint folder (config.json + safetensors; a tokenizer in it enables text)")
    p.add_argument("--write", choices=("off", "sync", "async"), default=None, help="override pool.write")
    p.add_argument("--granularity", choices=("forward", "layer"), default=None, help="override pool.granularity")
    p.add_argument("--tp", type=int, default=None,
                   help="override parallel.tp: tensor-parallel ranks (one process each)")
    p.add_argument("--ep", type=int, default=None, help="override parallel.ep: expert-parallel ranks (1 or --tp)")
    p.add_argument("--pool", default="host", metavar="URL",
                   help="pool backend: host (the embedded pool) or mooncake://HOST:PORT[?option=value&...] "
                        "(a Mooncake master, shared by processes; docs/mooncake.md)")
    p.add_argument("--num-blocks", type=int, default=512, help="device KV blocks")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="requests admitted or running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens one step may hold (a longer prompt runs in chunks, see --chunked-prefill)")
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="run a prompt longer than the step budget in chunks, one per step, a decode step "
                        "between chunks (off: it runs as one oversized step)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                   help="with chunked prefill: a prompt longer than N gets at most N tokens per step (0: off)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=async_scheduling,
                   help="prepare step N+1 while step N runs (tokens are identical either way)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's EOS ids (generation_config.json / config.json)")
    p.add_argument("--faults", default=None, help="fault injection, e.g. save_delay=0.05,put_fail=0.5,seed=1 "
                                                  "(docs/runtime.md)")
    p.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace-event JSON (Perfetto)")
    p.add_argument("--target", choices=("cpu", "npu"), default="cpu",
                   help="cpu: the generated CPU graphs; npu: the NPU model runner (needs torch_npu, or --standin)")
    p.add_argument("--standin", action="store_true",
                   help="with --target npu: run the NPU graphs on CPU through the torchair stand-in "
                        "(graph structure only, never an NPU result)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="with --target npu: compile every bucket of every variant at engine start, one line per "
                        "bucket on stderr (default: on, off with --standin)")


def check_engine_arguments(args) -> Optional[str]:
    """The first problem with the engine flags (a sentence naming the flag), or None."""
    for flag in ("max_num_seqs", "max_num_batched_tokens", "tp", "ep"):  # --num-blocks: checked by each command against the spec
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            return f"--{flag.replace('_', '-')} must be >= 1, got {v}"
    if getattr(args, "long_prefill_token_threshold", 0) < 0:
        return f"--long-prefill-token-threshold must be >= 0 (0: off), got {args.long_prefill_token_threshold}"
    if args.standin and args.target != "npu":
        return "--standin applies to --target npu only"
    if getattr(args, "warmup", None) is not None and args.target != "npu":
        return "--warmup/--no-warmup applies to --target npu only"
    return None


def engine_options(args, faults=None) -> dict:
    """`open_engine`'s keyword arguments from the engine flags (the spec and weights aside)."""
    opts = dict(write=args.write, granularity=args.granularity, tp=args.tp, ep=args.ep, pool=args.pool,
                num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=args.async_scheduling,
                chunked_prefill=args.chunked_prefill, long_prefill_token_threshold=args.long_prefill_token_threshold,
                faults=faults, target=args.target)
    if args.target == "npu":
        opts["standin"] = args.standin
        opts["warmup"] = getattr(args, "warmup", None)
    return opts


def target_note(args) -> Optional[str]:
    """The one line ``run``/``serve --target npu`` print (stderr) on what is verified and what is not."""
    if args.target != "npu":
        return None
    if args.standin:
        return ("note: --target npu --standin runs the NPU graphs on CPU through graphgen's torchair stand-in "
                "(kernels as graphgen reads their docs, checked against the CPU target in bf16; with --tp, "
                "ranks on gloo): a wiring check, not an NPU result")
    return ("note: --target npu has never run on an NPU (kernels, GE/aclgraph, hccl ranks, device events "
            "unverified; docs/npu.md lists what was checked on CPU)")
