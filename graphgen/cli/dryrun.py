"""``graphgen dry-run``: a full-size launch on CPU, kernels aside (graphgen.dryrun; docs/npu.md, "Full-size launch").

Each rank of the spec's layout runs in a process of its own (``--rank R``: only rank R, in this
process): it streams its slices from the checkpoint files onto a ledger device, builds the load-time
weights, sizes the KV cache and lists the graphs it would compile; one line per rank, and with
``--json FILE`` ``{"spec", "ranks": [{"rank", "device_peak_bytes", "device_final_bytes", "host_peak_bytes",
"bytes_read", "load_s", "graphs", "kv_blocks"}]}``. Exit 2 (one sentence) when a rank does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import EXIT_INVALID, EXIT_OK, err, usage_error


def _check(args, spec):
    if args.rank is not None and not 0 <= args.rank < spec.parallel.world:
        return f"--rank {args.rank} is outside the layout's {spec.parallel.world} rank(s)"
    if args.device_memory_gib is not None and not args.device_memory_gib > 0:
        return f"--device-memory-gib must be > 0, got {args.device_memory_gib}"
    if args.num_blocks is not None and args.num_blocks < 1:
        return f"--num-blocks must be >= 1, got {args.num_blocks}"
    u = args.device_memory_utilization
    if u is not None and not 0 < u <= 1:
        return f"--device-memory-utilization must be in (0, 1], got {u}"
    if not Path(args.weights, "config.json").exists():
        return f"{args.weights}: no config.json (expected a Hugging Face checkpoint folder)"
    return None


def _run_child(cmd: list[str]) -> subprocess.CompletedProcess:
    """A rank's process, its output to ours: straight to our streams' files where they have them (its
    progress lines as they come), else collected and written when it ends (a caller that captures our
    streams in memory, as graphgen's CLI called in-process does: they have no file to give a child)."""
    try:
        sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        return proc
    sys.stdout.flush()
    sys.stderr.flush()
    return subprocess.run(cmd, stdout=sys.stdout, stderr=sys.stderr, env=os.environ)


# the flags that change a rank's answer; validate takes the same ones (the hint below carries them)
_BUDGET_FLAGS = ("device_memory_gib", "num_blocks", "device_memory_utilization")


def _flags(args, names) -> list[str]:
    out = []
    for flag in names:
        if getattr(args, flag) is not None:
            v = getattr(args, flag)
            out += [f"--{flag.replace('_', '-')}", str(int(v)) if float(v).is_integer() else repr(v)]
    return out


def validate_hint(args) -> str:
    """The validate command that counts what this dry run refused: the spec and every flag that changes
    the answer (run as printed, it gives the same verdict and names the fix). The KV blocks are the dry
    run's own: its ``--num-blocks`` or the launch's default 512 (validate's default counts the largest
    decode batch's need instead, and would call ok a layout whose 513 blocks do not fit); with
    ``--device-memory-utilization`` the KV cache is what is left, so no block count."""
    from ..passes.memory import DEFAULT_NUM_BLOCKS

    flags = _flags(args, ("device_memory_gib", "device_memory_utilization"))
    if args.device_memory_utilization is None:
        flags += ["--num-blocks", str(args.num_blocks or DEFAULT_NUM_BLOCKS)]
    return " ".join(["graphgen", "validate", str(args.spec), *flags])


def _child(args, rank: int, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "graphgen", "dry-run", "--spec", args.spec, "--weights", args.weights,
           "--target", args.target, "--rank", str(rank), "--json", str(out), "--quiet-refusal"]
    cmd += _flags(args, _BUDGET_FLAGS) + (["--mode", args.mode] if args.mode is not None else [])
    return cmd + (["--old-order"] if args.old_order else [])


def _one(args, spec, rank: int) -> dict:
    """This rank in this process: its JSON row (``error``: the sentence of a rank that does not fit)."""
    from ..dryrun import dry_run_rank
    from ..dryrun.ledger import DeviceOutOfMemory

    last = [time.monotonic()]

    def progress(done: int, total: int) -> None:  # a line every 10 s of a long load (stderr)
        if time.monotonic() - last[0] >= 10:
            last[0] = time.monotonic()
            err(f"rank {rank}: placed {done / (1 << 30):.1f} / {total / (1 << 30):.1f} GiB of weights")

    try:
        rep = dry_run_rank(spec, args.weights, rank, target=args.target, device_memory_gib=args.device_memory_gib,
                           num_blocks=args.num_blocks or 512, utilization=args.device_memory_utilization,
                           mode=args.mode, old_order=args.old_order, progress=progress)
    except DeviceOutOfMemory as e:
        return {"rank": rank, "error": str(e)}
    row = {**rep.row(), "budget_bytes": rep.budget_bytes}
    if not rep.fits:
        row["error"] = (f"device peak {rep.device_peak_bytes / (1 << 30):.2f} GiB exceeds the engine's budget of "
                        f"{rep.budget_bytes / (1 << 30):.2f} GiB")
    print(rep.line(), flush=True)
    return row


def cmd_dry_run(args) -> int:
    from ..families.parallel import runtime_layout_gap
    from ..modelspec.loader import load_spec

    spec = load_spec(Path(args.spec))
    problem = _check(args, spec)
    if problem:
        return usage_error("dry-run", problem)
    gap = runtime_layout_gap(spec.parallel, args.target, mtp=spec.mtp is not None)
    if gap is not None and args.rank is None:
        err(f"graphgen dry-run: note: a launch of this layout is refused today ({gap}); its memory is checked anyway")
    ranks = [args.rank] if args.rank is not None else list(range(spec.parallel.world))
    rows = []
    if args.rank is not None:
        try:
            rows.append(_one(args, spec, args.rank))
        except ValueError as e:  # a checkpoint that does not match the spec
            err(f"graphgen dry-run: {e}")
            return EXIT_INVALID
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for r in ranks:
                out = Path(tmp) / f"rank{r}.json"
                proc = _run_child(_child(args, r, out))
                if not out.exists():
                    err(f"graphgen dry-run: rank {r} stopped (exit code {proc.returncode}) before reporting")
                    return EXIT_INVALID
                rows += json.loads(out.read_text())["ranks"]
    doc = {"spec": spec.name, "target": args.target, "ranks": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    bad = [r for r in rows if "error" in r]
    if bad:  # one sentence, from the process that ran the ranks (a rank's own process leaves it to its parent)
        if not args.quiet_refusal:
            more = f" (and {len(bad) - 1} more rank(s))" if len(bad) > 1 else ""
            err(f"graphgen dry-run: rank {bad[0]['rank']}{more} of {spec.name} does not fit: {bad[0]['error']} "
                f"({validate_hint(args)} counts it and names a layout that fits, if one does)")
        return EXIT_INVALID
    return EXIT_OK


def register(sub) -> None:
    d = sub.add_parser("dry-run", help="a full-size launch on CPU, kernels aside: per-rank device and host peak, "
                                       "load time, KV blocks, graphs (a ledger device; no NPU needed)")
    d.add_argument("--spec", required=True, help="model spec (YAML)")
    d.add_argument("--weights", required=True,
                   help="Hugging Face checkpoint folder (e.g. one scripts/sparse_checkpoint.py wrote)")
    d.add_argument("--target", choices=("npu", "cpu"), default="npu", help="whose launch (default: npu)")
    d.add_argument("--rank", type=int, default=None, help="only this rank, in this process (default: every rank, "
                                                           "one process each)")
    d.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                   help="memory of one device (default: targets.npu.device_memory_gib, else 64)")
    d.add_argument("--num-blocks", type=int, default=None, help="KV blocks, as the launch's --num-blocks (default 512)")
    d.add_argument("--device-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="size the KV cache from what the weights leave, as the launch's flag")
    d.add_argument("--mode", default=None, help="NPU compile mode (default: the spec's first)")
    d.add_argument("--json", default=None, metavar="FILE", help="write the per-rank report as JSON")
    # the tests' negative control: the load order before the streaming loader (not for users)
    d.add_argument("--old-order", action="store_true", help=argparse.SUPPRESS)
    # a rank's process under an all-ranks run: its JSON row only; the parent says the sentence once
    d.add_argument("--quiet-refusal", action="store_true", help=argparse.SUPPRESS)
    d.set_defaults(handler=cmd_dry_run)
