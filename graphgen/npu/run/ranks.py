"""NPU ranks: one process per device, in lockstep, built by the runtime's rank launcher.

``open_engine(..., target="npu", tp=N)`` (``graphgen run/serve --target npu --tp N``) returns the
runtime's `DistributedEngine` with ``target="npu"``: the same launcher, pool process, lockstep step
API and per-step plan check as the CPU ranks. `graphgen.npu.run.runner` registers the rank builder
(``npu_rank_engine``: `npu_engine` with a rank's parts) with `setup_rank` from here
(`register_rank_target`); the launcher names the runner module in each rank's config, so the rank
process imports it (the runtime never imports NPU code). In each rank process, before the process group:

* `setup_rank` picks the device from the local rank and ``ASCEND_RT_VISIBLE_DEVICES`` (`rank_device`),
  ``torch.npu.set_device``, and names the backend: ``hccl`` (the generated modules' functional
  collectives become HCCL collectives in the captured graph); with ``standin`` (CPU, tests) ``gloo``;
* then the launcher's rank body joins the group, slices the weights (`rank_weights`, the graph's
  shard names) and calls ``npu_rank_engine``: `npu_engine` (so `build_engine`) with the rank's KV shard,
  per-shard pool keys, agreed hits, save-once for replicated KV and the plan check (`RankParts`).

Several nodes: ``--nnodes``/``--node-rank``/``--master-addr`` (or torchrun), each node's ranks on its own
devices (docs/parallel.md, "Ranks across nodes"); a node's ranks wider than its devices are refused with
one sentence. DP attention (``dp > 1``, tp 1 per group): `graphgen.npu.run.data_parallel`. The real-device
path (hccl, set_device) has never run on an NPU.
"""
from __future__ import annotations

import os
from typing import Optional

__all__ = ["rank_device", "setup_rank", "launch_npu_ranks"]

MULTI_NODE = ("a layout wider than one node runs on several: give every node --nnodes N --node-rank R "
              "--master-addr A (docs/parallel.md, 'Ranks across nodes')")


def rank_device(local_rank: int, world: int, *, visible: Optional[str], device_count: int) -> tuple[int, int]:
    """``(index for torch.npu.set_device, physical device id)`` of local rank ``local_rank`` of ``world``.

    ``visible``: ``ASCEND_RT_VISIBLE_DEVICES`` (None or empty: unset). As with CUDA_VISIBLE_DEVICES, a
    process sees only the listed devices, renumbered from 0 in the listed order: the index is the
    local rank, the physical id the list's entry. ``device_count``: what the runtime reports (the
    node's devices when ``visible`` is unset). A world larger than the devices this node offers is a
    ``ValueError`` (one sentence: no multi-node launch)."""
    if visible is not None and visible.strip():
        try:
            ids = [int(x) for x in visible.split(",")]
        except ValueError:
            raise ValueError(f"ASCEND_RT_VISIBLE_DEVICES={visible!r}: expected comma-separated device ids") from None
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError(f"ASCEND_RT_VISIBLE_DEVICES={visible!r}: device ids must be distinct and >= 0")
        where = f"ASCEND_RT_VISIBLE_DEVICES lists {len(ids)}"
    else:
        ids = list(range(device_count))
        where = f"this node has {device_count}"
    if world > len(ids):
        raise ValueError(f"this node's {world} ranks need {world} NPUs but {where}; {MULTI_NODE}")
    if not 0 <= local_rank < world:
        raise ValueError(f"local rank {local_rank} outside a world of {world}")
    return local_rank, ids[local_rank]


def setup_rank(local_rank: int, world: int, engine_kwargs: dict) -> str:  # pragma: no cover - in the rank process
    """Before the process group: the rank's device and the backend (see the module doc)."""
    if engine_kwargs.get("standin"):
        return "gloo"  # the same rank code on CPU: the modules' functional collectives run on gloo
    import torch

    from .compile import _import_torchair

    _import_torchair(False)  # torch_npu registers torch.npu
    index, _ = rank_device(local_rank, world, visible=os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
                           device_count=torch.npu.device_count())  # type: ignore[attr-defined]
    torch.npu.set_device(index)  # type: ignore[attr-defined]
    return "hccl"


def launch_npu_ranks(spec, weights, *, standin: bool, **options):
    """The layout's NPU rank processes on this node (the runtime's `DistributedEngine`, ``target="npu"``; under
    DP attention its `DataParallelEngine`). On a real NPU this node's ranks must fit its devices (checked
    here, before any process starts)."""
    from ...runtime import DataParallelEngine, DistributedEngine

    if not standin:
        import torch

        here = options.get("placement")
        rank_device(0, len(here.ranks) if here is not None else spec.parallel.world,
                    visible=os.environ.get("ASCEND_RT_VISIBLE_DEVICES"),
                    device_count=torch.npu.device_count())  # type: ignore[attr-defined]
    engine = DataParallelEngine if spec.parallel.dp > 1 else DistributedEngine
    # a real device: fresh interpreters (torch_npu must not be loaded before a fork; the stand-in forks warm)
    return engine(spec, weights, target="npu", standin=standin, spawn=not standin, **options)
