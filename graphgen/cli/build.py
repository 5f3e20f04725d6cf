"""The build commands: ``generate``, ``check``, ``validate``, ``dump``, ``verify``, ``schema``, ``import-hf``.

None of them imports torch (tests check it): the build path needs only networkx, jinja2 and PyYAML.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .common import EXIT_INVALID, EXIT_OK, EXIT_STALE, err, usage_error

if TYPE_CHECKING:
    import argparse

    from ..ir.graph import Graph


def _spec_args(args: argparse.Namespace) -> list[Path] | None:
    """The named specs, or None for the default ``specs/*.yaml`` (which must not be empty: from a
    wheel, in a folder without specs, generating nothing and saying ok would hide the mistake)."""
    if args.spec:
        return [Path(p) for p in args.spec]
    from ..generate import DEFAULT_SPEC_DIR, default_spec_paths

    if not default_spec_paths():
        raise SystemExit(usage_error(args.command, f"no {DEFAULT_SPEC_DIR.as_posix()}/*.yaml in this folder: "
                                                   "pass --spec FILE (or run where the specs are)"))
    return None


def _fix_command(args: argparse.Namespace) -> str:
    cmd = ["graphgen", "generate"]
    for s in args.spec or ():
        cmd += ["--spec", s]
    if args.out != "generated":
        cmd += ["--out", args.out]
    return " ".join(cmd)


def _derived_files(args: argparse.Namespace) -> dict[Path, str]:
    """The checkout's files derived from the code (specs/schema.json, docs/spec.md's tables): written
    and checked with the generated files when the default specs are used in the root of a graphgen
    source checkout. Anywhere else (a wheel's user, a scratch folder) they are not that folder's
    business: ``graphgen schema`` prints the schema."""
    from ..install import is_checkout

    if args.spec or not is_checkout(Path(".")):
        return {}
    from ..modelspec.schema import derived_files

    return derived_files(Path("."))


def cmd_generate(args: argparse.Namespace) -> int:
    from ..generate import generate

    report = generate(_spec_args(args), Path(args.out), dry_run=args.dry_run)
    verb = "would write" if args.dry_run else "wrote"
    for rel in report.written:
        print(f"{verb} {Path(args.out) / rel}")
    for rel in report.removed:
        print(f"{'would remove' if args.dry_run else 'removed'} {Path(args.out) / rel}")
    if not args.dry_run:
        from ..generate import write_atomic

        for path, text in _derived_files(args).items():
            if write_atomic(path, text):
                print(f"wrote {path.as_posix()}")
    err(f"graphgen: {len(report.written)} {'to write' if args.dry_run else 'written'}, "
        f"{len(report.unchanged)} unchanged, {len(report.removed)} {'to remove' if args.dry_run else 'removed'}")
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    from ..generate import check

    res = check(_spec_args(args), Path(args.out), extra=_derived_files(args))
    if res.ok:
        print("graphgen check: generated files are up to date")
        return EXIT_OK
    if res.diff:
        sys.stdout.write(res.diff)
    for p in res.stale:
        err(f"stale: {p}")
    for p in res.orphans:
        err(f"orphan (no spec produces it): {p}")
    err(f"graphgen check: {len(res.stale)} stale, {len(res.orphans)} orphan file(s). Fix with:\n    {_fix_command(args)}")
    return EXIT_STALE


def cmd_validate(args: argparse.Namespace) -> int:
    from ..modelspec.loader import load_specs
    from ..passes.manager import run_pipeline

    from ..modelspec.errors import SpecError
    from ..npu.check.speclimits import limit_diagnostics
    from ..passes.memory import default_blocks_note, memory_problems, rank_memory

    if args.device_memory_gib is not None and not args.device_memory_gib > 0:
        return usage_error("validate", f"--device-memory-gib must be > 0, got {args.device_memory_gib}")
    u = args.device_memory_utilization
    if u is not None and not 0 < u <= 1:
        return usage_error("validate", f"--device-memory-utilization must be in (0, 1], got {u}")
    if args.num_blocks is not None and args.num_blocks < 1:
        return usage_error("validate", f"--num-blocks must be >= 1, got {args.num_blocks}")
    specs = load_specs([Path(p) for p in args.specs])
    status = EXIT_OK
    limits = []  # a spec declaring the NPU target must stay inside the kernels' documented limits
    for path, spec in zip(args.specs, specs):
        graphs = [run_pipeline(spec, v, spec_file=path) for v in spec.variants]
        found = limit_diagnostics(path, spec)
        limits += found
        mem = rank_memory(spec, graphs, args.device_memory_gib, utilization=u, num_blocks=args.num_blocks)
        # over the device is an error whoever named it (the flag, the spec, or the NPU target's default die):
        # the line says "does not fit" and the exit code says so too
        problems = memory_problems(spec, mem, args.device_memory_gib, num_blocks=args.num_blocks)
        for p in problems:
            err(f"{path}: error: {p}")
        note = default_blocks_note(mem)
        if note is not None:
            err(f"{path}: note: {note}")
        status = EXIT_INVALID if problems else status
        if not found:
            npu = " (NPU kernel limits ok)" if spec.targets.npu is not None else ""
            print(f"{path}: {'ok' if not problems else 'does not fit'} ({spec.family}, "
                  f"{spec.dims.num_hidden_layers} layers, variants: {', '.join(spec.variants)}){npu}; {mem.text()}")
    if limits:
        raise SpecError(limits)
    return status


def cmd_dump(args: argparse.Namespace) -> int:
    from ..ir.text import print_graph
    from ..modelspec.loader import load_spec
    from ..passes.manager import run_pipeline

    spec = load_spec(args.spec)
    if args.variant not in spec.variants:
        err(f"{args.spec}: no variant '{args.variant}'; variants: {', '.join(spec.variants)}")
        return EXIT_INVALID
    graph = run_pipeline(spec, args.variant, spec_file=args.spec, until=args.after)
    sys.stdout.write(print_graph(graph) if args.format == "text" else _to_dot(graph))
    return EXIT_OK


def _to_dot(graph: Graph) -> str:
    from ..ir.graph import HOST_STREAM, MAIN_STREAM, SAVE_STREAM

    hb = graph.to_networkx()
    colors = {MAIN_STREAM: "lightblue", SAVE_STREAM: "orange", HOST_STREAM: "lightgrey"}
    lines = [f'digraph "{graph.name}" {{', "  rankdir=TB; node [shape=box, style=filled];"]
    for n in graph.nodes:
        lines.append(f'  "{n.id}" [label="{n.id}\\n{n.op}", fillcolor="{colors.get(n.stream, "white")}"];')
    for u, v, d in hb.edges(data=True):
        style = {"event": ' [color=red, penwidth=2, label="' + str(d.get("event", "")) + '"]',
                 "data": "", "program": " [style=dashed]"}[d["kind"]]
        lines.append(f'  "{u}" -> "{v}"{style};')
    lines.append("}")
    return "\n".join(lines) + "\n"


def cmd_verify(args: argparse.Namespace) -> int:
    from ..ir.text import ParseError, parse_graph
    from ..passes.verify import check as verify_graph

    status = EXIT_OK
    for f in args.files:
        try:
            graph = parse_graph(Path(f).read_text(encoding="utf-8"), f)
        except OSError as e:
            err(f"{f}: cannot read: {e.strerror}")
            return EXIT_INVALID
        except ParseError as e:
            err(f"error: {e}")
            return EXIT_INVALID
        problems = verify_graph(graph)
        if problems:
            err(f"{f}: {len(problems)} problem(s) in {graph.name}:")
            for p in problems:
                err(f"  - {p}")
            status = EXIT_STALE
        else:
            print(f"{f}: ok ({len(graph.nodes)} nodes, {len(graph.events)} events, race-free)")
    return status


def cmd_schema(args: argparse.Namespace) -> int:
    from ..modelspec.schema import schema_text

    sys.stdout.write(schema_text())
    return EXIT_OK


def cmd_import_hf(args: argparse.Namespace) -> int:
    from ..modelspec.import_hf import LayoutError, import_hf

    for flag in ("tp", "ep", "dp"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            return usage_error("import-hf", f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.device_memory_gib is not None and not args.device_memory_gib > 0:
        return usage_error("import-hf", f"--device-memory-gib must be > 0, got {args.device_memory_gib}")
    if args.fit and any(getattr(args, f) is not None for f in ("tp", "ep", "dp")):
        return usage_error("import-hf", "--fit picks tp and ep itself: give --fit or --tp/--ep/--dp, not both")
    fit = None
    if args.fit:  # the picker is the passes' (memory.choose_layout): the spec model sits below them
        from functools import partial

        from ..passes.memory import choose_layout

        fit = partial(choose_layout, device_memory_gib=args.device_memory_gib)
    try:
        spec = import_hf(args.hf_dir, args.out, name=args.name, block_size=args.block_size, tp=args.tp, ep=args.ep,
                         dp=args.dp, device_memory_gib=args.device_memory_gib, fit=fit,
                         quantization=args.quantization)
    except LayoutError as e:
        err(f"graphgen import-hf: {e}")
        return EXIT_INVALID
    par = spec.parallel
    layout = f"tp={par.tp}, ep={par.ep}" + (f", dp={par.dp}" if par.dp > 1 else "")
    print(f"wrote {args.out} ({spec.family}, {spec.dims.num_hidden_layers} layers, variants: "
          f"{', '.join(spec.variants)}; {layout})")
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    g = sub.add_parser("generate", help="write generated/ from the specs (atomic, only changed files)")
    g.add_argument("--spec", action="append", help="spec file (repeatable; default: specs/*.yaml)")
    g.add_argument("--out", default="generated", help="output folder (default: generated)")
    g.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    g.set_defaults(handler=cmd_generate)

    c = sub.add_parser("check", help="exit 1 with a diff if generated/ is stale or has orphans")
    c.add_argument("--spec", action="append", help="spec file (repeatable; default: specs/*.yaml)")
    c.add_argument("--out", default="generated")
    c.set_defaults(handler=cmd_check)

    v = sub.add_parser("validate", help="load, check and build every variant of the given specs")
    v.add_argument("specs", nargs="+")
    v.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                   help="memory of one device: exit 2 when a rank's peak (weights, KV for the largest decode "
                        "batch, staging rings, communicators, load transient) exceeds the engine's share of it, "
                        "naming a layout that fits (default: each spec's targets.npu.device_memory_gib, else the "
                        "NPU target's 64 GiB die)")
    v.add_argument("--device-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="the engine's share of what the device gives torch, as the launch's flag (default 0.9)")
    v.add_argument("--num-blocks", type=int, default=None,
                   help="count the KV cache a launch with --num-blocks N allocates instead of what the largest "
                        "decode batch needs")
    v.set_defaults(handler=cmd_validate)

    from ..passes.manager import AFTER_CHOICES

    d = sub.add_parser("dump", help="print a variant's graph (optionally after a given pass)")
    d.add_argument("spec")
    d.add_argument("variant")
    d.add_argument("--after", choices=AFTER_CHOICES, help="stop after this pass (default: all)")
    d.add_argument("--format", choices=("text", "dot"), default="text")
    d.set_defaults(handler=cmd_dump)

    vf = sub.add_parser("verify", help="parse and verify golden graph files (e.g. hand-edited)")
    vf.add_argument("files", nargs="+")
    vf.set_defaults(handler=cmd_verify)

    s = sub.add_parser("schema", help="print the JSON Schema of the spec format")
    s.set_defaults(handler=cmd_schema)

    i = sub.add_parser("import-hf", help="write a spec from a Hugging Face config.json (Qwen3, DeepSeek-V3)")
    i.add_argument("hf_dir")
    i.add_argument("--out", required=True, help="spec file to write, e.g. specs/my_model.yaml")
    i.add_argument("--name", help="model name (default: from the folder name)")
    i.add_argument("--block-size", type=int, default=128, help="KV block size in tokens (default: 128)")
    i.add_argument("--tp", type=int, default=None, help="parallel.tp of the spec (default: 1)")
    i.add_argument("--ep", type=int, default=None, help="parallel.ep of the spec (default: 1)")
    i.add_argument("--dp", type=int, default=None, help="parallel.dp of the spec (default: 1)")
    i.add_argument("--device-memory-gib", type=float, default=None, metavar="GIB",
                   help="targets.npu.device_memory_gib of the spec (graphgen validate holds the layout to it)")
    i.add_argument("--fit", action="store_true",
                   help="pick the smallest layout (tp, ep) that fits --device-memory-gib (default: the NPU "
                        "target's 64 GiB die), as graphgen validate counts it")
    i.add_argument("--quantization", choices=("none", "w8a8_dynamic"), default="none",
                   help="quantization.method of the spec: w8a8_dynamic = int8 linear layers, quantized at load "
                        "(docs/spec.md, 'Quantization'; default: none)")
    i.set_defaults(handler=cmd_import_hf)
