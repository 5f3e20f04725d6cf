"""The engine flags `graphgen run` and `graphgen serve` share, declared once.

Each command keeps its own defaults where they differ on purpose: ``serve`` admits 64 requests at
once and schedules asynchronously (a server's steady state), ``run`` admits 256 and runs steps one
after another (a reproducible batch job). Torch-free: building the parsers and checking the numbers
happens before anything heavy is imported.
"""

from __future__ import annotations

import argparse
from typing import Optional, get_args

from .modelspec.model import WritePolicy

__all__ = ["add_engine_arguments", "check_engine_arguments", "engine_options", "add_speculative_arguments", "layout_refusal", "target_note",
           "rank_count", "thread_options", "default_compile_cache_dir", "overridden_spec", "placement_of",
           "follow_node",
           "EXIT_OK", "EXIT_STALE", "EXIT_INVALID", "EXIT_UNAVAILABLE"]

WRITE_POLICIES = get_args(WritePolicy)  # pool.policy's values
DEFAULT_MASTER_PORT = 29500  # torchrun's (runtime.parallel.cluster)

# every command's exit codes (cli/common.py documents them; the server uses the same ones)
EXIT_OK, EXIT_STALE, EXIT_INVALID, EXIT_UNAVAILABLE = 0, 1, 2, 3


def add_engine_arguments(p: argparse.ArgumentParser, *, max_num_seqs: int, async_scheduling: bool) -> None:
    """The flags that build an engine (`graphgen.runtime.open_engine`'s arguments)."""
    p.add_argument("--spec", required=True, help="model spec (YAML)")
    p.add_argument("--weights", required=True,
                   help="Hugging Face checkpoint folder (config.json + safetensors; a tokenizer in it enables text)")
    p.add_argument("--write", choices=("off", "sync", "async"), default=None, help="override pool.write")
    p.add_argument("--granularity", choices=("forward", "layer"), default=None, help="override pool.granularity")
    p.add_argument("--pool-policy", choices=WRITE_POLICIES, default=None,
                   help="override pool.policy: when full blocks are saved (write_through: when filled; "
                        "write_through_selective: once computed pool.min_uses times; write_back: when they "
                        "leave the device)")
    p.add_argument("--pool-min-uses", type=int, default=None, metavar="N",
                   help="override pool.min_uses: with write_through_selective, computations of a block's key "
                        "before it is saved (>= 1)")
    p.add_argument("--tp", type=int, default=None,
                   help="override parallel.tp: tensor-parallel ranks (one process each)")
    p.add_argument("--ep", type=int, default=None,
                   help="override parallel.ep: expert-parallel ranks (1 or --tp; --dp x --tp under DP attention)")
    p.add_argument("--dp", type=int, default=None,
                   help="override parallel.dp: data-parallel attention groups of --tp ranks (docs/parallel.md)")
    p.add_argument("--cp", type=int, default=None,
                   help="override parallel.cp: context-parallel groups of --tp ranks (docs/parallel.md)")
    p.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="override parallel.sp: sequence parallel inside the TP group (needs --tp > 1)")
    p.add_argument("--pool", default="host", metavar="URL",
                   help="pool backend: host (the embedded pool) or mooncake://HOST:PORT[?option=value&...] "
                        "(a Mooncake master, shared by processes; docs/mooncake.md)")
    p.add_argument("--num-blocks", type=int, default=512, help="device KV blocks")
    p.add_argument("--device-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="with --target npu: size the KV cache after the weights from what is left of this share "
                        "of the device's memory (vLLM's --gpu-memory-utilization; 0.9: docs/npu.md, 'Full-size "
                        "launch'), instead of --num-blocks")
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
    p.add_argument("--torch-threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads (per rank with several ranks; default: torch's own choice, "
                        "which contends on a busy machine)")
    p.add_argument("--target", choices=("cpu", "npu"), default="cpu",
                   help="cpu: the generated CPU graphs; npu: the NPU model runner (needs torch_npu, or --standin)")
    p.add_argument("--standin", action="store_true",
                   help="with --target npu: run the NPU graphs on CPU through the torchair stand-in "
                        "(graph structure only, never an NPU result)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="with --target npu: compile every bucket of every variant at engine start, one line per "
                        "bucket on stderr (default: on, off with --standin)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="with --target npu: the compile cache (torchair entries and, under max-autotune, GE's "
                        "models, keyed by every input's shape); a restart with the same DIR and KV size "
                        "compiles no graph "
                        "(default: $XDG_CACHE_HOME/graphgen/npu, ~/.cache/graphgen/npu without it; none with "
                        "--standin unless given)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="with --target npu: no compile cache (every start compiles every graph)")
    add_node_arguments(p)
    p.add_argument("--rank-timeout", default=None, metavar="SECONDS|PHASE=S,...",
                   help="with several ranks: the deadline of each start phase, one number for all or "
                        "start=S,load=S,warmup=S (default: start=600,load=3600,warmup=7200); a rank that "
                        "misses one is reported and every rank ends")


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """Ranks across nodes, torchrun's flags (docs/parallel.md, "Ranks across nodes")."""
    p.add_argument("--nnodes", type=int, default=1,
                   help="nodes the layout's ranks span, world / nnodes per node (torchrun's; under torchrun its "
                        "environment instead): node 0 drives the engine, the others run their ranks for it "
                        "(docs/parallel.md, 'Ranks across nodes')")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node in [0, --nnodes): node 0 drives the engine (and serves HTTP); another node runs "
                        "its ranks for node 0 until it closes the engine (the same command on every node)")
    p.add_argument("--master-addr", default="127.0.0.1", metavar="IPV4",
                   help="node 0's address, reachable from every node (torchrun's): the rendezvous store, the "
                        "command channel and the shared pool listen on it only, never on a wildcard")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, metavar="PORT",
                   help="the rendezvous store's port on --master-addr; the command channel and the pool take the "
                        "next two (PORT+1, PORT+2)")


def add_lora_arguments(p: argparse.ArgumentParser, *, serve: bool) -> None:
    """Multi-LoRA (docs/lora.md), as vLLM names the flags: ``serve --lora-modules NAME=PATH ...``, ``run --lora PATH``."""
    if serve:
        p.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                       help="PEFT LoRA adapters (folders with adapter_config.json + adapter_model.safetensors) served "
                            "as models of their own: a request picks one by \"model\": NAME; /v1/models lists them")
    else:
        p.add_argument("--lora", default=None, metavar="PATH", help="run every prompt under this PEFT LoRA adapter")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="adapters one step batches (device slots); default: the spec's lora.max_loras, else 1")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="largest adapter rank a slot holds; default: the spec's lora.max_lora_rank, else 16")


def lora_modules_of(args) -> tuple[Optional[str], dict]:
    """(a sentence naming the flag, or None; {name: folder}) from ``--lora-modules`` / ``--lora``."""
    out: dict = {}
    for item in getattr(args, "lora_modules", None) or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            return f"--lora-modules {item!r}: expected NAME=PATH", {}
        if name in out:
            return f"--lora-modules: the name {name!r} is given twice", {}
        out[name] = path
    if getattr(args, "lora", None):
        from pathlib import Path

        out[Path(args.lora).name or "lora"] = args.lora
    for flag in ("max_loras", "max_lora_rank"):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            return f"--{flag.replace('_', '-')} must be >= 1, got {v}", {}
    return None, out


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Speculative decoding with DeepSeek-V3's MTP layer (docs/mtp.md; `graphgen run` and `graphgen serve`)."""
    p.add_argument("--speculative", choices=("mtp",), default=None,
                   help="speculative decoding: mtp drafts with the model's MTP layer, the target verifies "
                        "(greedy, or rejection sampling at temperature > 0; needs a spec with an mtp: section)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="with --speculative: draft tokens per step, 1..15 (K + 1 tokens per verify row; default 1)")


def check_engine_arguments(args) -> Optional[str]:
    """The first problem with the engine flags (a sentence naming the flag), or None."""
    # --num-blocks: checked by each command against the spec
    for flag in ("max_num_seqs", "max_num_batched_tokens", "tp", "ep", "dp", "cp", "pool_min_uses", "torch_threads",
                 "nnodes"):
        v = getattr(args, flag, None)
        if v is not None and v < 1:
            return f"--{flag.replace('_', '-')} must be >= 1, got {v}"
    if getattr(args, "long_prefill_token_threshold", 0) < 0:
        return f"--long-prefill-token-threshold must be >= 0 (0: off), got {args.long_prefill_token_threshold}"
    if args.standin and args.target != "npu":
        return "--standin applies to --target npu only"
    spec_k = getattr(args, "num_speculative_tokens", None)
    if spec_k is not None and getattr(args, "speculative", None) is None:
        return "--num-speculative-tokens applies with --speculative mtp only"
    if getattr(args, "speculative", None) is not None:
        if spec_k is not None and not 1 <= spec_k <= 15:
            return f"--num-speculative-tokens must be in [1, 15] (K + 1 tokens per verify row, at most 16), got {spec_k}"
        # the target and the layout: the one refusal table (families.parallel.runtime_layout_gap, layout_refusal)
    util = getattr(args, "device_memory_utilization", None)
    if util is not None and (args.target != "npu" or args.standin or not 0 < util <= 1):
        return (f"--device-memory-utilization applies to --target npu on an NPU (not --standin: no device memory "
                f"to size from), in (0, 1]; got {util}")
    if getattr(args, "warmup", None) is not None and args.target != "npu":
        return "--warmup/--no-warmup applies to --target npu only"
    if (getattr(args, "cache_dir", None) is not None or getattr(args, "no_compile_cache", False)) \
            and args.target != "npu":
        return "--cache-dir/--no-compile-cache apply to --target npu only"
    if getattr(args, "cache_dir", None) is not None and getattr(args, "no_compile_cache", False):
        return "--cache-dir and --no-compile-cache exclude each other"
    if getattr(args, "rank_timeout", None) is not None:
        from .runtime.progress import Deadlines

        try:
            Deadlines.parse(args.rank_timeout)
        except ValueError as e:
            return str(e)
    problem, _ = lora_modules_of(args)
    return problem


def default_compile_cache_dir() -> str:
    """Where ``--target npu`` keeps compiled graphs by default: ``$XDG_CACHE_HOME/graphgen/npu``
    (``~/.cache/graphgen/npu`` without it). Entries are keyed by spec, mode, variant, module source and
    rank (`graphgen.npu.run.compile.CacheKey`), so specs and versions share the folder safely."""
    import os

    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "graphgen", "npu")


def overridden_spec(args, spec):
    """The spec as `open_engine` will run it: the flags' overrides applied (what every node must agree on)."""
    return spec.with_overrides(write=getattr(args, "write", None), granularity=getattr(args, "granularity", None),
                               **{k: getattr(args, k, None) for k in ("tp", "ep", "dp", "cp", "sp")},
                               policy=getattr(args, "pool_policy", None), min_uses=getattr(args, "pool_min_uses", None))


def placement_of(args, spec):
    """Where this process's ranks run (`graphgen.runtime.parallel.cluster.Placement`): the --nnodes flags,
    or torchrun's environment when it launched this process. ValueError: one sentence."""
    from .runtime.parallel.cluster import Placement

    world = spec.with_overrides(**{k: getattr(args, k, None) for k in ("tp", "ep", "dp", "cp", "sp")}).parallel.world
    here = Placement.of(world, nnodes=getattr(args, "nnodes", 1), node_rank=getattr(args, "node_rank", 0),
                        master_addr=getattr(args, "master_addr", "127.0.0.1"),
                        master_port=getattr(args, "master_port", DEFAULT_MASTER_PORT))
    return here


def follow_node(args, spec, here, command: str) -> int:
    """On a node other than node 0 (``here``: `placement_of`, not the driver): run this node's ranks for node
    0's driver until it closes the engine; the exit code. ValueError (one sentence) for a layout the runtime
    refuses or a checkpoint that does not match the spec, before anything starts."""
    from .runtime.parallel.follower import follow  # torch-free: the ranks (forked) import it

    refusal = layout_refusal(spec, args)
    if refusal is not None:
        raise ValueError(refusal)
    spec = overridden_spec(args, spec)  # its checkpoint's config.json is checked by its ranks
    deadlines = None
    if getattr(args, "rank_timeout", None) is not None:
        from .runtime.progress import Deadlines

        deadlines = Deadlines.parse(args.rank_timeout)
    return follow(here, spec, args.weights, threads=getattr(args, "torch_threads", None), rank_timeout=deadlines,
                  command=command, pool=args.pool)


def layout_refusal(spec, args) -> Optional[str]:
    """The sentence refusing the spec's parallel layout with the flags' overrides applied: where the spec rules
    refuse it (`graphgen.families.parallel.layout_rules`: a --cp/--sp/--tp the file did not set is checked here,
    before the weights load, as the file's own layout was by the loader) or the runtime cannot run it yet
    (`graphgen.families.parallel.runtime_layout_gap`); None if neither; torch-free."""
    from .families.parallel import layout_rules, runtime_layout_gap

    overrides = {k: getattr(args, k, None) for k in ("tp", "ep", "dp", "cp", "sp")}
    par = spec.with_overrides(**overrides).parallel
    problems = list(layout_rules(spec.family, spec.dims, par, mtp=spec.mtp is not None))
    if problems:
        return "; ".join(f"{where}: {msg} (fix: {fix})" for where, msg, fix in problems)
    return runtime_layout_gap(par, getattr(args, "target", "cpu"), mtp=spec.mtp is not None,
                              speculative=getattr(args, "speculative", None) is not None,
                              role=getattr(args, "role", "both"))


def rank_count(args, spec) -> int:
    """How many rank processes the layout asks for (the overrides, else the spec's ``parallel:``)."""
    par = spec.parallel
    pick = [getattr(args, k, None) if getattr(args, k, None) is not None else getattr(par, k, 1)
            for k in ("tp", "ep", "cp")]
    return max(pick[0], pick[1]) * pick[2]


def thread_options(args, spec) -> dict:
    """``--torch-threads``: set in this process (torch imported here), and passed to the rank
    processes of a several-rank layout (`open_engine`'s ``threads``)."""
    if not getattr(args, "torch_threads", None):
        return {}
    import torch

    torch.set_num_threads(args.torch_threads)
    return {"threads": args.torch_threads} if rank_count(args, spec) > 1 else {}


def engine_options(args, faults=None, placement=None) -> dict:
    """`open_engine`'s keyword arguments from the engine flags (the spec and weights aside); ``placement``:
    this driver's (`placement_of`), passed on when the ranks span nodes."""
    opts = dict(write=args.write, granularity=args.granularity, tp=args.tp, ep=args.ep, pool=args.pool,
                **{k: getattr(args, k) for k in ("dp", "cp", "sp") if getattr(args, k, None) is not None},
                pool_policy=args.pool_policy, pool_min_uses=getattr(args, "pool_min_uses", None),
                num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=args.async_scheduling,
                chunked_prefill=args.chunked_prefill, long_prefill_token_threshold=args.long_prefill_token_threshold,
                faults=faults, target=args.target)
    if getattr(args, "speculative", None) is not None:
        opts["num_speculative_tokens"] = args.num_speculative_tokens or 1
    _, loras = lora_modules_of(args)
    if loras:
        opts["lora_modules"] = loras
    for flag in ("max_loras", "max_lora_rank"):
        if getattr(args, flag, None) is not None:
            opts[flag] = getattr(args, flag)
    if placement is not None and placement.multi_node:
        opts["placement"] = placement
    if getattr(args, "rank_timeout", None) is not None:
        from .runtime.progress import Deadlines

        opts["rank_timeout"] = Deadlines.parse(args.rank_timeout)
    if args.target == "npu":
        opts["standin"] = args.standin
        opts["warmup"] = getattr(args, "warmup", None)
        if getattr(args, "device_memory_utilization", None) is not None:
            opts["device_memory_utilization"] = args.device_memory_utilization
        cache_dir = getattr(args, "cache_dir", None)
        if cache_dir is None and not args.standin and not getattr(args, "no_compile_cache", False):
            cache_dir = default_compile_cache_dir()
        opts["cache_dir"] = cache_dir
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
