#!/usr/bin/env python3
"""A local P/D cluster in one command (docs/pd.md): a Mooncake store, prefill and decode instances
(``graphgen serve --role``, one torch thread each) and ``graphgen route`` over them, all on loopback
inside a private network namespace (Mooncake binds some listeners on 0.0.0.0).

    scripts/pd_cluster.py --spec specs/tiny_qwen3.yaml --weights CKPT [--prefill 2] [--decode 1] [--both N]
                          [--router-port 8080] [--policy round_robin] [--write async|sync]
                          [--decode-write async|sync] [--then CMD ...]

It prints ``pd_cluster: router http://127.0.0.1:PORT`` once the router accepts requests, with the
``nsenter`` prefix that reaches it (the namespace is private), and runs until Ctrl-C / SIGTERM,
then stops everything. ``--then CMD ...``: run CMD inside the namespace (``$ROUTER_URL`` set),
stop the cluster, and exit with CMD's status. Needs root (or CAP_SYS_ADMIN) for ``unshare -n``;
``--no-netns`` runs on the host's loopback instead (Mooncake's 0.0.0.0 listeners are then exposed).
Logs: one file per process under ``--log-dir`` (default: a temporary folder, printed).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSIDE = "PD_CLUSTER_INSIDE"


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--both", type=int, default=0,
                    help="instead: N --role both instances behind the router (no prefill instances)")
    ap.add_argument("--store-port", type=int, default=50051)
    ap.add_argument("--segment", default="1GiB")
    ap.add_argument("--router-port", type=int, default=8080)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--write", default="async", choices=("sync", "async"))
    ap.add_argument("--decode-write", default=None, choices=("sync", "async"),
                    help="the decode instances' write mode (default: --write), e.g. to vary P's save alone")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for every instance (repeatable), e.g. --serve-arg=--num-blocks=256")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--no-netns", action="store_true")
    ap.add_argument("--then", nargs=argparse.REMAINDER, default=None)
    args = ap.parse_args(argv)
    if args.both < 0 or (not args.both and (args.prefill < 1 or args.decode < 1)):
        ap.error("--prefill and --decode must be >= 1 (or --both N)")
    return args


class _Child:
    """A child process whose stdout lines are scanned for one announcing line."""

    def __init__(self, name, argv, log_dir):
        self.name = name
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   OMP_NUM_THREADS="1")
        self.p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  start_new_session=True)

    def wait_line(self, prefix: str, timeout: float = 300.0) -> str:
        found: list[str] = []

        def read():
            for line in self.p.stdout:
                if line.startswith(prefix):
                    found.append(line.strip())
                    break
        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not found:
            raise SystemExit(f"pd_cluster: {self.name} did not print {prefix!r} (see {self.log.name})")
        threading.Thread(target=self.p.stdout.read, daemon=True).start()  # keep its pipe drained
        return found[0]

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


def run(args) -> int:
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pd_cluster.")
    os.makedirs(log_dir, exist_ok=True)
    py = sys.executable
    children: list[_Child] = []
    stop = threading.Event()

    def on_signal(signum, _frame):  # while starting or running --then too: stop now (the finally below)
        stop.set()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        store = _Child("store", [py, "-m", "graphgen.runtime.pool.mooncake_server", "serve", "--port",
                                 str(args.store_port), "--segment", args.segment], log_dir)
        children.append(store)
        store.wait_line("ready", 60)
        pool = f"mooncake://127.0.0.1:{args.store_port}"
        roles = ([("both", i) for i in range(args.both)] if args.both else
                 [("prefill", i) for i in range(args.prefill)] + [("decode", i) for i in range(args.decode)])
        for role, i in roles:  # started together: they load their models side by side
            children.append(_Child(f"{role}{i}", [py, "-m", "graphgen", "serve", "--spec", args.spec, "--weights",
                                                  args.weights, "--port", "0", "--pool", pool, "--write",
                                                  args.decode_write if role == "decode" and args.decode_write
                                                  else args.write,
                                                  "--torch-threads", "1", "--role", role, *args.serve_arg], log_dir))
        urls = {c.name: c.wait_line("graphgen serve: listening on").rsplit(" ", 1)[-1] for c in children[1:]}
        route = [py, "-m", "graphgen", "route", "--port", str(args.router_port), "--policy", args.policy]
        for name, url in urls.items():
            route += ["--prefill" if name.startswith("prefill") else "--decode", url]
        router = _Child("router", route, log_dir)
        children.append(router)
        url = router.wait_line("graphgen route: listening on").rsplit(" ", 1)[-1]
        for name, u in urls.items():
            print(f"pd_cluster: {name} {u}", flush=True)
        reach = "" if args.no_netns else f" (inside the namespace: nsenter -t {os.getpid()} -n -- CMD)"
        print(f"pd_cluster: logs in {log_dir}", flush=True)
        print(f"pd_cluster: router {url}{reach}", flush=True)
        if args.then:
            return subprocess.run(args.then, env=dict(os.environ, ROUTER_URL=url)).returncode
        while not stop.wait(0.5):  # a signal raises SystemExit out of the wait
            dead = [c.name for c in children if c.p.poll() is not None]
            if dead:
                print(f"pd_cluster: {', '.join(dead)} exited (see {log_dir}); stopping", file=sys.stderr)
                return 1
        return 0
    finally:
        for c in reversed(children):
            c.stop()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    if args.no_netns or os.environ.get(INSIDE):
        if not args.no_netns:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        return run(args)
    try:  # re-run inside a private network namespace of its own; it stops the cluster on a signal
        inner = subprocess.Popen(["unshare", "-n", "--", sys.executable, __file__, *argv],
                                 env=dict(os.environ, **{INSIDE: "1"}))
    except FileNotFoundError:
        raise SystemExit("pd_cluster: needs `unshare` (util-linux) and root for a private network namespace; "
                         "or pass --no-netns")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the inner one too: it stops everything
    signal.signal(signal.SIGTERM, lambda *_: inner.send_signal(signal.SIGTERM))
    return inner.wait()


if __name__ == "__main__":
    sys.exit(main())
