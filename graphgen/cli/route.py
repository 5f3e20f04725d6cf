"""``graphgen route``: the P/D router in front of prefill and decode instances (docs/pd.md).

Prints ``graphgen route: listening on http://HOST:PORT`` once it accepts requests; SIGTERM or
Ctrl-C stops it. Torch-free: the router only moves HTTP.
"""

from __future__ import annotations

import argparse
import os
import sys
from urllib.parse import urlsplit

from ..engine_args import EXIT_INVALID

API_KEY_ENV = "GRAPHGEN_API_KEY"
BACKEND_KEY_ENV = "GRAPHGEN_BACKEND_API_KEY"


def register(subparsers) -> argparse.ArgumentParser:
    from ..balance import POLICIES

    p = subparsers.add_parser("route", help="route OpenAI requests over prefill and decode instances (P/D)",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill instance (graphgen serve --role prefill), repeatable; none: the decode "
                        "instances are only balanced (each serves as both)")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode instance (graphgen serve --role decode), repeatable")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 = a free port (printed on stdout)")
    p.add_argument("--policy", default="round_robin", choices=POLICIES,
                   help="how P and D are chosen (prefix: one prefix keeps its instance)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (repeatable; default ${API_KEY_ENV})")
    p.add_argument("--backend-api-key", default=None, metavar="KEY",
                   help=f"the key sent to the instances (default ${BACKEND_KEY_ENV})")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between backend health checks")
    p.add_argument("--prefill-timeout", type=float, default=120.0,
                   help="seconds a prefill may take before the request goes to decode without a handoff")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(handler=cmd_route)
    return p


def _err(msg: str) -> int:
    print(f"graphgen route: error: {msg}", file=sys.stderr)
    return EXIT_INVALID


def check_args(args) -> str | None:
    for flag in ("prefill", "decode"):
        for url in getattr(args, flag):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                return f"--{flag} {url}: expected http://HOST:PORT"
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    for flag in ("health_interval", "prefill_timeout"):
        if not getattr(args, flag) > 0:
            return f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}"
    if args.api_key is not None and any(not k for k in args.api_key):
        return "--api-key: empty key"
    return None


def cmd_route(args) -> int:
    from ..install import MissingExtra, require

    try:
        require("serve", "graphgen route")
    except MissingExtra as e:
        print(e, file=sys.stderr)
        return EXIT_INVALID
    problem = check_args(args)
    if problem:
        return _err(problem)
    import logging

    from ..route.app import create_router
    from ..serve.cli import bind_socket, run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    sock, problem = bind_socket(args.host, args.port)
    if problem:
        return _err(problem)
    api_keys = args.api_key if args.api_key is not None else (
        [os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else [])
    app = create_router(args.prefill, args.decode, policy=args.policy, api_keys=api_keys,
                        backend_api_key=args.backend_api_key or os.environ.get(BACKEND_KEY_ENV),
                        health_interval_s=args.health_interval, prefill_timeout_s=args.prefill_timeout)
    try:
        return run_server(app, args.host, args.port, args.log_level, 5.0, sock=sock, name="graphgen route")
    finally:
        sock.close()
