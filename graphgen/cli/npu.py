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
    if mode not in spec.targets.npu.compile_modes:
        err(f"{args.spec}: compile mode {mode} is not generated; modes: {', '.join(spec.targets.npu.compile_modes)}")
        return EXIT_INVALID
    if args.variant not in spec.variants:
        err(f"{args.spec}: no variant '{args.variant}'; variants: {', '.join(spec.variants)}")
        return EXIT_INVALID
    path = Path(args.out) / spec.name / "npu" / mode_dir(mode) / f"{args.variant}.py"
    if not path.exists():
        err(f"{path}: not generated; run: graphgen generate")
        return EXIT_INVALID
    if args.standin:
        from ..npu.structure import trace_and_check

        report = trace_and_check(path, spec)
        if not report.ok:
            err(f"{path}: post-AOT structure check failed:")
            for p in report.problems:
                err(f"  - {p}")
            return EXIT_STALE
        print(f"{path}: traced on CPU with the torchair stand-in in mode {mode}; post-AOT structure ok "
              f"(graph structure only — this is not an NPU build and nothing ran on an NPU)")
        return EXIT_OK
    from ..npu.compile import NpuUnavailable, compile_module

    try:
        compile_module(path, mode, cache_dir=args.cache_dir)
    except NpuUnavailable as e:
        err(f"graphgen compile: {e}")
        return EXIT_UNAVAILABLE
    print(f"{path}: wrapped for torchair in mode {mode} (graphs compile on the first call)")
    return EXIT_OK


def register(sub) -> None:
    c = sub.add_parser("compile", help="compile a generated NPU module with torchair (needs torch_npu)")
    c.add_argument("--target", choices=("npu",), required=True)
    c.add_argument("--spec", required=True)
    c.add_argument("--variant", required=True)
    c.add_argument("--mode", choices=("max-autotune", "reduce-overhead"))
    c.add_argument("--cache-dir", help="torchair.inference.cache_compile folder")
    c.add_argument("--out", default="generated", help="where the generated modules are")
    c.add_argument("--standin", action="store_true",
                   help="trace on CPU with the torchair stand-in (structure check only; never an NPU result)")
    c.set_defaults(handler=cmd_compile)
