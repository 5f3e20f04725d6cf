"""The body of one rank process (started by `graphgen.runtime.parallel.launcher`, by name:
`graphgen.runtime.parallel.procs.RANK_MAIN`): join the process group, build the layout's groups once,
load this rank's weight slices, build its engine (`graphgen.runtime.parallel.rank.build_rank`), then
serve the driver's typed commands (`graphgen.runtime.parallel.commands`) until `Close`.

It reports each start phase it enters (``load``; ``warmup`` from a target that compiles) and its progress
in them to the launcher (`graphgen.runtime.progress`), which holds each phase to its deadline.

**The pool, by URL.** A rank opens its own pool client from ``cfg["pool"]`` (`open_rank_pool`): the
launcher's shared host pool (``shared://HOST:PORT``, with the launcher's authkey) for ``pool="host"``; a
``mooncake://`` URL gives each rank its own Mooncake client (`graphgen.runtime.pool.make_pool`: its own segment
and registered buffers; keys per shard, replicated shards put once by `rank_kv.SaveOncePool`).
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..progress import STEP, Progress, reporting
from .commands import Close, Rank, handle
from .layout import RankLayout
from .rank import RANK_TARGETS, build_rank

__all__ = ["rank_main", "open_rank_pool", "SHARED_SCHEME"]

SHARED_SCHEME = "shared://"  # the launcher's shared host pool process (`graphgen.runtime.pool.shared`)


def open_rank_pool(url: str, authkey: Optional[bytes] = None):
    """This rank's own client of the pool at ``url``: ``shared://HOST:PORT`` (the launcher's host pool
    process, ``authkey`` its key), or any URL `make_pool` opens (``mooncake://...``: a Mooncake client)."""
    if url.startswith(SHARED_SCHEME):
        from ..pool.shared import connect_pool

        host, _, port = url[len(SHARED_SCHEME):].rpartition(":")
        if authkey is None:
            raise ValueError(f"{url}: the launcher's shared pool needs its authkey")
        return connect_pool((host, int(port)), authkey)
    from ..pool import make_pool

    return make_pool(url)


def _locked_send(conn) -> Callable:
    """``conn.send`` for the rank's replies and its progress events, one message at a time."""
    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            conn.send(msg)
    return send


def _weight_bytes(weights) -> Optional[int]:
    """The bytes a load phase reads, when known up front: a dict's tensors (a folder's loader says its own)."""
    return sum(t.numel() * t.element_size() for t in weights.values()) if isinstance(weights, dict) else None


def rank_main(rank: int, cfg: dict, conn) -> None:  # pragma: no cover - runs in the rank process
    """Rank process ``rank``'s body (module doc)."""
    send = _locked_send(conn)
    progress = Progress(lambda event: send(("progress", event)))
    with reporting(progress):
        _serve_rank(rank, cfg, conn, send, progress)


def _rendezvous(store, timeout):
    """A client of the driver's rendezvous store ``(host, port, torchrun)``; under torchrun, of torchrun's
    own store, under a prefix of graphgen's (torchrun keeps its keys there too)."""
    host, port, torchrun = store
    client = dist.TCPStore(host, port, None, False, timeout=timeout)
    return dist.PrefixStore("graphgen", client) if torchrun else client


def _join(rank: int, cfg: dict):
    """This rank's target (`RankTarget`), its process groups (`RankGroups`) and the host-side gloo group
    (None: the world's is gloo), after its device is chosen and it joined the process group."""
    import datetime

    torch.set_num_threads(cfg["threads"])
    importlib.import_module(cfg["target_module"])  # registers the rank target (the launcher named it)
    target = RANK_TARGETS[cfg["target"]]
    # the device is this node's local rank (device choice and backend are the target's)
    backend = target.setup(cfg["devices"][rank], cfg["local_world"], cfg["engine_kwargs"])
    # the process group's timeout outlasts every start phase: a collective in one rank's warm-up
    # waits for a peer still compiling; the launcher's deadlines end a rank that hangs
    timeout = datetime.timedelta(seconds=cfg["group_timeout"])
    dist.init_process_group(backend, store=_rendezvous(cfg["store"], timeout), rank=rank,
                            world_size=cfg["spec"].parallel.world, timeout=timeout)
    # every named group of the layout, made once in one order on every rank (the modules' collectives)
    groups = RankLayout.of(cfg["spec"].parallel).process_groups(rank)
    # the host-side agreement (plan check, hit MINs, drain barrier, DP handshake) on CPU tensors: a gloo group
    # of its own even when the world is gloo, never one a module's collectives use (a group spanning the world
    # is the world group itself, `RankLayout.process_groups`): under async scheduling the caller's thread plans
    # step N+1 -- its hit MINs on this group -- while step N's forward runs its collectives on the forward thread,
    # and two threads' collectives on one group need not pair up across ranks (docs/parallel.md)
    host = dist.new_group(backend="gloo", timeout=timeout)
    # under DP attention with several ranks per DP group, the plan check and hit MINs run on that group
    return target, groups, host, groups.layout.lockstep_group(rank, timeout=timeout)


def _weights(rank: int, cfg: dict, progress):
    """The rank's weights: a dict of tensors (sliced by `build_rank`), or its streamed `CheckpointWeights`."""
    spec, weights = cfg["spec"], cfg["weights"]
    progress.phase("load", total=_weight_bytes(weights))  # a folder's total: its loader says (place_weights)
    if cfg["faults"] is not None:
        cfg["faults"].weights_sleep()  # a test's slow (or hung) load
    if cfg.get("check_config"):  # another node's folder (node 0 checked its own before starting)
        from ..checkpoint.hf import check_config

        check_config(spec, weights)
    if isinstance(weights, dict):
        progress.advance(progress.total or 0)
        return weights
    from ..checkpoint.plan import RankSlicing
    from ..checkpoint.stream import CheckpointWeights

    # a checkpoint folder: this rank streams its own slices, nothing else
    return CheckpointWeights(str(weights), frozenset(cfg["weight_names"]), RankSlicing.of(spec.parallel, rank),
                             spec.mtp_layers)


def _start(rank: int, cfg: dict, progress) -> Rank:
    spec = cfg["spec"]
    target, groups, host, lockstep = _join(rank, cfg)
    kwargs = dict(cfg["engine_kwargs"])
    if spec.parallel.dp > 1 and cfg["target"] == "cpu":  # a DP rank's forward events wait as long as a command
        kwargs.setdefault("event_timeout", cfg["timeout"])
    engine, setup = build_rank(spec, groups.layout, target, groups=groups, weights=_weights(rank, cfg, progress),
                               names=cfg["weight_names"], host=host, lockstep=lockstep, spec_file=cfg["spec_file"],
                               pool=open_rank_pool(cfg["pool"], cfg["authkey"]), faults=cfg["faults"],
                               sources=cfg["sources"], **kwargs)
    return Rank(engine, setup.coords, setup.runner.dp if setup.runner is not None else None, setup.parts.shard,
                setup.parts.writes)


def _serve_rank(rank: int, cfg: dict, conn, send, progress) -> None:  # pragma: no cover - in the rank process
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # the parent ends the ranks (close, or kill): a terminal's Ctrl-C, sent to the whole process
        # group, must not kill a rank under a parent that is still draining
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        me = _start(rank, cfg, progress)
        progress.phase(STEP)
        send(("ok", None))
    except BaseException:
        send(("error", traceback.format_exc()))
        return
    with me.engine:
        while True:
            cmd = conn.recv()
            if isinstance(cmd, Close):
                break
            try:
                out = handle(me, cmd)
                send(("ok", out if rank == 0 or cmd.EVERY_RANK else None))
            except BaseException as e:
                send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    send(("ok", None))
    dist.destroy_process_group()
