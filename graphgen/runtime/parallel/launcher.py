"""Running a spec on several ranks: one process per rank on torch.distributed (gloo; hccl on an NPU).

`DistributedEngine` is the engine a caller holds (``open_engine(..., tp=2)`` returns one): it
serves the pool every rank shares (the embedded host pool behind a `multiprocessing` manager: rank 0's MLA
latent must be visible to rank 1; with a ``mooncake://`` URL no pool here, each rank opens its own client) and the rendezvous store, starts a rank process per rank of this node
(``parallel.world``: dp × cp × tp; `graphgen.runtime.parallel.context_parallel` for cp), and sends every
rank the same command (``generate``, ``drain``, ``stats``, ``call`` for a probe); the ranks run in lockstep
(`graphgen.runtime.parallel.rank`) and it returns rank 0's results. It implements `EngineInterface` (what
every `open_engine` result has: ``generate``, ``drain``, ``stats``, ``close``, ...), so a driver uses it
as a one-process `Engine`, and ``core``: `DistributedCore`, the step API of `EngineCore` (what
``graphgen serve`` drives) with every call broadcast to the ranks in the same order (their schedulers stay
in lockstep). The ranks' parts are in their processes: no ``kv_naming()`` (P/D), no spans (``observe``).

Several nodes (``placement``, `graphgen.runtime.parallel.cluster`): this process is node 0's driver; the
other nodes' followers (`graphgen.runtime.parallel.follower`) join its command channel
(`graphgen.runtime.parallel.links.Channel`) and relay each command to their ranks, which answer through
it. Store, channel and pool listen on the master address only (on one node, 127.0.0.1).

Failure is bounded: every reply is awaited with a deadline while the rank processes (and the followers'
links) are watched; a rank that exits, raises or misses its deadline, or a node that is lost, ends every
rank and raises `RankFailure` naming it (followers are told why). The deadlines
(`graphgen.runtime.progress`): starting, each rank has one per phase (``rank_timeout``, a `Deadlines`:
process start — a node's joining included —, weight loading, warm-up; it reports each phase it enters),
and prints progress lines meanwhile (bytes loaded and GB/s, graphs compiled with an ETA); then every
command must be answered in ``timeout`` seconds, unless the rank reports a phase again (a graph compiled
on first use), which then has that phase's deadline. The process group's own timeout is the longest of
these, so a collective that waits on a peer still compiling does not fail first; a collective whose peer
hangs or died is ended by the deadline here. What is checked and started before the ranks (layout, pool URL, store,
shared pool process): `graphgen.runtime.parallel.bringup`. Process start: `graphgen.runtime.parallel.procs` (the warm
forkserver), or ``spawn=True`` (the real NPU's ranks: its runtime must not be loaded before a fork).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from ..pool import DEFAULT_POOL_BYTES
from ..progress import Board, Deadlines, RankPhases
from .cluster import Placement, cluster_key, interface_towards
from . import commands as C
from .step_api import DistributedCore
from .links import Channel, LocalRank, PendingRank, RemoteRank
from .procs import _process_context, start_ranks  # noqa: F401  (_process_context: tests patch it here)
from .rank import RANK_TARGETS

from .bringup import (RankFailure, _check_hello, _checked, _compile_once, node_pool_url,  # noqa: F401  (tests import _checked here)
                      _host_store, _start_host_pool)

__all__ = ["DistributedEngine", "DistributedCore", "RankFailure"]


def _pool_stats(engine) -> dict:  # a probe (module-level: pickled by name)
    return engine.pool_stats()


def _key_parts(engine) -> tuple:  # a probe: how this rank names its blocks (model, cache layout, shard, block size,
    loader = engine.loader          # successor-keyed: speculative decoding's keys, docs/mtp.md)
    return (loader.model, engine.cache.layout, loader.shard.index, loader.shard.count, engine.cache.block_size,
            bool(getattr(engine, "speculative", False)))


def _max_model_len(engine) -> int:  # a probe run in every rank process (module-level: pickled by name)
    return engine.max_model_len


class DistributedEngine:
    """``parallel.world`` rank processes driven in lockstep; results are rank 0's. See the module doc."""

    def __init__(self, spec, weights: Union[str, Path, dict, None], *, spec_file: str = "", pool="host",
                 faults=None, timeout: float = 120.0, threads: Optional[int] = None,
                 pool_capacity_bytes: int = DEFAULT_POOL_BYTES, target: str = "cpu",
                 rank_timeout: Optional[Deadlines] = None, clock=time.monotonic, progress_out=None,
                 spawn: bool = False, placement: Optional[Placement] = None, **engine_kwargs):
        """``target``: the rank builder by name (`graphgen.runtime.parallel.rank.RANK_TARGETS`: ``"cpu"``,
        or one a target registered, e.g. ``"npu"`` by ``graphgen.npu.run.ranks``); ``engine_kwargs`` go
        to it in every rank process. ``timeout``: seconds a rank has to answer one command;
        ``rank_timeout``: the start phases' deadlines (default `Deadlines()`); ``clock`` measures both
        (tests pass a fast one); ``progress_out``: where the start's progress lines go (stderr).
        ``spawn``: a fresh interpreter per process instead of the warm forkserver (a device runtime
        that must not be loaded before a fork: the real NPU's). ``placement``: the ranks of this node
        and where the others are (`graphgen.runtime.parallel.cluster.Placement`; default: every rank
        here, on loopback); with several nodes this process is node 0's driver."""
        cpu_modules = target == "cpu"  # the CPU ranks run the modules compiled here once
        target, weights = _checked(spec, weights, pool, target)
        self.spec, self.tp, self._timeout = spec, spec.parallel.tp, timeout
        self.deadlines = rank_timeout or Deadlines()
        self._clock = clock
        self.world = spec.parallel.world  # rank processes: dp × cp × tp
        self.placement = here = placement or Placement.single(self.world)
        if here.world != self.world or not here.driver:
            raise ValueError(f"placement {here} does not drive this layout of {self.world} ranks")
        if here.multi_node and isinstance(weights, dict):
            raise ValueError("ranks on several nodes read a checkpoint folder on each node, not a dict of tensors")
        self._closed = self._closing = False
        self._busy = threading.Lock()  # held while a command (or the start) waits on the ranks
        self._failure: Optional[str] = None  # why the engine ended between commands (a node lost)
        self.on_failure: Optional[Callable[[str], None]] = None  # told that sentence (from a thread)
        ctx = mp.get_context("spawn") if spawn else _process_context()  # module doc: process start
        env = dict(os.environ)
        host = here.master_addr
        if here.multi_node and "GLOO_SOCKET_IFNAME" not in env:  # gloo binds the interface towards node 0
            env["GLOO_SOCKET_IFNAME"] = interface_towards(host)[0]
        if (target_env := RANK_TARGETS[target].env) is not None:  # the target's own (NPU: HCCL/CANN), pre-torch
            env.update(target_env(env, here, self.deadlines))
        self._channel = Channel((host, here.channel_port), cluster_key(here), clock=clock) if here.multi_node else None
        # the rendezvous store, bound to the given address only (torchrun's when it launched us)
        self._store = None if here.torchrun else _host_store(host, here.store_port, max(timeout, self.deadlines.longest))
        authkey = os.urandom(16)
        # "host" or the Mooncake master's URL this node's ranks open (each node its own address in it)
        self.pool_url = node_pool_url(pool, here)
        self._driver_pool = None  # on Mooncake: this process's own client, for P/D (kv_pool)
        # the embedded pool's process and this process's client of it; none on Mooncake (each rank its own)
        self._pool_proc, self._pool, rank_pool = _start_host_pool(ctx, env, pool, host, here, authkey,
                                                                  pool_capacity_bytes, timeout)
        sources, weight_names = _compile_once(spec, spec_file)  # the weight names are every target's
        cfg = {"spec": spec, "spec_file": spec_file, "weights": weights, "timeout": timeout,
               "store": (host, self._store.port if self._store is not None else here.store_port, here.torchrun),
               "group_timeout": max(timeout, self.deadlines.longest),  # the process group's (module doc)
               "threads": threads or max(1, (os.cpu_count() or 1) // len(here.ranks)),
               "pool": rank_pool,  # each rank its own client (rank_process.open_rank_pool)
               "authkey": authkey, "faults": faults, "engine_kwargs": engine_kwargs,
               "devices": {r: here.device_index(r) for r in here.ranks}, "local_world": len(here.ranks),
               # another target's ranks compile their own modules (its modes are its business)
               "sources": sources if cpu_modules else None, "weight_names": weight_names,
               "target": target, "target_module": RANK_TARGETS[target].module}
        self._phases = RankPhases(self.world, self.deadlines, timeout, clock=clock)  # every rank: "start"
        self._board = Board(self.world, progress_out, clock=clock)
        members = here.members()
        self._ends: list = [PendingRank(r, m) for m, ranks in members.items() for r in ranks]
        self._ends = sorted(self._ends + start_ranks(ctx, env, here.ranks, cfg), key=lambda e: e.rank)
        if self._channel is not None:
            self._channel.on_lost = self._node_lost
            self._channel.start(lambda hello: _check_hello(hello, here, spec, members, pool), lambda hello: cfg,
                                here.describe)
        try:
            with self._busy:
                self._collect("start", "during start")
        except BaseException:
            self._kill()
            raise
        self._board.finish()
        self.core = DistributedCore(self)
        self.speculative = bool(engine_kwargs.get("num_speculative_tokens"))
        self.max_model_len = self.on_ranks(_max_model_len)[0]

    @property
    def timeout(self) -> float:
        """Seconds a rank has to answer one command (settable: the next command has the new deadline)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = self._phases.step_timeout = seconds

    # ---- the rank protocol ----------------------------------------------------------------------
    @property
    def _procs(self) -> list:
        """This node's rank processes."""
        return [e.proc for e in self._ends if isinstance(e, LocalRank)]

    def _attach(self) -> None:
        """Followers that joined since: their ranks now answer through their links."""
        while self._channel is not None and not self._channel.joined.empty():
            kind, member, got = self._channel.joined.get()
            if kind == "refused":
                self._fail(f"a node was refused: {got}")
            self._ends = [RemoteRank(e.rank, got) if e.rank in got.ranks else e for e in self._ends]

    def _collect(self, what: str, when: str) -> list:
        """Every rank's reply to command ``what``; a rank that fails or is late, or a lost node, ends them all (a
        sentence ending ``when``). Its ``progress`` messages move it between phases (`RankPhases`) and feed the board."""
        replies: dict[int, object] = {}
        since = self._clock()
        while len(replies) < self.world:
            self._attach()
            idle = True
            for end in self._ends:
                r = end.rank
                if r in replies:
                    continue
                msg = end.recv()
                if msg is None:
                    why = end.failure(since)
                    if why:
                        self._fail(f"{why} {when}")
                    continue
                idle = False
                status, value = msg
                if status == "exited":
                    self._fail(f"{value} {when}")
                if status == "progress":
                    self._phases.report(r, value)
                    self._board.update(r, value)
                    continue
                if status != "ok":  # a peer's death (or a lost node) is the cause, its error the symptom
                    dead = self._dead(grace=1.0)
                    if any(isinstance(e, RemoteRank) and e.failure(0.0) for e in self._ends):
                        self._fail(f"{dead.rstrip('; ')} {when} (rank {r} failed after it: "
                                   f"{str(value).strip().splitlines()[-1]})")
                    self._fail(f"{dead}rank {r} failed {when}:\n{value}")
                replies[r] = value
            late = self._phases.late([r for r in range(self.world) if r not in replies])
            if late:
                self._fail(self._late(late, what))
            self._board.tick()
            if idle:
                wait([e.conn for e in self._ends if isinstance(e, LocalRank)], 0.02 if self._channel is None else 0.005)
        return [replies[r] for r in range(self.world)]

    def _late(self, late: list[int], what: str) -> str:
        pending = [e for e in self._ends if isinstance(e, PendingRank) and e.rank in late]
        if not pending:
            return self._phases.describe(late, what)
        here = self.placement
        return (f"{here.describe(pending[0].member)} never joined: nothing connected to "
                f"{here.master_addr}:{here.channel_port} within {self.deadlines.start:.0f} s (is its graphgen "
                f"started with the same --nnodes/--master-addr/--master-port? --rank-timeout start=S raises it)")

    def _fail(self, sentence: str):
        self._kill(sentence)
        if self.on_failure is not None:  # told a second later: the caller answers its requests with it first
            threading.Timer(1.0, self.on_failure, (sentence,)).start()
        raise RankFailure(sentence)

    def _dead(self, grace: float) -> str:
        """``rank N exited (code C); `` for every rank that has exited, and each lost node (waiting up
        to ``grace`` for one)."""
        deadline = time.monotonic() + grace
        while True:
            down = [why for e in self._ends if (why := e.failure(0.0))]
            if down or time.monotonic() >= deadline:
                return "".join(f"{why}; " for why in dict.fromkeys(down))
            time.sleep(0.02)

    def _command(self, cmd, what: Optional[str] = None, when: Optional[str] = None) -> list:
        """Every rank's reply to ``cmd`` (a `graphgen.runtime.parallel.commands` command; ranks > 0 send None
        unless the command's ``EVERY_RANK``)."""
        what = what or type(cmd).__name__.lower()
        with self._busy:
            if self._closed:
                if self._failure is not None:
                    raise RankFailure(self._failure)
                raise RuntimeError("the distributed engine is closed")
            try:
                for e in self._ends:
                    e.send(cmd)
            except OSError as err:  # a rank died between commands (its pipe is closed): the engine ends, as in _collect
                self._fail(f"{self._dead(grace=1.0).rstrip('; ') or f'a rank closed its pipe ({err})'} "
                           f"{when or f'during {what}'} (found sending it)")
            if self._channel is not None:
                self._channel.broadcast(("cmd", cmd))
            self._phases.command()
            return self._collect(what, when or f"during {what}")

    def _node_lost(self, link) -> None:
        """A follower's link was lost (its reader thread): between commands, the engine ends now (every rank
        here, every other follower told) and ``on_failure`` hears why; during one, its `_collect` reports it."""
        if self._closing or not self._busy.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            self._failure = f"{link.lost} (between commands)"
            self._kill(self._failure)
        finally:
            self._busy.release()
        if self.on_failure is not None:
            self.on_failure(self._failure)

    def _kill(self, reason: Optional[str] = None) -> None:
        """End every rank here; followers are told ``reason`` (None: a normal close) and let go."""
        self._closed = True
        for e in self._ends:
            e.kill()
        for p in self._procs:
            p.join(5)
        if self._channel is not None:
            self._channel.close(reason)
        if self._pool_proc is not None and self._pool_proc.is_alive():
            self._pool_proc.kill()
        if self._driver_pool is not None:
            self._driver_pool.close()
            self._driver_pool = None
        self._store = None  # the rendezvous store stops listening

    # ---- the Engine calls -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, **kwargs):
        return self._command(C.Generate([list(p) for p in prompts], max_new_tokens, kwargs), "generate")[0]

    def drain(self, timeout: Optional[float] = None) -> None:
        self._command(C.Drain(timeout), "drain")

    @property
    def rank_stats(self) -> list[dict]:
        """Each rank's connector counters (``skipped_puts``: puts a rank left to rank 0)."""
        return self._command(C.Stats(), "stats")

    @property
    def stats(self) -> dict:
        """Rank 0's connector counters (what `Engine.stats` gives for one rank)."""
        return self.rank_stats[0]

    def save_report(self):
        """Every rank's saves, aggregated per pool-key shard (`RanksSaveReport`: each rank's scheduler took
        its steps' `SaveReport`s; a rank > 0's is no longer dropped)."""
        from ..engine.step_output import RanksSaveReport

        return RanksSaveReport.aggregate(self._command(C.SaveLedgers(), "save_report"))

    def pool_stats(self) -> dict:
        """The shared host pool's counters; on Mooncake, rank 0's client's (``rank_pool_stats``: every rank's)."""
        if self._pool is not None:
            return self._pool.stats()
        return self.rank_pool_stats()[0]

    def rank_pool_stats(self) -> list[dict]:
        """Each rank's own pool client's counters (on the host pool: the one shared pool's, per rank)."""
        return self.on_ranks(_pool_stats)

    # the EngineInterface's calls whose parts live in the rank processes: no spans
    def observe(self, observer) -> None:
        pass

    def kv_naming(self):
        """`block_naming` (P/D's handoff over ranks); None on the host pool: it lives in this instance only,
        nothing outside could read a handoff."""
        return None if self._pool is not None else self.block_naming()

    def block_naming(self):
        """How the ranks name a prompt's blocks, whatever the pool: every distinct KV shard's keys (a shard
        several ranks hold, as MLA's latent, once), named here as each rank's loader names them. Keys carry no
        DP rank (every DP group names a prompt's blocks alike), and DP ranks of one rank each name them as one
        rank does (no ``shards``): a handoff of dp × tp ranks is one of tp ranks. Speculative ranks' keys carry
        each block's successor token (``lookahead``), as their drafters save them."""
        from ...runtime.engine.interface import CacheNaming
        from ..pool.keys import KVShard, block_keys, chain_digests, mtp_block_keys

        parts = list(dict.fromkeys(self.on_ranks(_key_parts)))  # one per distinct shard, in rank order
        model, layout, _, _, bs, lookahead = parts[0]

        def shard_keys(m, lay, shard):  # a speculative rank's keys carry each block's successor (its scheduler's)
            if lookahead:
                return lambda p, salt="": mtp_block_keys(p, (len(p) - 1) // bs, bs, model=m, layout=lay,
                                                         shard=shard, salt=salt)
            return lambda p, salt="": block_keys(p, bs, model=m, layout=lay, shard=shard, salt=salt)

        fns = tuple(shard_keys(m, lay, KVShard(i, n)) for m, lay, i, n, _, _ in parts)
        digests = lambda p, salt="": chain_digests(p, bs, salt)  # noqa: E731
        if [(i, n) for _, _, i, n, _, _ in parts] == [(0, 1)]:  # DP ranks of one rank each: one rank's naming (r0of1)
            return CacheNaming(bs, layout, digests, fns[0], lookahead=lookahead)
        return CacheNaming(bs, layout, digests, fns[0], shard_keys=fns,
                           shards=tuple(KVShard(i, n).render() for _, _, i, n, _, _ in parts), lookahead=lookahead)

    def kv_pool(self):
        """This process's own Mooncake client (opened on first use, contributing no segment): P's leases and
        visibility checks; the ranks' blocks are in the master's segments, whichever client put them."""
        if self._pool is not None:
            return self._pool
        if self._driver_pool is None:
            from ..pool import make_pool

            self._driver_pool = make_pool(self.pool_url)
        return self._driver_pool

    def saves_in_flight(self) -> int:
        """Unknown here (each rank waits for its own commits; ``drain`` barriers them): on Mooncake 1, so P's
        visibility wait runs to its deadline rather than handing off a short run while a rank still saves."""
        return 0 if self._pool is not None else 1

    def on_ranks(self, fn, *args) -> list:
        """``fn(rank_engine, *args)`` on every rank (in its process, between commands); each rank's
        result. ``fn`` must be picklable by reference (a module-level function) and must not call a
        collective. For tests and probes: what a rank's cache, pool view or counters hold."""
        return self._command(C.Probe(fn, args), "call")

    @property
    def pool(self):
        """The shared pool (a proxy to the pool process; ``get``/``contains``/``keys`` as `HostPool`); None on
        Mooncake (each rank holds its own client: `on_ranks` reaches them, `rank_pool_stats` their counters)."""
        return self._pool

    def close(self) -> None:
        if self._closed:
            return
        self._closing = True  # the followers' connections close after this: not a failure
        try:
            self._command(C.Close(), "close")
        finally:
            self._closed = True
            for p in self._procs:
                p.join(self.timeout)
            self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
