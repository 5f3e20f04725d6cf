"""NPU rank start-up across nodes: the environment each rank starts with, and the barrier after loading.

Why (audit 4 M2, M9, M10): HCCL builds its communicators inside the first warm-up graph's GE conversion
(torchair's c10d converters call ``get_hccl_comm_name(rank, init_comm=True)``,
``air/_ge_concrete_graph/hcom_utils.py:15``), and a rank waits there for its peers only
``HCCL_CONNECT_TIMEOUT`` seconds (CANN default 120, range 120-7200).  Loading 50 GiB per rank skews ranks
by minutes across nodes, so:

* `loaded_barrier`: every rank waits after its load, before its first compile, on the process group's
  TCP store (host side: no HCCL involved), for up to the load deadline (``--rank-timeout load=S``), so the
  ranks enter the first conversion together whatever their load skew;
* `rank_environment`: what each NPU rank's interpreter starts with (the launcher merges it into the
  children's environment before they start, so before they ``import torch``: the wheel's torch backend
  autoload, ``[torch.backends] torch_npu = torch_npu:_autoload`` in ``entry_points.txt``, imports torch_npu
  during ``import torch``, and CANN reads some variables when it starts): ``ENABLE_DYNAMIC_SHAPE_MULTI_STREAM``,
  ``HCCL_CONNECT_TIMEOUT`` from the warm-up deadline, and, on several nodes, ``HCCL_IF_IP`` /
  ``HCCL_SOCKET_IFNAME`` of the interface towards ``--master-addr`` when unset.  A variable already set is kept.

Unverified on hardware: that CANN honours these when set this way (they are in the process environment
from its first instruction, which is the strongest placement there is), and the barrier's effect on HCCL.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["HCCL_CONNECT_TIMEOUT_RANGE", "hccl_connect_timeout", "rank_environment", "loaded_barrier",
           "BarrierTimeout"]

# CANN: "HCCL_CONNECT_TIMEOUT ... 取值范围[120, 7200]，默认值为120，单位s"
HCCL_CONNECT_TIMEOUT_RANGE = (120, 7200)


def hccl_connect_timeout(warmup_deadline: float) -> int:
    """Seconds for ``HCCL_CONNECT_TIMEOUT``: the warm-up deadline (the whole phase in which HCCL connects),
    clamped to CANN's documented range."""
    lo, hi = HCCL_CONNECT_TIMEOUT_RANGE
    return int(min(hi, max(lo, round(warmup_deadline))))


def rank_environment(env: dict, *, warmup_deadline: float, multi_node: bool, master_addr: Optional[str],
                     interface: Optional[Callable[[str], tuple]] = None) -> dict:
    """The variables to add to ``env`` (the launcher's child environment) for NPU ranks; keys already in
    ``env`` are never overridden (an operator's export wins).  ``interface(host) -> (name, address)``: the
    local interface towards ``host`` (default `graphgen.netutil.interface_towards`)."""
    from .compile import MULTI_STREAM_ENV

    add = {MULTI_STREAM_ENV[0]: MULTI_STREAM_ENV[1],
           "HCCL_CONNECT_TIMEOUT": str(hccl_connect_timeout(warmup_deadline))}
    if multi_node and master_addr and not ({"HCCL_IF_IP", "HCCL_SOCKET_IFNAME"} & set(env)):
        if interface is None:
            from ...netutil import interface_towards as interface
        name, address = interface(master_addr)
        add["HCCL_SOCKET_IFNAME"], add["HCCL_IF_IP"] = name, address
    return {k: v for k, v in add.items() if k not in env}


class BarrierTimeout(RuntimeError):
    """Not every rank arrived at the post-load barrier within its deadline."""


def loaded_barrier(store, world: int, *, deadline: float, key: str = "graphgen/npu/loaded",
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                   poll: float = 0.5, on_wait: Optional[Callable[[int, float], None]] = None) -> float:
    """Arrive at ``key`` on ``store`` (a ``torch.distributed.Store``: ``add``) and wait until all ``world``
    ranks have, for at most ``deadline`` seconds of ``clock``; returns the seconds waited.  ``on_wait(arrived,
    waited)`` is told every poll (the progress reporter's heartbeat: a long wait is not a hung rank).
    `BarrierTimeout` names how many arrived and the flag that raises the deadline."""
    t0 = clock()
    arrived = int(store.add(key, 1))
    while arrived < world:
        waited = clock() - t0
        if waited > deadline:
            raise BarrierTimeout(f"{arrived} of {world} ranks finished loading within {deadline:.0f} s; the others "
                                 f"are still loading or gone (--rank-timeout load=S raises the wait)")
        if on_wait is not None:
            on_wait(arrived, waited)
        sleep(poll)
        arrived = int(store.add(key, 0))
    return clock() - t0


def default_store():  # pragma: no cover - in a rank process
    """The default process group's TCP store (None: no process group, or one rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    return dist.distributed_c10d._get_default_store()


def npu_rank_env(env: dict, placement, deadlines) -> dict:
    """`RankTarget.env` of the NPU target: `rank_environment` for the launcher's placement and deadlines."""
    return rank_environment(env, warmup_deadline=deadlines.warmup, multi_node=placement.multi_node,
                            master_addr=placement.master_addr)


def barrier_after_load(groups, rank_timeout=None) -> Optional[float]:  # pragma: no cover - in a rank process
    """`loaded_barrier` on the default group's store for a rank of ``groups`` (world > 1), under the load
    deadline (``rank_timeout``: `graphgen.runtime.Deadlines`; None: the defaults); None where there is none."""
    if groups is None or groups.layout.world < 2:
        return None
    store = default_store()
    if store is None:
        return None
    from ...runtime.progress import Deadlines

    return loaded_barrier(store, groups.layout.world, deadline=(rank_timeout or Deadlines()).load)
