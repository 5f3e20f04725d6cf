"""``graphgen serve``: an OpenAI-compatible HTTP server on a spec and a checkpoint folder.

``register(subparsers)`` adds the command to graphgen's CLI; ``python -m graphgen.serve`` runs it
alone. torch, FastAPI and uvicorn are imported inside the handler only. ``--port 0`` picks a free
port; the bound address is printed on stdout (``graphgen serve: listening on http://HOST:PORT``)
once the server accepts requests.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from ..engine_args import (
    EXIT_INVALID,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    add_engine_arguments,
    add_lora_arguments,
    add_speculative_arguments,
    check_engine_arguments,
    engine_options,
    follow_node,
    layout_refusal,
    placement_of,
    target_note,
    thread_options,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = "GRAPHGEN_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, max_num_seqs=64, async_scheduling=True)
    add_speculative_arguments(p)
    add_lora_arguments(p, serve=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="0 = a free port (printed on stdout)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the spec's name)")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="info adds an access log line per request (graphgen.serve.access)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every /v1/* route (repeatable; default: "
                        f"${API_KEY_ENV} if set); /health and /metrics stay open")
    p.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="larger request bodies get a 413 (checked before the body is read)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="parse tool calls out of chat output: hermes (Qwen3) or deepseek_v31 (default: the spec "
                        "family's when its features list function_call; otherwise requests with tools are a 400)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="move <think>...</think> to reasoning_content: qwen3 or deepseek_r1 (default: "
                        "the spec family's when its features list reasoning_parser)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs / top_logprobs a request may ask for (prompt logprobs too)")
    p.add_argument("--role", default="both", choices=("prefill", "decode", "both"),
                   help="P/D disaggregation (docs/pd.md): prefill answers with one dropped token and "
                        "kv_transfer_params; decode loads a request's handed-off blocks from the shared pool")
    p.add_argument("--kv-lease-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a prefill instance keeps handed-off blocks leased in the pool unless "
                        "released first (POST /v1/kv/release)")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    p.set_defaults(handler=cmd_serve)
    return p


def _err(msg: str) -> int:
    print(f"graphgen serve: error: {msg}", file=sys.stderr)
    return EXIT_INVALID


def load_tokenizer(folder: Path):
    """The checkpoint folder's tokenizer, or None when it has none (prompts are then token ids)."""
    from ..runtime import load_tokenizer as load

    return load(folder)


def check_args(args):
    """Every argument checked before anything heavy is imported or loaded; returns (an error
    message or None, the spec). The port is checked by binding it (``bind_socket``), also first."""
    problem = check_engine_arguments(args)
    if problem:
        return problem, None
    for flag, low in (("max_request_bytes", 1),):
        v = getattr(args, flag)
        if v is not None and v < low:
            return f"--{flag.replace('_', '-')} must be >= {low}, got {v}", None
    if not args.drain_timeout >= 0:
        return f"--drain-timeout must be >= 0, got {args.drain_timeout}", None
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}", None
    if args.api_key is not None and any(not k for k in args.api_key):
        return "--api-key: empty key", None
    weights = Path(args.weights)
    if not weights.is_dir():
        return f"--weights {weights}: not a folder (expected a Hugging Face checkpoint folder)", None
    from ..modelspec.loader import load_spec

    try:
        spec = load_spec(args.spec)
    except Exception as e:  # a spec error renders with its file:line
        return f"--spec {args.spec}: {e}", None
    refusal = layout_refusal(spec, args)
    if refusal is not None:  # before the port and the weights: one sentence, exit 2
        return refusal, None
    from .tools import PARSERS
    from .reasoning import PARSERS as REASONING

    for flag, known in (("tool_call_parser", PARSERS), ("reasoning_parser", REASONING)):
        v = getattr(args, flag, None)
        if v is not None and v not in known:
            return f"--{flag.replace('_', '-')} {v}: not one of {', '.join(known)}", None
    if not args.kv_lease_timeout > 0:
        return f"--kv-lease-timeout must be > 0, got {args.kv_lease_timeout}", None
    if args.role != "both":  # the handoff goes through a pool both instances see (any layout: docs/pd.md)
        write = args.write or spec.pool.write
        if write == "off" or args.pool == "host":
            return (f"--role {args.role} hands the KV over through a shared pool: it needs --pool "
                    f"mooncake://HOST:PORT (not host) and a --write other than off (got --pool {args.pool}, "
                    f"write {write})"), None
    bs = spec.kv_cache.block_size
    need = -(-2 // bs)  # one prompt token and one generated token
    if args.num_blocks < need:
        return (f"--num-blocks {args.num_blocks}: one request needs at least {need} block(s) "
                f"(a 1-token prompt and 1 generated token; block_size {bs})"), None
    return None, spec


def bind_socket(host: str, port: int):
    """The listening socket, bound before the model loads (a busy port fails fast); (sock, error)."""
    from ..netutil import bind_socket as bind

    return bind(host, port)


def cmd_serve(args) -> int:
    from ..install import MissingExtra, require

    try:  # before anything heavy loads; also when run alone (python -m graphgen.serve)
        require("serve", "graphgen serve")
        if args.pool.startswith("mooncake://"):
            require("mooncake", "graphgen serve")
    except MissingExtra as e:
        print(e, file=sys.stderr)
        return EXIT_INVALID
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    problem, spec = check_args(args)
    if problem:
        return _err(problem)
    try:
        here = placement_of(args, spec)
        if not here.driver:  # another node's ranks for node 0's driver, which serves HTTP: no port here
            return follow_node(args, spec, here, "graphgen serve")
    except (ValueError, FileNotFoundError) as e:
        return _err(str(e))
    weights = Path(args.weights)
    api_keys = args.api_key if args.api_key is not None else (
        [os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])
    sock, problem = bind_socket(args.host, args.port)  # before the model loads: a busy port fails fast
    if problem:
        return _err(problem)
    try:
        return _serve(args, weights, sock, api_keys, spec, here)
    finally:
        sock.close()


def chat_setup(args, spec):
    """The tool-call and reasoning parsers: the flags, else the family's when the spec's features
    list ``function_call`` / ``reasoning_parser``."""
    from ..runtime import chat_parsers
    from .tools import ChatSetup

    tool, reasoning = args.tool_call_parser, args.reasoning_parser
    feats = set(getattr(spec, "features", ()) or ())
    family_tool, family_reasoning = chat_parsers(spec.family)
    if tool is None and "function_call" in feats:
        tool = family_tool
    if reasoning is None and "reasoning_parser" in feats:
        reasoning = family_reasoning
    return ChatSetup(tool, reasoning)


def _serve(args, weights: Path, sock, api_keys, spec, here=None) -> int:
    from ..runtime import Faults, RankFailure, open_engine
    from ..trace import NULL, TraceRecorder
    from .adapter import EngineAdapter
    from .app import create_app

    try:
        faults = Faults.parse(args.faults) if args.faults else None
    except ValueError as e:
        return _err(f"--faults: {e}")
    # several ranks: one process per rank, each with torch_threads threads
    ranks = thread_options(args, spec)
    unavailable: tuple = ()
    if args.target == "npu":  # the NPU model runner registers the target
        from ..npu.run import NpuUnavailable

        unavailable = (NpuUnavailable,)
    try:
        # the spec check_args loaded (once per serve): open_engine applies the run's overrides to it
        engine = open_engine(spec, weights, spec_file=args.spec, **engine_options(args, faults, placement=here),
                             **ranks)
    except unavailable as e:  # no torch_npu here: one sentence, exit 3 (as graphgen run)
        print(f"graphgen serve: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (ValueError, FileNotFoundError, RankFailure) as e:  # RankFailure: a rank did not start
        return _err(str(e))
    if target_note(args):  # once the engine is up
        print(f"graphgen serve: {target_note(args)}", file=sys.stderr, flush=True)
    from ..runtime import eos_token_ids

    tokenizer = load_tokenizer(weights)
    trace = TraceRecorder(args.trace, process_name="graphgen serve") if args.trace else NULL
    # the checkpoint's EOS ids (generation_config.json over config.json, plus the tokenizer's)
    eos = [] if args.ignore_eos else eos_token_ids(weights)
    adapter = EngineAdapter(engine, eos_token_ids=eos, trace=trace, model_name=args.served_model_name)
    app = create_app(adapter, tokenizer=tokenizer, trace=trace, drain_timeout_s=args.drain_timeout,
                     api_keys=api_keys, max_request_bytes=args.max_request_bytes, tokenizer_dir=weights,
                     chat_setup=chat_setup(args, spec), max_logprobs=args.max_logprobs,
                     role=args.role, kv_lease_timeout_s=args.kv_lease_timeout)
    # a node lost, or a P/D instance's rank lost, ends the server: its engine is gone, and a P or D that
    # stayed up with no engine would hold the router's requests; exited, the router falls back (recompute)
    if (here is not None and here.multi_node) or args.role != "both":
        app.state.loop.on_engine_end = _engine_ended
    return run_server(app, args.host, args.port, args.log_level, args.drain_timeout, sock=sock)


def _engine_ended(sentence: str, in_flight: int) -> None:
    """From the engine loop, once it answered the requests in flight with the sentence: say it, exit 2
    (a second later when requests were in flight: their error events reach the clients first)."""
    print(f"graphgen serve: {sentence}", file=sys.stderr, flush=True)
    threading.Timer(1.0 if in_flight else 0.0, os._exit, (EXIT_INVALID,)).start()


def run_server(app, host: str, port: int, log_level: str = "warning", drain_timeout_s: float = 30.0,
               sock=None, name: str = "graphgen serve") -> int:
    """Bind (``port`` 0: a free one; or serve ``sock``, bound already), announce, serve until
    SIGINT/SIGTERM. The first signal drains while the socket still answers (``/health`` 503, new
    requests 503, running ones get ``drain_timeout_s``, then are cut with an error event), then
    uvicorn stops; a second signal stops at once."""
    import uvicorn

    if sock is None:
        sock, problem = bind_socket(host, port)
        if problem:
            return _err(problem)
    bound = sock.getsockname()
    drain = getattr(app.state, "drain", None)

    class _Server(uvicorn.Server):
        draining = False

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            print(f"{name}: listening on http://{bound[0]}:{bound[1]}", flush=True)

        def handle_exit(self, sig, frame):
            if drain is None or self.draining or self.should_exit:
                return super().handle_exit(sig, frame)
            self.draining = True

            def run():
                try:
                    drain()
                except Exception:
                    logging.getLogger("graphgen.serve").exception("drain failed")
                finally:
                    self.should_exit = True

            threading.Thread(target=run, name="drain", daemon=True).start()

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the captured signal after its graceful shutdown (the process then
            # dies of SIGTERM); a drained shutdown is a clean exit here: exit code 0.
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=int(drain_timeout_s) + 1,
                            access_log=False)
    server = _Server(config)
    server.run(sockets=[sock])
    return EXIT_OK


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m graphgen.serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(ap)
    return cmd_serve(ap.parse_args(argv))
