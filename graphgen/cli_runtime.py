"""CLI commands that go beyond the build path: ``run``, ``import-hf``, ``compile``.

``run`` and ``compile`` import torch, but only inside their handlers, so ``graphgen generate``
stays torch-free.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .cli import EXIT_INVALID, EXIT_OK, EXIT_STALE, EXIT_UNAVAILABLE, _err


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise SystemExit(_usage(f"--prompt-ids {text!r}: expected comma-separated integers, e.g. 1,2,3"))
    if not ids:
        raise SystemExit(_usage("--prompt-ids: empty prompt"))
    return ids


def _usage(msg: str) -> int:
    _err(f"graphgen run: error: {msg}")
    return EXIT_INVALID


def cmd_run(args) -> int:
    prompts = [_prompt_ids(p) for p in args.prompt_ids]  # before importing torch: fast errors
    from .runtime.engine import Engine
    from .runtime.faults import Faults
    from .runtime.kvcache import OutOfBlocks

    try:
        faults = Faults.parse(args.faults) if args.faults else None
    except ValueError as e:
        return _usage(f"--faults: {e}")
    weights = Path(args.weights)
    if not weights.is_dir():
        return _usage(f"--weights {weights}: not a folder (expected a Hugging Face checkpoint folder)")
    try:
        engine = Engine.from_spec(args.spec, weights, write=args.write, granularity=args.granularity,
                                  pool=args.pool, faults=faults, collect_logits=args.logits,
                                  num_blocks=args.num_blocks)
    except (ValueError, FileNotFoundError) as e:
        return _usage(str(e))
    with engine:
        try:
            results = engine.generate(prompts, args.max_new_tokens, batch=args.batch)
        except (ValueError, OutOfBlocks) as e:
            hint = "; raise --num-blocks" if isinstance(e, OutOfBlocks) else ""
            return _usage(f"{e}{hint}")
        engine.drain()
        for r in results:
            if args.json:
                print(json.dumps(r.to_json(with_logits=args.logits)))
            else:
                print(f"prompt[{len(r.prompt)}] -> {r.tokens}  (hit {r.hit_tokens} tokens, {r.variant}, "
                      f"TTFT {r.ttft_ms:.1f} ms)")
        if not args.json:
            _err(f"pool: {engine.stats['puts']} blocks committed, {engine.stats['put_failures']} put failures, "
                 f"{engine.stats['hit_blocks']} blocks hit")
    return EXIT_OK


def cmd_import_hf(args) -> int:
    from .modelspec.import_hf import import_hf

    spec = import_hf(args.hf_dir, args.out, name=args.name, block_size=args.block_size)
    print(f"wrote {args.out} ({spec.family}, {spec.dims.num_hidden_layers} layers, variants: "
          f"{', '.join(spec.variants)})")
    return EXIT_OK


def cmd_compile(args) -> int:
    from .lower.compile import mode_dir
    from .modelspec.loader import load_spec

    spec = load_spec(args.spec)
    if spec.targets.npu is None:
        _err(f"{args.spec}: the spec has no npu target; add `npu: {{}}` under targets")
        return EXIT_INVALID
    mode = args.mode or spec.targets.npu.compile_modes[0]
    if mode not in spec.targets.npu.compile_modes:
        _err(f"{args.spec}: compile mode {mode} is not generated; modes: {', '.join(spec.targets.npu.compile_modes)}")
        return EXIT_INVALID
    if args.variant not in spec.variants:
        _err(f"{args.spec}: no variant '{args.variant}'; variants: {', '.join(spec.variants)}")
        return EXIT_INVALID
    path = Path(args.out) / spec.name / "npu" / mode_dir(mode) / f"{args.variant}.py"
    if not path.exists():
        _err(f"{path}: not generated; run: graphgen generate")
        return EXIT_INVALID
    if args.standin:
        from .npu.structure import trace_and_check

        report = trace_and_check(path, spec)
        if not report.ok:
            _err(f"{path}: post-AOT structure check failed:")
            for p in report.problems:
                _err(f"  - {p}")
            return EXIT_STALE
        print(f"{path}: traced on CPU with the torchair stand-in in mode {mode}; post-AOT structure ok "
              f"(graph structure only — this is not an NPU build and nothing ran on an NPU)")
        return EXIT_OK
    from .npu.compile import NpuUnavailable, compile_module

    try:
        compile_module(path, mode, cache_dir=args.cache_dir)
    except NpuUnavailable as e:
        _err(f"graphgen compile: {e}")
        return EXIT_UNAVAILABLE
    print(f"{path}: wrapped for torchair in mode {mode} (graphs compile on the first call)")
    return EXIT_OK


def add_commands(sub) -> None:
    r = sub.add_parser("run", help="run prompts through the generated CPU graphs, an engine and a pool")
    r.add_argument("--spec", required=True)
    r.add_argument("--weights", required=True, help="Hugging Face checkpoint folder (config.json + safetensors)")
    r.add_argument("--prompt-ids", action="append", required=True, metavar="IDS",
                   help="comma-separated token ids; repeat for several prompts (run in order, one pool)")
    r.add_argument("--max-new-tokens", type=int, default=16)
    r.add_argument("--write", choices=("off", "sync", "async"), help="override mempool.write")
    r.add_argument("--granularity", choices=("forward", "layer"), help="override mempool.granularity")
    r.add_argument("--pool", default="host", choices=("host",), help="pool backend (default: embedded host pool)")
    r.add_argument("--num-blocks", type=int, default=512, help="device KV blocks")
    r.add_argument("--batch", action="store_true", help="batch the prompts instead of running them in order")
    r.add_argument("--faults", help="fault injection, e.g. save_delay=0.05,put_fail=0.5,seed=1 (docs/runtime.md)")
    r.add_argument("--json", action="store_true", help="one JSON object per prompt")
    r.add_argument("--logits", action="store_true", help="with --json: the first generated position's logits")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("import-hf", help="write a spec from a Hugging Face config.json (Qwen3, DeepSeek-V3)")
    i.add_argument("hf_dir")
    i.add_argument("--out", required=True, help="spec file to write, e.g. specs/my_model.yaml")
    i.add_argument("--name", help="model name (default: from the folder name)")
    i.add_argument("--block-size", type=int, default=128, help="KV block size in tokens (default: 128)")
    i.set_defaults(func=cmd_import_hf)

    c = sub.add_parser("compile", help="compile a generated NPU module with torchair (needs torch_npu)")
    c.add_argument("--target", choices=("npu",), required=True)
    c.add_argument("--spec", required=True)
    c.add_argument("--variant", required=True)
    c.add_argument("--mode", choices=("max-autotune", "reduce-overhead"))
    c.add_argument("--cache-dir", help="torchair.inference.cache_compile folder")
    c.add_argument("--out", default="generated", help="where the generated modules are")
    c.add_argument("--standin", action="store_true",
                   help="trace on CPU with the torchair stand-in (structure check only; never an NPU result)")
    c.set_defaults(func=cmd_compile)


if __name__ == "__main__":  # pragma: no cover
    from .cli import main

    sys.exit(main())
