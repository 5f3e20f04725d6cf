"""One tensor/expert-parallel rank: its runtime (collectives on torch.distributed), its KV connector
(per-rank pool keys, prefix hits agreed by every rank) and its engine.

A rank is an ordinary CPU engine (`graphgen.runtime.engine.assembly.cpu_engine`) given three parts of its own:

* `RankRuntime`: ``rt`` of the generated module, plus ``all_reduce``/``all_gather`` (gloo) and the
  rank-aware ops of `graphgen.runtime.parallel.ops` (given this rank);
* the KV cache holds this rank's shard (`graphgen.families.parallel.rank_kv_components`);
* `RankLoader` / `RankConnector`: pool keys ``{model}@{layout}@r{owner}of{tp}@{chained hash}``, ``owner`` the
  lowest rank holding the same KV shard (`graphgen.families.parallel.kv_shard_owner`): the rank itself where
  each rank's KV differs; rank 0 where it is the same on every rank (the MLA latent); the first rank
  of its group where KV heads are replicated because tp exceeds them (Qwen3 with 2 KV heads at tp=4:
  ranks 0,1 use r0of4, ranks 2,3 r2of4). Only the owner puts (`SaveOncePool` on the others): each
  distinct shard is saved once, and loaded on every rank that holds it. A prefix hit counts only as far
  as every rank hits: the leading-run length is agreed with an all_reduce MIN before loading, and
  the loaded length again after (a block evicted between lookup and load on one rank shortens the
  hit for all). Each rank commits its own blocks after its own save event (the connector's rule).

Ranks run in lockstep: each has its own scheduler, fed the same calls in the same order by the
launcher (`DistributedCore`), with hits agreed by collectives, so every rank plans the same steps.
Why not one scheduler on rank 0 broadcasting its plan (as vLLM does)? Each rank's KV shard has its
own pool keys and its own hits, so a broadcast plan would still need the same per-rank agreement
(the MIN collectives) and per-rank load staging; the calls the launcher broadcasts carry no more
than the plan would. What lockstep needs — that no rank's plan drifts — is checked every step:
`RankModelRunner` all-gathers a fingerprint of the plan (variant, rows, tokens, positions, block
tables) before the forward, and a mismatch raises on every rank (never a hang, never a silent
wrong collective).

Collectives run on the caller's (main) thread only, in the same order on every rank: the plan
check, the forward's (the graph's), then the connector's (lookup, load, drain), which the scheduler
issues in the same deterministic order on every rank because every rank sees the same prompts and
agreed hits.

Targets. What a rank process builds is looked up by name in `RANK_TARGETS` (``"cpu"``:
`rank_engine`); another target registers its builder with `register_rank_target` when its module is
imported (the NPU's: ``graphgen.npu.run.ranks``), and the launcher names that module in the rank's
config, so the rank process imports it without the runtime importing the target. The target's
``setup`` picks the rank's device and the process group's backend (``gloo`` here, ``hccl`` on an NPU)
before the group is made; the host-side agreement (plan check, hit MINs, drain barrier) always runs
on a gloo group (`RankParts.group`: the world group when it is gloo, else a gloo group beside it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import signal
import threading
import traceback
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ...families.parallel import kv_shard_owner, rank_kv_components
from ..engine.connector import KVConnector
from ..engine.kv_load import KVLoader
from ..engine.assembly import cpu_engine
from ..engine.engine import Engine
from ..engine.request import StepPlan
from ..engine.runner import CpuModelRunner
from ..pool.keys import KVShard
from ..pool.shared import connect_pool
from ..progress import STEP, Progress, reporting
from .collectives import CollectiveRuntime
from .core_calls import core_call
from .layout import RankGroups, RankLayout
from .ops import rank_weights

__all__ = ["RankLoader", "RankConnector", "RankModelRunner", "SaveOncePool", "rank_engine",
           "plan_fingerprint", "check_plan", "RankParts", "rank_parts", "RankTarget", "RANK_TARGETS",
           "register_rank_target", "rank_main"]


def agree_min(n: int, group=None) -> int:
    """The smallest ``n`` over the ranks (a collective: every rank must call it)."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


class SaveOncePool:
    """A pool as a rank sees it when a lower rank holds the same KV shard (the MLA latent, or KV heads
    replicated because tp exceeds them): reads go to the pool, puts are dropped (the shard's owner
    puts the same bytes under the same key)."""

    def __init__(self, pool):
        self._pool = pool
        self.skipped_puts = 0

    def put(self, key: str, value: bytes) -> bool:
        self.skipped_puts += 1
        return True

    def __getattr__(self, name: str):
        return getattr(self._pool, name)


class RankLoader(KVLoader):
    """Pool keys of this rank's KV shard (named by ``owner``, the lowest rank holding the same shard),
    hits agreed by every rank."""

    def __init__(self, *args, owner: int, size: int, group=None, **kwargs):
        super().__init__(*args, shard=KVShard(owner, size), **kwargs)
        self.group = group

    def lookup(self, keys: Sequence[str]) -> int:
        return agree_min(super().lookup(keys), self.group)

    def load(self, keys: Sequence[str]) -> list:
        loaded = super().load(keys)
        return loaded[:agree_min(len(loaded), self.group)]  # loaded here, but not on every rank: recomputed


class RankConnector(KVConnector):
    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def drain(self, timeout=None) -> None:
        super().drain(timeout)
        dist.barrier(group=self.group)  # every rank's commits are visible before any rank looks the pool up again


def plan_fingerprint(plan: StepPlan) -> int:
    """A 63-bit digest of what every rank must plan alike (pool keys excluded: they name the rank's shard)."""
    h = hashlib.sha256(plan.variant.encode())
    for row in plan.rows:
        h.update(repr((row.start, row.token_ids, row.block_table, row.load_block_ids, row.save_block_ids,
                       row.logits_positions, row.samples, row.decode)).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def check_plan(plan: StepPlan, group=None) -> None:
    """Compare the ranks' plans (all_gather of `plan_fingerprint`); a rank whose plan differs would
    issue other collectives, so every rank raises instead (a collective: every rank calls it)."""
    mine = torch.tensor([plan_fingerprint(plan)], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(int(t) != int(mine) for t in every):
        raise RuntimeError(f"the ranks planned different steps (plan fingerprints {[int(t) for t in every]}): "
                           f"lockstep lost (a rank got other requests or a sampler without a seed?)")


class RankModelRunner(CpuModelRunner):
    """The CPU runner of one rank: `check_plan` before each step (CPU ranks' world group is gloo)."""

    def submit(self, plan: StepPlan, *, background: bool = False):
        if plan.rows:  # a step with no forward (write-backs only) issues no collective to agree on
            check_plan(plan)
        return super().submit(plan, background=background)


@dataclasses.dataclass
class RankParts:
    """What makes an engine one rank of a layout, for any target: this rank's KV shard
    (``kv_shapes``: component -> per-block shape), its connector's two sides (per-shard keys, agreed
    hits, save-once for replicated KV, the drain barrier) and the per-step plan check, all on
    ``group`` (a gloo group; None: the world group)."""
    rank: int
    size: int
    kv_shapes: dict
    make_loader: Callable
    make_connector: Callable
    group: object = None
    groups: Optional[RankGroups] = None  # this rank's process groups by name (the layout's table)

    def check_plan(self, plan: StepPlan) -> None:
        check_plan(plan, self.group)


def rank_parts(spec, rank: int, group=None, groups: Optional[RankGroups] = None) -> RankParts:
    tp = spec.parallel.tp
    comps = rank_kv_components(spec.family, dataclasses.asdict(spec.dims), tp)
    owner = kv_shard_owner(spec.family, dataclasses.asdict(spec.dims), tp, rank)

    def make_loader(pool, cache, counters):
        return RankLoader(pool, cache, model=spec.name, owner=owner, size=tp, group=group, stats=counters)

    def make_connector(pool, cache, alloc, counters):
        if owner != rank:  # a lower rank holds the same shard and puts it
            pool = SaveOncePool(pool)
        return RankConnector(pool, cache, alloc, write=spec.pool.write, stats=counters, group=group)

    return RankParts(rank, tp, {name: (spec.kv_cache.block_size, *shape) for name, shape in comps},
                     make_loader, make_connector, group, groups)


def rank_engine(spec, weights: dict, *, rank: int, parts: RankParts, faults=None, event_timeout: float = 120.0,
                **options) -> Engine:
    """The CPU engine of one rank (``spec.parallel`` gives the layout; ``rank`` is this process's)."""
    runtime = CollectiveRuntime(faults, event_timeout=event_timeout, groups=parts.groups)
    # No async scheduling on a rank: it would plan step N+1 (whose pool lookup agrees hits with an
    # all_reduce) while step N's forward issues its own collectives on the forward thread, and two
    # threads' collectives on one group need not pair up across ranks.
    options["async_scheduling"] = False
    return cpu_engine(spec, weights, runtime=runtime, kv_shapes=parts.kv_shapes, make_loader=parts.make_loader,
                      make_connector=parts.make_connector, runner_cls=RankModelRunner, faults=faults,
                      event_timeout=event_timeout, **options)


@dataclasses.dataclass(frozen=True)
class RankTarget:
    """A target's rank builder: ``build(spec, weights, *, rank, parts, spec_file, pool, faults, sources,
    **engine_kwargs) -> Engine``; ``setup(local_rank, world, engine_kwargs) -> backend`` runs in the rank
    process before the process group exists (selects the device, names the backend); ``module``: what
    the rank process imports to find it (the builder's own module, which registers it); ``parts(spec,
    rank, group) -> RankParts``: the rank's KV shard and connector (`rank_parts`, or context parallel's)."""
    build: Callable
    setup: Callable
    module: str
    parts: Optional[Callable] = None


def _gloo(local_rank: int, world: int, engine_kwargs: dict) -> str:
    return "gloo"


RANK_TARGETS: dict[str, RankTarget] = {}


def register_rank_target(name: str, build: Callable, *, setup: Optional[Callable] = None,
                         parts: Optional[Callable] = None) -> None:
    """Make ``DistributedEngine(..., target=name)`` build each rank with ``build`` (see `RankTarget`)."""
    RANK_TARGETS[name] = RankTarget(build, setup or _gloo, build.__module__, parts or rank_parts)


register_rank_target("cpu", rank_engine)


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
    """The body of rank process ``rank`` (started by `graphgen.runtime.parallel.launcher`): join the group,
    load this rank's weight slices, build its engine, then serve the facade's commands. It reports each
    start phase it enters (``load``; ``warmup`` from a target that compiles) and its progress in them to
    the launcher (`graphgen.runtime.progress`), which holds each phase to its deadline."""
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
    """This rank's target (`RankTarget`) and the host-side gloo group (None: the world's is gloo), after
    its device is chosen and it joined the process group."""
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
    # the host-side agreement (plan check, hit MINs, drain barrier) on CPU tensors: a gloo group
    return target, (None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)), groups


def _serve_rank(rank: int, cfg: dict, conn, send, progress) -> None:  # pragma: no cover - in the rank process
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        # the parent ends the ranks (close, or kill): a terminal's Ctrl-C, sent to the whole process
        # group, must not kill a rank under a parent that is still draining
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        spec = cfg["spec"]
        target, group, groups = _join(rank, cfg)
        weights = cfg["weights"]
        progress.phase("load", total=_weight_bytes(weights))  # a folder's total: its loader says (place_weights)
        if cfg["faults"] is not None:
            cfg["faults"].weights_sleep()  # a test's slow (or hung) load
        if cfg.get("check_config"):  # another node's folder (node 0 checked its own before starting)
            from ..checkpoint.hf import check_config

            check_config(spec, weights)
        if not isinstance(weights, dict):  # a checkpoint folder: this rank streams its own slices, nothing else
            from ..checkpoint.plan import RankSlicing
            from ..checkpoint.stream import CheckpointWeights

            weights = CheckpointWeights(str(weights), frozenset(cfg["weight_names"]),
                                        RankSlicing.of(spec.parallel, rank), spec.mtp_layers)
        else:
            progress.advance(progress.total or 0)
        pool = connect_pool(cfg["pool_address"], cfg["authkey"])
        if spec.parallel.dp > 1:  # DP attention: its own slices, runtime and runner (dp_rank.py)
            from .dp_rank import build_dp_rank

            engine = build_dp_rank(spec, weights, rank, cfg, pool, target, group, groups)
            del weights
        else:
            # this rank's slices by its TP rank (innermost in the rank order), of the names the launcher compiled
            mine = (rank_weights(weights, cfg["weight_names"], rank % spec.parallel.tp, spec.parallel.tp)
                    if isinstance(weights, dict) else weights)
            del weights
            engine = target.build(spec, mine, rank=rank, parts=target.parts(spec, rank, group, groups),
                                  spec_file=cfg["spec_file"], pool=pool, faults=cfg["faults"],
                                  sources=cfg["sources"], **cfg["engine_kwargs"])
        progress.phase(STEP)
        send(("ok", None))
    except BaseException:
        send(("error", traceback.format_exc()))
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
                elif cmd == "core":  # the step API, in the calling engine's order (DistributedCore)
                    out = core_call(engine.core, args[0], args[1:])
                elif cmd == "call":  # fn(engine, *args) on every rank: a test's probe of its own rank
                    out = args[0](engine, *args[1:])
                elif cmd == "stats":
                    skipped = getattr(engine.connector.pool, "skipped_puts", 0)  # counted as puts by the connector
                    out = {**engine.stats, "puts": engine.stats["puts"] - skipped, "skipped_puts": skipped}
                else:
                    raise ValueError(f"unknown rank command {cmd!r}")
                send(("ok", out if rank == 0 or cmd in ("stats", "call") else None))
            except BaseException as e:
                send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    send(("ok", None))
    dist.destroy_process_group()
