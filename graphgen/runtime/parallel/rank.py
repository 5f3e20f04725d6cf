"""One tensor/expert-parallel rank: its runtime (collectives on torch.distributed), its KV connector
(per-rank pool keys, prefix hits agreed by every rank) and its engine.

A rank is an ordinary `Engine` with three parts replaced:

* `RankRuntime`: ``rt`` of the generated module, plus ``all_reduce``/``all_gather`` (gloo) and the
  rank-aware ops of `graphgen.runtime.parallel.ops` (given this rank);
* the KV cache holds this rank's shard (`graphgen.families.parallel.rank_kv_components`);
* `RankConnector`: pool keys ``{model}@{layout}@r{rank}of{tp}@{chained hash}`` where each rank's KV
  differs; where it is the same on every rank (the MLA latent) every rank uses rank 0's key and only
  rank 0 puts it (`SaveOncePool`): saved once, loaded on every rank. A prefix hit counts only as far
  as every rank hits: the leading-run length is agreed with an all_reduce MIN before loading, and
  the loaded length again after (a block evicted between lookup and load on one rank shortens the
  hit for all). Each rank commits its own blocks after its own save event (the connector's rule).

Collectives run on the caller's (main) thread only, in the same order on every rank: the forward's
(the graph's), then the connector's (lookup, load, drain), which the scheduler issues in the same
deterministic order on every rank because every rank sees the same prompts and agreed hits.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import traceback
from typing import Sequence

import torch
import torch.distributed as dist

from ...families.parallel import kv_replicated, rank_kv_components
from . import ops as ops_parallel
from ..pool.shared import connect_pool
from ..engine.connector import KVConnector
from ..core.cpu_runtime import CpuRuntime
from ..engine.facade import Engine
from .ops import rank_weights
from ..pool.base import block_keys

__all__ = ["RankRuntime", "RankConnector", "SaveOncePool", "RankEngine", "graph_weight_names", "rank_main"]


class RankRuntime(CpuRuntime):
    def __init__(self, *args, rank: int, size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.rank, self.size = rank, size

    def _check(self, size: int) -> None:
        if size != self.size:  # a module generated for another layout
            raise RuntimeError(f"collective of a {size}-rank graph on a {self.size}-rank group")

    def all_reduce(self, x: torch.Tensor, *, group: str, size: int, reduce: str) -> torch.Tensor:
        self._check(size)
        if reduce != "sum":
            raise ValueError(f"all_reduce: unsupported reduce {reduce!r}")
        y = x.contiguous().clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return y

    def all_gather(self, x: torch.Tensor, *, group: str, size: int, dim: int, length: int) -> torch.Tensor:
        self._check(size)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim).narrow(dim, 0, length)

    def embedding_shard(self, weight, input_ids, *, vocab_size: int):
        return ops_parallel.embedding_shard(weight, input_ids, vocab_size=vocab_size, rank=self.rank, size=self.size)

    def moe(self, *args, **kwargs):
        return ops_parallel.moe(*args, rank=self.rank, size=self.size, **kwargs)

    def __getattr__(self, name: str):
        if name in ops_parallel.__all__:
            return getattr(ops_parallel, name)
        return super().__getattr__(name)


def agree_min(n: int) -> int:
    """The smallest ``n`` over the ranks (a collective: every rank must call it)."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class SaveOncePool:
    """A pool as a rank other than 0 sees it when every rank's KV is the same (the MLA latent):
    reads go to the pool, puts are dropped (rank 0 puts the same bytes under the same key)."""

    def __init__(self, pool):
        self._pool = pool
        self.skipped_puts = 0

    def put(self, key: str, value: bytes) -> bool:
        self.skipped_puts += 1
        return True

    def __getattr__(self, name: str):
        return getattr(self._pool, name)


class RankConnector(KVConnector):
    def __init__(self, *args, rank: int, size: int, replicated: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.rank, self.size, self.replicated = rank, size, replicated

    def block_keys(self, prompt: Sequence[int]) -> list[str]:
        return block_keys(prompt, self.cache.block_size, model=self.model, layout=self.cache.layout,
                          rank=0 if self.replicated else self.rank, world=self.size)

    def lookup(self, keys: Sequence[str]) -> int:
        return agree_min(super().lookup(keys))

    def load(self, keys: Sequence[str], block_ids: Sequence[int]) -> int:
        n = agree_min(super().load(keys, block_ids))
        self.discard(block_ids[n:])  # loaded here, but not on every rank: recomputed
        return n

    def drain(self, timeout=None) -> None:
        super().drain(timeout)
        dist.barrier()  # every rank's commits are visible before any rank looks the pool up again


class RankEngine(Engine):
    """The engine of one rank (``spec.parallel`` gives the layout; ``rank`` is this process's)."""

    def __init__(self, spec, weights: dict, *, rank: int, **kwargs):
        self.rank = rank
        # No async scheduling on a rank: it would schedule step N+1 (whose pool lookup agrees hits
        # with an all_reduce) while step N's forward issues its own collectives on the forward
        # thread, and two threads' collectives on one group need not pair up across ranks.
        kwargs["async_scheduling"] = False
        super().__init__(spec, weights, **kwargs)

    def _kv_shapes(self, num_blocks: int) -> dict:
        comps = rank_kv_components(self.spec.family, dataclasses.asdict(self.spec.dims), self.spec.parallel.tp)
        return {name: (num_blocks, self.block_size, *shape) for name, shape in comps}

    def _make_runtime(self, event_timeout: float) -> CpuRuntime:
        return RankRuntime(self.faults, event_timeout=event_timeout, rank=self.rank, size=self.spec.parallel.tp)

    def _make_connector(self) -> KVConnector:
        replicated = kv_replicated(self.spec.family)
        if replicated and self.rank != 0:
            self.pool = SaveOncePool(self.pool)
        return RankConnector(self.pool, self.cache, self.alloc, model=self.spec.name, write=self.write,
                             rank=self.rank, size=self.spec.parallel.tp, replicated=replicated)


def graph_weight_names(spec, spec_file: str = "") -> set[str]:
    """Every weight name (sliced ones as ``key[d<dim>/<parts>]``) the spec's graphs read."""
    from ...passes.manager import run_pipeline

    names = set()
    for v in spec.variants:
        g = run_pipeline(spec, v, spec_file=spec_file, until="shard")
        names |= {val for n in g.nodes for k, val in n.attrs.items() if k.startswith("w_") and isinstance(val, str)}
    return names


def _llm_call(llm, method: str, args: tuple):
    """One `DistributedLLM` call on this rank's `LLMEngine`: ``("ok", result)``, or ``("invalid",
    message)`` when ``add_request`` refused its input (the same refusal on every rank: nothing was queued)."""
    if method == "set":
        name, value = args
        setattr(llm, name, value)
        return "ok", None
    if method == "add_request":
        req_id, prompt, params, max_tokens = args
        try:
            llm.add_request(req_id, prompt, params, max_tokens=max_tokens)
        except ValueError as e:
            return "invalid", str(e)
        return "ok", None
    if method not in ("abort", "step", "has_work", "stats", "shutdown"):
        raise ValueError(f"unknown step-API call {method!r}")
    return "ok", getattr(llm, method)(*args)


def rank_main(rank: int, cfg: dict, conn) -> None:  # pragma: no cover - runs in the rank process
    """The body of rank process ``rank`` (started by `graphgen.runtime.parallel.launcher`): join the group,
    load this rank's weight slices, build its engine, then serve the facade's commands."""
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # the parent ends the ranks (close, or kill): a terminal's Ctrl-C, sent to the whole process
        # group, must not kill a rank under a parent that is still draining
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(cfg["threads"])
        spec = cfg["spec"]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank,
                                world_size=spec.parallel.tp, timeout=datetime.timedelta(seconds=cfg["timeout"]))
        weights = cfg["weights"]
        if not isinstance(weights, dict):
            from ..checkpoint.hf import load_hf_weights

            weights = load_hf_weights(weights)
        mine = rank_weights(weights, cfg["weight_names"], rank, spec.parallel.tp)  # compiled by the launcher
        del weights
        pool = connect_pool(cfg["pool_address"], cfg["authkey"])
        engine = RankEngine(spec, mine, rank=rank, spec_file=cfg["spec_file"], pool=pool, faults=cfg["faults"],
                            sources=cfg["sources"], **cfg["engine_kwargs"])
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    with engine:
        while True:
            cmd, args = conn.recv()
            try:
                if cmd == "close":
                    break
                if cmd == "generate":
                    out = engine.generate(*args[0], **args[1])
                elif cmd == "drain":
                    out = engine.drain(*args)
                elif cmd == "llm":  # the step API, in the facade's order (DistributedLLM)
                    out = _llm_call(engine.llm, args[0], args[1:])
                elif cmd == "call":  # fn(engine, *args) on every rank: a test's probe of its own rank
                    out = args[0](engine, *args[1:])
                elif cmd == "stats":
                    skipped = getattr(engine.pool, "skipped_puts", 0)  # counted as puts by the connector
                    out = {**engine.stats, "puts": engine.stats["puts"] - skipped, "skipped_puts": skipped}
                else:
                    raise ValueError(f"unknown rank command {cmd!r}")
                conn.send(("ok", out if rank == 0 or cmd in ("stats", "call") else None))
            except BaseException as e:
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    conn.send(("ok", None))
    dist.destroy_process_group()
