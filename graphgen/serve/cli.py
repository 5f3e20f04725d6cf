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
import signal
import socket
import sys
from pathlib import Path

EXIT_OK, EXIT_INVALID = 0, 2  # as in cli/common.py (a missing extra is exit 2 too)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", required=True, help="model spec (YAML)")
    p.add_argument("--weights", required=True, help="Hugging Face checkpoint folder (a tokenizer in it enables text)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = a free port (printed on stdout)")
    p.add_argument("--write", choices=("off", "sync", "async"), default=None, help="override mempool.write")
    p.add_argument("--granularity", choices=("forward", "layer"), default=None, help="override mempool.granularity")
    p.add_argument("--pool", default="host", metavar="URL",
                   help="pool backend: host (the embedded pool) or mooncake://HOST:PORT[?option=value&...] "
                        "(a Mooncake master shared by processes; docs/mooncake.md)")
    p.add_argument("--tp", type=int, default=None,
                   help="override parallel.tp: tensor-parallel ranks, one process each (docs/parallel.md)")
    p.add_argument("--ep", type=int, default=None, help="override parallel.ep: expert-parallel ranks (1 or --tp)")
    p.add_argument("--num-blocks", type=int, default=512, help="device KV blocks")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests admitted or running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens of one step (a prompt must fit: no chunked prefill)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="prepare step N+1 while step N runs (default on; tokens are identical either way)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the spec's name)")
    p.add_argument("--faults", default=None, help="fault injection, e.g. save_delay=0.05 (see docs/runtime.md)")
    p.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace-event JSON on exit")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds running requests get on SIGTERM")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--log-level", default="warning")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(handler=cmd_serve)
    return p


def _err(msg: str) -> int:
    print(f"graphgen serve: error: {msg}", file=sys.stderr)
    return EXIT_INVALID


def _ranks(args) -> int:
    """How many rank processes the layout asks for (the overrides, else the spec's ``parallel:``)."""
    tp, ep = args.tp, args.ep
    if tp is None or ep is None:  # not given: the spec's own layout decides
        try:
            from ..modelspec.loader import load_spec

            par = load_spec(args.spec).parallel
        except Exception:  # a bad spec is reported, with its location, where the engine loads it
            par = None
        tp = tp if tp is not None else getattr(par, "tp", 1)
        ep = ep if ep is not None else getattr(par, "ep", 1)
    return max(tp, ep)


def load_tokenizer(folder: Path):
    """The checkpoint folder's tokenizer, or None when it has none (prompts are then token ids)."""
    if not ((folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists()):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def cmd_serve(args) -> int:
    from ..install import MissingExtra, require

    try:  # before anything heavy loads; also when run alone (python -m graphgen.serve)
        require("serve", "graphgen serve")
        if args.pool.startswith("mooncake://"):
            require("mooncake", "graphgen serve")
    except MissingExtra as e:
        print(e, file=sys.stderr)
        return EXIT_INVALID
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.max_num_seqs < 1:
        return _err("--max-num-seqs must be >= 1")
    if args.max_num_batched_tokens < 1:
        return _err("--max-num-batched-tokens must be >= 1")
    weights = Path(args.weights)
    if not weights.is_dir():
        return _err(f"--weights {weights}: not a folder (expected a Hugging Face checkpoint folder)")
    import torch

    from ..runtime.parallel.launcher import RankFailure
    from ..runtime.engine.facade import Engine
    from ..runtime.core.faults import Faults
    from ..trace import NULL, TraceRecorder
    from .adapter import LLMEngineAdapter
    from .app import create_app

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    try:
        faults = Faults.parse(args.faults) if args.faults else None
    except ValueError as e:
        return _err(f"--faults: {e}")
    # several ranks: a DistributedEngine (one process per rank, each with torch_threads threads)
    ranks = {"threads": args.torch_threads} if _ranks(args) > 1 else {}
    try:
        engine = Engine.from_spec(args.spec, weights, write=args.write, granularity=args.granularity,
                                  pool=args.pool, faults=faults, num_blocks=args.num_blocks, tp=args.tp, ep=args.ep,
                                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  async_scheduling=args.async_scheduling, **ranks)
    except (ValueError, FileNotFoundError, RankFailure) as e:  # RankFailure: a rank did not start
        return _err(str(e))
    tokenizer = load_tokenizer(weights)
    trace = TraceRecorder(args.trace, process_name="graphgen serve") if args.trace else NULL
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    adapter = LLMEngineAdapter(engine, eos_token_id=eos, trace=trace, model_name=args.served_model_name)
    app = create_app(adapter, tokenizer=tokenizer, trace=trace, drain_timeout_s=args.drain_timeout)
    return run_server(app, args.host, args.port, args.log_level, args.drain_timeout)


def run_server(app, host: str, port: int, log_level: str = "warning", drain_timeout_s: float = 30.0) -> int:
    """Bind (``port`` 0: a free one), announce, serve until SIGINT/SIGTERM; uvicorn then stops
    accepting, gives open requests ``drain_timeout_s`` and runs the app's shutdown."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        return _err(f"cannot listen on {host}:{port}: {e}")
    bound = sock.getsockname()

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            print(f"graphgen serve: listening on http://{bound[0]}:{bound[1]}", flush=True)

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
    ap = argparse.ArgumentParser(prog="python -m graphgen.serve", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return cmd_serve(ap.parse_args(argv))
