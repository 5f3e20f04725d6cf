"""``graphgen compile --target npu``: wrap a generated NPU module for torchair, or trace it on CPU
with the torchair stand-in (``--standin``: a graph-structure check, never an NPU result).

torch, torchair and the stand-in are imported inside the handler only.
"""

from __future__ import annotations

from pathlib import Path

from .common import EXIT_INVALID, EXIT_OK, EXIT_STALE, EXIT_UNAVAILABLE, err


def cmd_compile(args) -> int:
    from ..lower.compile import mode_dir
    from ..modelspec.loader import load_spec

    spec = load_spec(args.spec)
    if spec.targets.npu is None:
        err(f"{args.spec}: the spec has no npu target; add `npu: {{}}` under targets")
        return EXIT_INVALID
    mode = args.mode or spec.targets.npu.compile_modes[0]
    if mode not in spec.targets.npu.compile_modes:  # also with --steps: only generated modes run
        err(f"{args.spec}: compile mode {mode} is not generated; modes: {', '.join(spec.targets.npu.compile_modes)}")
        return EXIT_INVALID
    if args.variant is not None and args.variant not in spec.variants:
        err(f"{args.spec}: no variant '{args.variant}'; variants: {', '.join(spec.variants)}")
        return EXIT_INVALID
    if args.steps is not None:
        return _steps(args, spec)
    if args.mixed_batches:
        err("graphgen compile: error: --mixed-batches needs --standin --steps N")
        return EXIT_INVALID
    if args.variant is None:
        err("graphgen compile: error: --variant is required (all variants only with --standin --steps N)")
        return EXIT_INVALID
    path = Path(args.out) / spec.name / "npu" / mode_dir(mode) / f"{args.variant}.py"
    if not path.exists():
        err(f"{path}: not generated; run: graphgen generate")
        return EXIT_INVALID
    if args.standin:
        from ..npu.run.structure import trace_and_check

        report = trace_and_check(path, spec)
        if not report.ok:
            err(f"{path}: post-AOT structure check failed:")
            for p in report.problems:
                err(f"  - {p}")
            return EXIT_STALE
        print(f"{path}: traced on CPU with the torchair stand-in in mode {mode}; post-AOT structure ok "
              f"(graph structure only — this is not an NPU build and nothing ran on an NPU)")
        return EXIT_OK
    from ..npu.run.compile import NpuUnavailable, compile_module

    try:
        compile_module(path, mode, cache_dir=args.cache_dir)
    except NpuUnavailable as e:
        err(f"graphgen compile: {e}")
        return EXIT_UNAVAILABLE
    print(f"{path}: wrapped for torchair in mode {mode} (graphs compile on the first call)")
    return EXIT_OK


def _steps(args, spec) -> int:
    """``--steps N``: a mixed loop of N steps per variant and mode through the stand-in, padded to the
    spec's buckets; prints the graphs compiled against the bucket count (exit 1 when more)."""
    if args.steps < 1:
        err("graphgen compile: error: --steps must be >= 1")
        return EXIT_INVALID
    if args.mixed_batches < 0:
        err("graphgen compile: error: --mixed-batches must be >= 0")
        return EXIT_INVALID
    if not args.standin:
        from ..npu.run.compile import NpuUnavailable, _import_torchair

        try:
            _import_torchair(False)
        except NpuUnavailable as e:
            err(f"graphgen compile: {e}")
            return EXIT_UNAVAILABLE
        err("graphgen compile: error: --steps counts compilations through the CPU stand-in: add --standin "
            "(on an NPU, graphgen run --target npu drives the compiled graphs)")
        return EXIT_INVALID
    from ..modelspec.errors import SpecError
    from ..npu.check.speclimits import limit_diagnostics
    from ..npu.run.bucketing import report, run_standin_loop
    from ..npu.check.limits import KernelLimitError

    found = limit_diagnostics(args.spec, spec)  # the stand-in would reject the first traced call anyway
    if found:
        raise SpecError(found)
    variants = [args.variant] if args.variant else list(spec.variants)
    modes = [args.mode] if args.mode else list(spec.targets.npu.compile_modes)
    print(f"{args.spec}: {args.steps} mixed steps per variant and mode through the torchair stand-in on meta tensors "
          f"(graphs compiled per bucket, and each step's kernel calls checked against the documented limits; "
          f"no values computed)")
    try:
        results = run_standin_loop(spec, variants, modes, args.steps, every_bucket=bool(args.ops_json),
                                   mixed_batches=args.mixed_batches)
    except Exception as e:  # Dynamo wraps a stand-in kernel's KernelLimitError raised while tracing
        cause = e
        while cause is not None and not isinstance(cause, KernelLimitError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        err(f"{args.spec}: a kernel call is outside its documented limits: {cause}")
        return EXIT_INVALID
    rc = report(results)
    # The GE converter check runs on every graph the loop captured (with --ops-json: every bucket).
    from ..npu.check import geops

    doc = geops.ops_report(str(args.spec), results)
    if args.ops_json:
        Path(args.ops_json).write_text(geops.dump_report(doc))
        print(f"{args.ops_json}: post-AOT op targets of {len(doc['graphs'])} graphs (one per variant, mode and bucket)")
    join = _save_join_problems(results)
    if join:
        err(f"{args.spec}: post-AOT save join check failed (audit 2, row 8):")
        for p in join:
            err(f"  - {p}")
        return EXIT_STALE
    print(f"save join check ok: every captured graph with a save stream joins it to the main stream "
          f"before the op producing the logits (graph structure only)")
    static = _static_graph_problems(results)
    if static:
        err(f"{args.spec}: post-AOT static graph check failed (tiling sink, docs/npu.md \"Decode as a static graph\"):")
        for p in static:
            err(f"  - {p}")
        return EXIT_STALE
    n_static = sum(len(r.graphs) for r in results if r.tiling_sink)
    if n_static:
        print(f"static graph check ok: {n_static} tiling-sunk graphs have static shapes, BSH/BNSD attention and "
              f"symbolic ints only as its lengths (graph structure only)")
    problems = geops.check_ops_report(doc)
    if problems:
        err(f"{args.spec}: GE converter check failed (torch-npu {geops.load_table()['wheel']['torch_npu_version']}"
            f" converters, graphgen/npu/check/ge_converters.json):")
        for p in problems:
            err(f"  - {p}")
        return EXIT_STALE
    print(f"GE converter check ok: every op of {len(doc['graphs'])} graphs has a torchair converter that does "
          f"not only raise (that it accepts these arguments is not checked)")
    return rc


def _bucket_name(r, g) -> str:
    return f"{r.variant} ({r.mode}, bucket batch={g['bucket']['batch']} tokens={g['bucket']['tokens']})"


def _static_graph_problems(results) -> list[str]:
    """graphgen.npu.check.aotcheck.check_static_graph on every graph compiled with tiling sink."""
    from ..npu.check.aotcheck import check_static_graph

    return [p for r in results if r.tiling_sink for g in r.graphs
            for p in check_static_graph(g["captured"].gm, _bucket_name(r, g))]


def _save_join_problems(results) -> list[str]:
    """The explicit save join (graphgen.npu.check.aotcheck.check_save_join) on every captured graph."""
    from ..npu.check.aotcheck import check_save_join

    return [p for r in results for g in r.graphs
            for p in check_save_join(g["captured"].gm, _bucket_name(r, g))]


def register(sub) -> None:
    c = sub.add_parser("compile", help="compile a generated NPU module with torchair (needs torch_npu)")
    c.add_argument("--target", choices=("npu",), required=True)
    c.add_argument("--spec", required=True)
    c.add_argument("--variant", help="variant to compile (with --steps: default all variants)")
    c.add_argument("--mode", choices=("max-autotune", "reduce-overhead"))
    c.add_argument("--cache-dir", help="torchair.inference.cache_compile folder")
    c.add_argument("--out", default="generated", help="where the generated modules are")
    c.add_argument("--standin", action="store_true",
                   help="trace on CPU with the torchair stand-in (structure check only; never an NPU result)")
    c.add_argument("--steps", type=int, metavar="N",
                   help="with --standin: run N mixed steps per variant and mode padded to the spec's shape "
                        "buckets and print the graphs compiled per variant and mode (exit 1: more than buckets, "
                        "or an op without a working GE converter)")
    c.add_argument("--mixed-batches", type=int, default=0, metavar="M",
                   help="with --standin --steps N: also run M mixed batches (decode rows and prefill chunks in one "
                        "forward) through each history prefill variant, padded to the mixed grid "
                        "(graphgen.npu.run.mixed_grid); its buckets then count the grid's cells")
    c.add_argument("--ops-json", metavar="FILE",
                   help="with --standin --steps N: also run one step per bucket of every variant and mode and "
                        "write each graph's post-AOT op targets to FILE (the GE converter check's input)")
    c.set_defaults(handler=cmd_compile)
