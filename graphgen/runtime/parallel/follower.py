"""A node other than node 0 (or, under torchrun, a process other than RANK 0's): it starts its own ranks
and relays node 0's commands to them (docs/parallel.md, "Ranks across nodes").

``graphgen run``/``serve --nnodes N --node-rank R`` with ``R > 0`` calls `follow` instead of opening an
engine: it joins the driver's command channel on the master address (retried until the start deadline:
node 0 may start later), says which ranks it hosts and which spec it runs, gets the driver's rank
configuration (the compiled modules, the rendezvous store, the shared pool's address) with its own
checkpoint folder and devices put in, starts its ranks as node 0 starts its own (the warm forkserver,
`graphgen.runtime.parallel.launcher.start_ranks`), then relays: each command to every rank, each rank's
replies and progress to the driver, pings both ways. It serves no HTTP and prints no tokens: node 0 does.

It ends when the driver closes the engine (exit 0), and otherwise with one sentence and exit 2: node 0
never answered within the start deadline, refused this node (another spec or layout), ended the engine
(a rank failed anywhere: the reason is relayed), was lost (its connection closed: the process died), or
stopped answering for `SILENCE_S`; or one of this node's ranks exited (the driver is told first).
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Optional

from ..progress import Deadlines
from .commands import Close
from .cluster import (KEY_ENV, MOONCAKE_SCHEME, Placement, cluster_key, interface_towards, node_pool_url,
                      spec_digest)
from .links import HEARTBEAT_S, SILENCE_S, LocalRank, connect_channel
from .procs import _process_context, start_ranks

__all__ = ["follow"]

EXIT_OK, EXIT_FAILED = 0, 2


def follow(placement: Placement, spec, weights, *, threads: Optional[int] = None,
           rank_timeout: Optional[Deadlines] = None, command: str = "graphgen", out=None, pool="host") -> int:
    """Host ``placement.ranks`` of ``spec`` for the driver on node 0 until it closes the engine; the
    exit code (0, or 2 after one sentence on ``out``, stderr by default). ``pool``: this node's ``--pool``
    (node 0 checks it names its pool; a Mooncake URL's ranks here open it with this node's own address)."""
    here = placement
    me = here.describe(here.ranks[0] if here.torchrun else here.node_rank)
    driver = f"{here.master_addr}:{here.channel_port}"
    start = (rank_timeout or Deadlines()).start

    def say(sentence: str) -> int:
        print(f"{command}: {me}: {sentence}", file=out or sys.stderr, flush=True)
        return EXIT_FAILED

    try:
        conn = connect_channel((here.master_addr, here.channel_port), cluster_key(here), start)
    except AuthenticationError:
        return say(f"node 0 at {driver} refused this node's key: set the same {KEY_ENV} on every node")
    if conn is None:
        return say(f"node 0 never answered at {driver} within {start:.0f} s (is its {command} started with the "
                   f"same --nnodes/--master-addr/--master-port? --rank-timeout start=S raises it)")
    member = here.ranks[0] if here.torchrun else here.node_rank
    conn.send(("hello", {"member": member, "ranks": here.ranks, "spec": spec_digest(spec), "spec_name": spec.name,
                         "pool": pool}))
    payload: Any
    try:
        kind, payload = conn.recv() if conn.poll(start) else ("refused", f"no answer from {driver} in {start:.0f} s")
    except (EOFError, OSError):
        kind, payload = "refused", f"{driver} closed the connection"
    if kind != "welcome":
        conn.close()
        return say(f"node 0 refused this node: {payload}")
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", interface_towards(here.master_addr)[0])
    cfg = dict(payload, weights=str(Path(weights)), check_config=True, devices={r: here.device_index(r) for r in here.ranks},
               local_world=len(here.ranks), threads=threads or max(1, (os.cpu_count() or 1) // len(here.ranks)))
    if isinstance(cfg["pool"], str) and cfg["pool"].startswith(MOONCAKE_SCHEME):  # node 0 checked it is its pool
        cfg["pool"] = node_pool_url(pool, here)  # each node's ranks announce their own address, not node 0's
    ends = start_ranks(_process_context(), env, here.ranks, cfg)
    print(f"{command}: {me} joined node 0 at {driver}", file=out or sys.stderr, flush=True)
    try:
        why = _relay(conn, ends, driver, lambda: print(f"{command}: {me}: ranks up, following node 0", file=out or sys.stderr,
                                                       flush=True))
    finally:
        for e in ends:
            e.kill()
        conn.close()
    return EXIT_OK if why is None else say(why)


def _relay(conn: Connection, ends: list[LocalRank], driver: str, on_up) -> Optional[str]:
    """Relay until the engine closes (None) or fails (the sentence); ``on_up()`` once every rank answered
    its start."""
    pipes = {e.conn: e for e in ends}
    starting = {e.rank for e in ends}
    running = {e.proc.sentinel: e for e in ends}
    heard = sent = time.monotonic()
    closing = False
    while running:
        ready = wait([*pipes, conn, *running], HEARTBEAT_S / 2)
        for obj in sorted(ready, key=lambda o: 0 if o in pipes else 1 if o is conn else 2):
            if obj in pipes:  # a rank's reply or progress, to the driver tagged with the rank
                e = pipes[obj]
                try:
                    msg = e.conn.recv()
                except (EOFError, OSError):
                    del pipes[obj]
                    continue
                if not _send(conn, (e.rank, msg)) and not closing:
                    return f"node 0 (the driver at {driver}) was lost: its connection closed"
                if starting and msg[0] == "ok":
                    starting.discard(e.rank)
                    if not starting:
                        on_up()
            elif obj is conn:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    if closing:  # the driver let go after the close: the ranks are ending
                        return _wait_exit(running)
                    return f"node 0 (the driver at {driver}) was lost: its connection closed"
                heard = time.monotonic()
                if msg[0] == "cmd":
                    closing = closing or isinstance(msg[1], Close)
                    for e in ends:
                        e.send(msg[1])
                elif msg[0] == "abort":
                    return f"node 0 ended the engine: {msg[1]}"
            elif obj in running:
                e = running.pop(obj)
                e.proc.join(1.0)
                if not closing:
                    why = f"rank {e.rank} exited (code {e.proc.exitcode})"
                    _send(conn, ("lost", why))
                    return why
        now = time.monotonic()
        if now - sent >= HEARTBEAT_S:
            if not _send(conn, ("ping",)) and not closing:
                return f"node 0 (the driver at {driver}) was lost: its connection closed"
            sent = now
        if now - heard > SILENCE_S and not closing:
            return f"node 0 (the driver at {driver}) stopped answering: nothing came from it for {now - heard:.0f} s"
    return None


def _send(conn, msg) -> bool:
    try:
        conn.send(msg)
        return True
    except OSError:
        return False


def _wait_exit(running: dict, timeout_s: float = 30.0) -> Optional[str]:
    """After a close: the ranks exit on their own (each replied to it); one that does not is ended."""
    end = time.monotonic() + timeout_s
    for e in running.values():
        e.proc.join(max(0.0, end - time.monotonic()))
    return None
