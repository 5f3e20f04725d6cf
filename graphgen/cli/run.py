"""``graphgen run``: prompts through the generated CPU graphs, an engine and a pool.

torch is imported inside the handler only, after the arguments are checked, so bad arguments fail
fast and building the parser stays torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..engine_args import (add_engine_arguments, add_lora_arguments, add_speculative_arguments, check_engine_arguments, engine_options,
                           follow_node, layout_refusal, placement_of, target_note, thread_options)
from .common import EXIT_INVALID, EXIT_OK, EXIT_UNAVAILABLE, err, usage_error


def _usage(msg: str) -> int:
    return usage_error("run", msg)


def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise SystemExit(_usage(f"--prompt-ids {text!r}: expected comma-separated integers, e.g. 1,2,3"))
    if not ids:
        raise SystemExit(_usage("--prompt-ids: empty prompt"))
    return ids


def _text_prompts(args, weights: Path):
    """Tokenize the ``--prompt TEXT`` prompts with the checkpoint's tokenizer (in argument order
    with ``--prompt-ids``); SystemExit(2) when the folder has no tokenizer."""
    from ..runtime import load_tokenizer

    tok = load_tokenizer(weights)
    if tok is None:
        raise SystemExit(_usage(f"--prompt needs a tokenizer in {weights} (tokenizer.json); use --prompt-ids"))
    out = []
    for kind, v in args.prompts:
        if kind == "ids":
            out.append(v)
            continue
        ids = list(tok.encode(v, add_special_tokens=False))
        if not ids:
            raise SystemExit(_usage(f"--prompt {v!r}: tokenizes to no tokens"))
        out.append(ids)
    return out


def _placement(args):
    """(the spec file's spec, where this process's ranks run); SystemExit(2) with one sentence."""
    from ..modelspec.loader import load_spec

    try:  # a spec error that is no ValueError renders with its file:line (cli/common.py's dispatch)
        spec = load_spec(args.spec)
        return spec, placement_of(args, spec)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(_usage(str(e)))


def cmd_run(args) -> int:
    problem = check_engine_arguments(args)
    if problem:
        return _usage(problem)
    spec, here = _placement(args)
    refusal = layout_refusal(spec, args)  # the one refusal table, before the weights load (open_engine checks too)
    if refusal is not None:
        return _usage(refusal)
    if not here.driver:  # another node's ranks, for node 0's driver (which runs the prompts)
        try:
            return follow_node(args, spec, here, "graphgen run")
        except (ValueError, FileNotFoundError) as e:
            return _usage(str(e))
    if not args.prompts:
        return _usage("give at least one --prompt-ids IDS or --prompt TEXT")
    # --prompt-ids before importing torch: fast errors
    args.prompts = [(k, _prompt_ids(v) if k == "ids" else v) for k, v in args.prompts]
    # a missing extra is one sentence and exit 2 (cli/common.py's dispatch): the runtime's is checked
    # by importing graphgen.runtime; Mooncake's here too, before the engine loads, not at pool creation
    if args.pool.startswith("mooncake://"):
        from ..install import require

        require("mooncake", "graphgen run")
    from ..runtime import Faults, RankFailure, open_engine

    try:
        faults = Faults.parse(args.faults) if args.faults else None
    except ValueError as e:
        return _usage(f"--faults: {e}")
    weights = Path(args.weights)
    if not weights.is_dir():
        return _usage(f"--weights {weights}: not a folder (expected a Hugging Face checkpoint folder)")
    if args.max_new_tokens < 1:
        return _usage("--max-new-tokens must be >= 1")
    prompts = _text_prompts(args, weights) if any(k == "text" for k, _ in args.prompts) else [
        v for _, v in args.prompts]
    if args.target == "npu":  # the NPU model runner registers the target (graphgen/npu/run/runner.py)
        import graphgen.npu.run  # noqa: F401  (registers the "npu" target)
    from ..npu.run.compile import NpuUnavailable

    threads = thread_options(args, spec) if args.torch_threads else {}
    try:
        engine = open_engine(args.spec, weights, collect_logits=args.logits,
                             **engine_options(args, faults, placement=here), **threads)
    except NpuUnavailable as e:
        err(f"graphgen run: {e}")
        return EXIT_UNAVAILABLE
    except (ValueError, FileNotFoundError) as e:
        return _usage(str(e))
    except RankFailure as e:
        err(f"graphgen run: {e}")
        return EXIT_INVALID
    if target_note(args):  # once the engine is up (a refusal stays one sentence)
        err(f"graphgen run: {target_note(args)}")
    from ..runtime import eos_token_ids

    eos = [] if args.ignore_eos else eos_token_ids(weights)
    if eos:  # generation stops at the checkpoint's EOS ids (the token is kept)
        engine.core.eos_token_ids = tuple(eos)
    trace = None
    if args.trace:
        from ..trace import StepObserver, TraceRecorder

        trace = TraceRecorder(args.trace, process_name="graphgen run")
        engine.observe(StepObserver(trace))
    try:
        return _generate(engine, prompts, args)
    finally:
        if trace is not None:
            trace.close()  # after the engine closed: every commit is in it


def _generate(engine, prompts, args) -> int:
    from ..runtime import OutOfBlocks, RankFailure

    with engine:
        try:
            # --lora: its one adapter (an engine of ranks takes none: the spec rule refuses LoRA with ranks)
            lora = {"lora": next(iter(engine.core.adapters))} if args.lora else {}
            results = engine.generate(prompts, args.max_new_tokens, batch=args.batch, **lora)
        except (ValueError, OutOfBlocks) as e:
            hint = "; raise --num-blocks" if isinstance(e, OutOfBlocks) else ""
            return _usage(f"{e}{hint}")
        except RankFailure as e:
            err(f"graphgen run: {e}")
            return EXIT_INVALID
        engine.drain()
        for r in results:
            spec = _speculative_counters(r) if args.speculative is not None else {}
            if args.json:
                print(json.dumps(dict(r.to_json(with_logits=args.logits), finish_reason=r.finish_reason, **spec)))
            else:
                mtp = (f", mtp: {r.num_accepted_tokens}/{r.num_draft_tokens} drafts accepted"
                       f" ({_rate(r)})" if args.speculative is not None else "")
                print(f"prompt[{len(r.prompt)}] -> {r.tokens}  (hit {r.hit_tokens} tokens, {r.variant}, "
                      f"TTFT {r.ttft_ms:.1f} ms{mtp}, {r.finish_reason})")
        if not args.json:
            err(f"pool: {engine.stats['puts']} blocks committed, {engine.stats['put_failures']} put failures, "
                f"{engine.stats['hit_blocks']} blocks hit")
        if args.speculative is not None:  # stderr, also with --json: the run's draft acceptance
            drafts, accepted = sum(r.num_draft_tokens for r in results), sum(r.num_accepted_tokens for r in results)
            rate = f"{100.0 * accepted / drafts:.1f}%" if drafts else "n/a (no drafts verified)"
            err(f"speculative mtp: acceptance rate {rate} ({accepted}/{drafts} draft tokens accepted)")
        ps = engine.pool_stats()  # after drain: every commit has landed
        # ranks on Mooncake: each rank its own client (on several nodes, each announcing its node's address)
        per_rank = engine.rank_pool_stats() if "master" in ps and hasattr(engine, "rank_pool_stats") else []
    if "master" in ps:  # a Mooncake pool (stderr, also with --json): each failure cost a recompute
        err(f"mooncake pool {ps['master']}: {ps['errors']} errors, {ps['put_failures']} put failures, "
            f"{ps['rejected']} rejected values, {ps.get('segment_full', 0)} segment full"
            + (f", down ({ps['last_error']})" if ps.get("down") else ""))
    for rank, rs in enumerate(per_rank):
        err(f"mooncake pool: rank {rank}'s client at {rs['local_hostname']}: {rs['puts']} puts "
            f"({rs['put_failures']} failed), {rs['get_hits']} of {rs['gets']} gets hit, {rs['errors']} errors")
    return EXIT_OK


def _rate(r) -> str:
    return f"{100.0 * r.num_accepted_tokens / r.num_draft_tokens:.0f}%" if r.num_draft_tokens else "no drafts"


def _speculative_counters(r) -> dict:
    """``run --json``'s acceptance fields of one request (vLLM's counter names)."""
    return {"speculative": "mtp", "spec_decode_num_draft_tokens": r.num_draft_tokens,
            "spec_decode_num_accepted_tokens": r.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(r.accepted_per_pos),
            "acceptance_rate": r.acceptance_rate}


def register(sub) -> None:
    r = sub.add_parser("run", help="run prompts through the generated CPU graphs, an engine and a pool")
    add_engine_arguments(r, max_num_seqs=256, async_scheduling=False)
    add_speculative_arguments(r)
    add_lora_arguments(r, serve=False)
    r.add_argument("--prompt-ids", action="append", dest="prompts", type=lambda v: ("ids", v), metavar="IDS",
                   help="comma-separated token ids; repeat for several prompts (run in order, one pool)")
    r.add_argument("--prompt", action="append", dest="prompts", type=lambda v: ("text", v), metavar="TEXT",
                   help="text, tokenized with the checkpoint's tokenizer; repeat for several prompts")
    r.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per prompt (default 16)")
    r.add_argument("--batch", action="store_true", help="batch the prompts instead of running them in order")
    r.add_argument("--json", action="store_true", help="one JSON object per prompt")
    r.add_argument("--logits", action="store_true", help="with --json: the first generated position's logits")
    r.set_defaults(handler=cmd_run)
