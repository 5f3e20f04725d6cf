"""Start a Mooncake Store for the pool on loopback: the master and a process holding the storage.

    python -m graphgen.runtime.pool.mooncake_server serve   [--port 50051] [--segment 1GiB] [--host 127.0.0.1]
    python -m graphgen.runtime.pool.mooncake_server master  [--port 50051] [--host 127.0.0.1]  # the master alone
    python -m graphgen.runtime.pool.mooncake_server segment --master 127.0.0.1:50051 [--segment 1GiB] [--host ...]

``serve`` runs ``mooncake_master`` (RPC and metrics on ``--host``, loopback by default; another host's
instances reach it at this host's address, docs/pd.md "Across hosts") as a child and contributes a
global segment from its own process, so blocks saved by an engine outlive that engine (engines
contribute no segment by default). Each prints one ``ready ...`` line on stdout once usable and
runs until SIGINT/SIGTERM. The master binary ships inside the ``mooncake`` wheel
(``mooncake/mooncake_master``); ``find_master_binary()`` locates it without importing it.

Some Mooncake client listeners bind 0.0.0.0 whatever the flags say: on a shared host, run this in a
private network namespace (``unshare -n``, then ``ip link set lo up``), as the tests do.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from ...netutil import free_port
from .codec import parse_size

__all__ = ["find_master_binary", "master_argv", "wait_listening", "main"]


def find_master_binary() -> str:
    """Path of ``mooncake_master``: the one in the installed ``mooncake`` package, else on PATH."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "mooncake_master")
        if os.path.isfile(path):
            return path
    path = shutil.which("mooncake_master")
    if path:
        return path
    raise FileNotFoundError("mooncake_master not found: install the mooncake extra "
                            "(./dev setup, or pip install mooncake-transfer-engine-non-cuda) "
                            "and Debian's libibverbs1")


def master_argv(port: int, metrics_port: int, *, host: str = "127.0.0.1",
                extra: tuple[str, ...] = ()) -> list[str]:
    return [find_master_binary(), f"-rpc_address={host}", f"-rpc_port={port}",
            f"-metrics_host={host}", f"-metrics_port={metrics_port}", *extra]


def wait_listening(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None
                   ) -> None:
    """Return once ``host:port`` accepts a connection; TimeoutError after ``timeout_s``,
    RuntimeError if ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode} before listening")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s} s")
        time.sleep(0.02)


def hold_segment(master: str, segment_bytes: int, host: str = "127.0.0.1"):
    """A Mooncake client that contributes ``segment_bytes`` of storage (keep it alive)."""
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    rc = store.setup(host, "P2PHANDSHAKE", segment_bytes, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"mooncake setup of a {segment_bytes}-byte segment at {master} "
                           f"returned {rc}")
    return store


def reexec_in_private_netns(script: str, flag: str = "--in-netns") -> None:
    """Re-run this process's command line inside a new network namespace where only loopback exists
    (``unshare -n``, then ``ip link set lo up``), with ``flag`` appended; returns only when ``flag`` is
    already there. Some Mooncake listeners bind 0.0.0.0 whatever the flags say: benchmarks and tests
    start their store inside such a namespace so nothing listens beyond loopback (needs root)."""
    if flag in sys.argv:
        return
    if shutil.which("unshare") is None:
        sys.exit(f"{script} needs `unshare` (util-linux) and root: Mooncake runs in a private network namespace")
    cmd = f"ip link set lo up && exec {sys.executable} {' '.join(map(repr, sys.argv))} {flag}"
    os.execvp("unshare", ["unshare", "-n", "--", "sh", "-c", cmd])


def _wait_for_signal(child: subprocess.Popen | None = None) -> int:
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    while not stop:
        if child is not None and child.poll() is not None:
            print(f"mooncake_master exited with {child.returncode}", file=sys.stderr)
            return 1
        time.sleep(0.1)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m graphgen.runtime.pool.mooncake_server",
                                 description="Mooncake Store for the graphgen KV pool (loopback)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("serve", "master"):
        p = sub.add_parser(name)
        p.add_argument("--port", type=int, default=50051, help="master RPC port (0: a free one)")
        p.add_argument("--host", default="127.0.0.1",
                       help="this host's address the master (and the segment) listen on and announce")
        p.add_argument("--metrics-port", type=int, default=0, help="0: a free one")
        p.add_argument("--lease-ttl-ms", type=int, default=None,
                       help="master -default_kv_lease_ttl (a read blocks eviction this long)")
    sub.choices["serve"].add_argument("--segment", default="1GiB", help="storage held (>= 16MiB)")
    seg = sub.add_parser("segment")
    seg.add_argument("--master", required=True, help="HOST:PORT of a running master")
    seg.add_argument("--segment", default="1GiB")
    seg.add_argument("--host", default="127.0.0.1", help="this host's address the segment announces")
    a = ap.parse_args(argv)

    if a.cmd == "segment":
        store = hold_segment(a.master, parse_size(a.segment), a.host)
        print(f"ready segment={parse_size(a.segment)} master={a.master}", flush=True)
        rc = _wait_for_signal()
        os._exit(rc)        # skip Mooncake's unmount wait on a master that may be gone
        del store

    port = a.port or free_port(a.host)
    extra = () if a.lease_ttl_ms is None else (f"-default_kv_lease_ttl={a.lease_ttl_ms}",)
    child = subprocess.Popen(master_argv(port, a.metrics_port or free_port(a.host), host=a.host, extra=extra))
    try:
        wait_listening(a.host, port, 10.0, child)
        master = f"{a.host}:{port}"
        if a.cmd == "serve":
            store = hold_segment(master, parse_size(a.segment), a.host)   # noqa: F841 - keeps it alive
        print(f"ready master={master} pid={child.pid} url=mooncake://{master}", flush=True)
        rc = _wait_for_signal(child)
    finally:
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(5)
            except subprocess.TimeoutExpired:
                child.kill()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
