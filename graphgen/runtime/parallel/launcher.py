"""Running a spec on several ranks: one process per rank on torch.distributed (gloo, loopback).

`DistributedEngine` is the engine a caller holds (``open_engine(..., tp=2)`` returns one): it
serves the pool every rank shares (the embedded host pool behind a loopback manager: rank 0's MLA
latent must be visible to rank 1), starts a rank process per rank of the world (``parallel.world``:
tp, or cp; `graphgen.runtime.parallel.context_parallel` for cp), and sends every rank the same
command (``generate``, ``drain``, ``stats``, ``call`` for a probe); the ranks run in lockstep (`graphgen.runtime.parallel.rank`) and
it returns rank 0's results. It implements `EngineInterface` (``generate``, ``drain``, ``stats``,
``close``, context manager, ...: what every `open_engine` result has), so a driver uses it as it
uses a one-process `Engine`, and ``core``: `DistributedCore`, the step API of `EngineCore` (what
``graphgen serve`` drives) with every call broadcast to the ranks in the same order, so their
schedulers stay in lockstep. The ranks hold their caches, runners and connectors in their own
processes: ``kv_naming()`` is None (no P/D handoff from ranks), ``observe`` reports nothing.

Failure is bounded: every reply is awaited with a deadline while the rank processes are watched; a
rank that exits, raises or misses its deadline ends every rank and raises `RankFailure` naming it.
The deadlines (`graphgen.runtime.progress`): starting, each rank has one per phase (``rank_timeout``,
a `Deadlines`: process start, weight loading, warm-up; it reports each phase it enters), and prints
progress lines meanwhile (bytes loaded and GB/s, graphs compiled with an ETA); then every command
must be answered in ``timeout`` seconds, unless the rank reports a phase again (a graph compiled on
first use), which then has that phase's deadline. The process group's own timeout is the longest of
these, so a collective that waits on a peer still compiling does not fail first; a collective whose
peer hangs or died is ended by the deadline here. Nothing listens on anything but 127.0.0.1
(``GLOO_SOCKET_IFNAME=lo``).

Process start: the rank and pool processes are forked from a forkserver (`_process_context`) that
imported torch and the rank modules once, when this process first started ranks: a rank skips the
fresh interpreter's torch import (about 3 s of CPU each here). The forkserver runs no torch op, so
no thread pool is forked. Each child first takes the environment of this process at its launch
(`_child`: as a spawned interpreter would; ``ASCEND_RT_VISIBLE_DEVICES``, ``GLOO_SOCKET_IFNAME`` and
the rest are read after it); a variable a preloaded module reads at import (`_READ_AT_IMPORT`) that
changed since the forkserver started makes that launch spawn fresh interpreters instead, and so
does ``spawn=True`` (the real NPU's ranks: its runtime must not be loaded before a fork).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Optional, Sequence, Union

from ..pool import DEFAULT_POOL_BYTES
from ..pool.shared import connect_pool, serve_pool
from ..progress import Board, Deadlines, RankPhases
from .context_parallel import CP_RANK_TARGET
from .rank import RANK_TARGETS, rank_main
from ...netutil import free_port

__all__ = ["DistributedEngine", "DistributedCore", "RankFailure"]


class RankFailure(RuntimeError):
    """A rank process died, raised, or did not answer in time."""


# what the forkserver imports once (a rank's imports: rank_main's lazy ones included)
_PRELOAD = ["torch", "torch.distributed", "graphgen.runtime.parallel.launcher", "graphgen.runtime.parallel.dp_rank",
            "graphgen.runtime.checkpoint.hf"]
# environment read at import by a preloaded module (runtime/core/matmul.py): fixed in the forkserver
_READ_AT_IMPORT = ("GRAPHGEN_CPU_MATMUL",)
_forkserver_env: Optional[dict] = None  # those variables when this process's forkserver started


def _process_context():
    """The forkserver context (started with `_PRELOAD` on first use), or spawn when a variable of
    `_READ_AT_IMPORT` differs from the forkserver's (its modules would hold the old value)."""
    global _forkserver_env
    now = {k: os.environ.get(k) for k in _READ_AT_IMPORT}
    if _forkserver_env is None:
        _forkserver_env = now
        mp.set_forkserver_preload(_PRELOAD)
    return mp.get_context("forkserver" if now == _forkserver_env else "spawn")


def _child(env: dict, target, *args) -> None:  # the body of every process the launcher starts
    os.environ.clear()  # forked from the forkserver: its environment, not this launch's
    os.environ.update(env)
    target(*args)


def _compile_once(spec, spec_file: str) -> tuple[dict[str, str], set[str]]:
    """(variant -> CPU source, the weight names those graphs read), compiled here once for every rank
    (the rank module differs per rank only in the ``rt.rank`` its runtime holds, not in its code)."""
    from ...ir.weights import graph_weight_names
    from ...lower.compile import compile_spec

    compiled = compile_spec(spec, spec_file=spec_file, targets=("cpu",))
    sources = {c.variant: next(iter(c.sources.values())) for c in compiled}
    return sources, graph_weight_names(c.graph for c in compiled)


class DistributedCore:
    """`EngineCore`'s step API over the ranks: ``add_request``, ``abort``, ``step``, ``has_work``,
    ``stats``, ``shutdown`` (and setting ``eos_token_ids``) run on every rank's own ``Engine.core``,
    in the order the caller makes them, so every rank schedules the same steps and issues the same
    collectives; the results are rank 0's.

    What crosses to the ranks is pickled: the `SamplingParams`, from which each rank builds the
    request's sampler (a seeded one draws the same token on every rank; a sampled request without a
    seed would not agree, and the ranks' plan check stops the engine: give it a seed, as the server
    does). The logits every rank samples from are the same (the LM head's all_gather), so greedy rows
    agree. A ``ValueError`` of ``add_request`` (bad input) is raised here, every rank having refused it."""

    def __init__(self, engine: "DistributedEngine"):
        self._engine = engine

    def _call(self, method: str, *args):
        status, value = self._engine._command("core", method, *args)[0]
        if status == "invalid":
            raise ValueError(value)
        return value

    def _set(self, name: str, value) -> None:
        self._call("set", name, value)

    eos_token_ids = property(None, lambda self, ids: self._set("eos_token_ids", tuple(ids)))

    def add_request(self, req_id, prompt_ids: Sequence[int], params=None, *, max_tokens: Optional[int] = None,
                    fork_of=None) -> None:
        self._call("add_request", req_id, [int(t) for t in prompt_ids], params, max_tokens, fork_of)

    def abort(self, req_id, forks: bool = True) -> None:
        self._call("abort", req_id, forks)

    def step(self) -> list:
        return self._call("step")

    def has_work(self) -> bool:
        return self._call("has_work")

    def stats(self) -> dict:
        return self._call("stats")

    def shutdown(self, timeout: Optional[float] = None) -> None:
        self._call("shutdown", timeout)


def _max_model_len(engine) -> int:  # a probe run in every rank process (module-level: pickled by name)
    return engine.max_model_len


class DistributedEngine:
    """``parallel.world`` rank processes driven in lockstep; results are rank 0's. See the module doc."""

    def __init__(self, spec, weights: Union[str, Path, dict, None], *, spec_file: str = "", pool="host",
                 faults=None, timeout: float = 120.0, threads: Optional[int] = None,
                 pool_capacity_bytes: int = DEFAULT_POOL_BYTES, target: str = "cpu",
                 rank_timeout: Optional[Deadlines] = None, clock=time.monotonic, progress_out=None,
                 spawn: bool = False, **engine_kwargs):
        """``target``: the rank builder by name (`graphgen.runtime.parallel.rank.RANK_TARGETS`: ``"cpu"``,
        or one a target registered, e.g. ``"npu"`` by ``graphgen.npu.run.ranks``); ``engine_kwargs`` go
        to it in every rank process. ``timeout``: seconds a rank has to answer one command;
        ``rank_timeout``: the start phases' deadlines (default `Deadlines()`); ``clock`` measures both
        (tests pass a fast one); ``progress_out``: where the start's progress lines go (stderr).
        ``spawn``: a fresh interpreter per process instead of the warm forkserver (a device runtime
        that must not be loaded before a fork: the real NPU's)."""
        from ...families.parallel import layout_rules

        cpu_modules = target == "cpu"  # the CPU ranks run the modules compiled here once
        if cpu_modules and spec.parallel.cp > 1:  # context parallel's rank builder (runtime.parallel.context_parallel)
            target = CP_RANK_TARGET
        if target not in RANK_TARGETS:
            raise ValueError(f"no rank builder for target {target!r}: expected one of {sorted(RANK_TARGETS)}")

        # a --tp/--ep override is checked here (the loader checked the file's own layout)
        problems = list(layout_rules(spec.family, spec.dims, spec.parallel))
        if problems:
            raise ValueError("; ".join(f"{where}: {msg} (fix: {fix})" for where, msg, fix in problems))
        if weights is None:
            raise ValueError("weights are required: a Hugging Face checkpoint folder or a dict of tensors")
        if pool != "host":
            raise ValueError("parallel ranks share the embedded host pool (pool='host')")
        if not isinstance(weights, dict):  # (open_engine has checked its config.json)
            weights = str(weights)
        self.spec, self.tp, self._timeout = spec, spec.parallel.tp, timeout
        self.deadlines = rank_timeout or Deadlines()
        self._clock = clock
        self.world = spec.parallel.world  # rank processes: dp × cp × tp
        self._closed = False
        ctx = mp.get_context("spawn") if spawn else _process_context()  # module doc: process start
        env = dict(os.environ)
        authkey = os.urandom(16)
        pool_address = ("127.0.0.1", free_port())
        ready = ctx.Event()
        self._pool_proc = ctx.Process(target=_child, args=(env, serve_pool, pool_capacity_bytes, pool_address,
                                                           authkey, ready), daemon=True, name="graphgen-pool")
        self._pool_proc.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if not self._pool_proc.is_alive() or time.monotonic() > deadline:
                self._pool_proc.kill()
                raise RankFailure(f"the shared pool process did not start (exit code {self._pool_proc.exitcode}); "
                                  f"a script that starts ranks needs an `if __name__ == '__main__':` guard")
        self._pool = connect_pool(pool_address, authkey)
        sources, weight_names = _compile_once(spec, spec_file)  # the weight names are every target's
        cfg = {"spec": spec, "spec_file": spec_file, "weights": weights, "port": free_port(), "timeout": timeout,
               "group_timeout": max(timeout, self.deadlines.longest),  # the process group's (module doc)
               "threads": threads or max(1, (os.cpu_count() or 1) // self.world), "pool_address": pool_address,
               "authkey": authkey, "faults": faults, "engine_kwargs": engine_kwargs,
               # another target's ranks compile their own modules (its modes are its business)
               "sources": sources if cpu_modules else None, "weight_names": weight_names,
               "target": target, "target_module": RANK_TARGETS[target].module}
        self._conns, self._procs = [], []
        self._phases = RankPhases(self.world, self.deadlines, timeout, clock=clock)  # every rank: "start"
        self._board = Board(self.world, progress_out, clock=clock)
        for r in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child, args=(env, rank_main, r, cfg, child), daemon=True, name=f"graphgen-rank{r}")
            p.start()
            self._conns.append(parent)
            self._procs.append(p)
        try:
            self._collect("start")
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
    def _collect(self, what: str) -> list:
        """Every rank's reply to the last command; a rank that fails or is late ends all of them. A
        rank's ``("progress", event)`` messages before its reply move it between phases (and their
        deadlines, `RankPhases`) and feed the progress lines."""
        replies: dict[int, object] = {}
        while len(replies) < self.world:
            for r, (c, p) in enumerate(zip(self._conns, self._procs)):
                if r in replies:
                    continue
                if c.poll(0.02):
                    try:
                        status, value = c.recv()
                    except (EOFError, OSError):  # the rank's end closed: it died
                        p.join(1.0)
                        self._kill()
                        raise RankFailure(f"rank {r} exited (code {p.exitcode}) during {what}") from None
                    if status == "progress":
                        self._phases.report(r, value)
                        self._board.update(r, value)
                        continue
                    if status != "ok":
                        dead = self._dead(grace=1.0)  # a peer's death is the cause, its error the symptom
                        self._kill()
                        raise RankFailure(f"{dead}rank {r} failed during {what}:\n{value}")
                    replies[r] = value
                elif not p.is_alive():
                    self._kill()
                    raise RankFailure(f"rank {r} exited (code {p.exitcode}) during {what}")
            late = self._phases.late([r for r in range(self.world) if r not in replies])
            if late:
                self._kill()
                raise RankFailure(self._phases.describe(late, what))
            self._board.tick()
        return [replies[r] for r in range(self.world)]

    def _dead(self, grace: float) -> str:
        """``rank N exited (code C); `` for every rank that has exited (waiting up to ``grace``)."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and all(p.is_alive() for p in self._procs):
            time.sleep(0.02)
        return "".join(f"rank {r} exited (code {p.exitcode}); " for r, p in enumerate(self._procs) if not p.is_alive())

    def _command(self, cmd: str, *args) -> list:
        if self._closed:
            raise RuntimeError("the distributed engine is closed")
        for c in self._conns:
            c.send((cmd, args))
        self._phases.command()
        return self._collect(cmd)

    def _kill(self) -> None:
        self._closed = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        if self._pool_proc.is_alive():
            self._pool_proc.kill()

    # ---- the Engine calls -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, **kwargs):
        return self._command("generate", ([list(p) for p in prompts], max_new_tokens), kwargs)[0]

    def drain(self, timeout: Optional[float] = None) -> None:
        self._command("drain", timeout)

    @property
    def rank_stats(self) -> list[dict]:
        """Each rank's connector counters (``skipped_puts``: puts a rank left to rank 0)."""
        return self._command("stats")

    @property
    def stats(self) -> dict:
        """Rank 0's connector counters (what `Engine.stats` gives for one rank)."""
        return self.rank_stats[0]

    def pool_stats(self) -> dict:
        return self._pool.stats()

    def observe(self, observer) -> None:
        """Nothing: the runners and connectors that report spans are in the rank processes."""

    def kv_naming(self):
        """None: the ranks' blocks are named per shard, in their own processes (no P/D handoff)."""
        return None

    def kv_pool(self):
        return None

    def saves_in_flight(self) -> int:
        """0: each rank waits for its own commits (``drain`` barriers them)."""
        return 0

    def on_ranks(self, fn, *args) -> list:
        """``fn(rank_engine, *args)`` on every rank (in its process, between commands); each rank's
        result. ``fn`` must be picklable by reference (a module-level function) and must not call a
        collective. For tests and probes: what a rank's cache, pool view or counters hold."""
        return self._command("call", fn, *args)

    @property
    def pool(self):
        """The shared pool (a proxy to the pool process; ``get``/``contains``/``keys`` as `HostPool`)."""
        return self._pool

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._command("close")
        finally:
            self._closed = True
            for p in self._procs:
                p.join(self.timeout)
            self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
