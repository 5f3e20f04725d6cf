"""Per-rank memory of a spec's layout: weights (from the sharded graphs' weight names and the
family's checkpoint layout) and KV per block (from the rank's KV components), for ``graphgen
validate``. Weights are counted in the KV cache's dtype (the specs' checkpoints are stored in it).
Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

from ..families import FAMILIES
from ..families.parallel import rank_kv_components
from ..ir.weights import graph_weight_names, parse_shard

if TYPE_CHECKING:
    from ..ir.graph import Graph
    from ..modelspec.model import ModelSpec

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.2f} MiB"


@dataclass(frozen=True)
class RankMemory:
    tp: int
    ep: int
    weight_bytes: int  # one rank's weights (the largest rank: padded chunks count whole)
    kv_bytes_per_block: int  # one rank's KV of one block, all layers
    kv_blocks: int = 0  # blocks one rank must hold: the largest decode batch at max_model_len
    dp: int = 1
    cp: int = 1

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_blocks * self.kv_bytes_per_block

    def text(self) -> str:
        layout = f"tp={self.tp}, ep={self.ep}" + "".join(f", {k}={v}" for k, v in (("dp", self.dp), ("cp", self.cp))
                                                        if v > 1)
        return (f"per rank ({layout}): weights {_size(self.weight_bytes)}, "
                f"KV {self.kv_bytes_per_block / 1024:.1f} KiB per block, "
                f"{self.kv_blocks} blocks {_size(self.kv_blocks * self.kv_bytes_per_block)}, "
                f"total {_size(self.total_bytes)}")


def kv_blocks_needed(spec: ModelSpec) -> int:
    """Blocks one rank holds for the NPU target's largest decode batch at its max_model_len (the target's
    defaults when the spec has no NPU target): every DP group has a batch of its own, and KV is replicated
    over the CP and TP ranks (the MLA latent) or split by KV heads, so the count is per rank either way."""
    from ..modelspec.model import NpuTarget

    npu = spec.targets.npu or NpuTarget()
    # the max_model_len default of graphgen.npu.run.bucketing.max_model_len (not imported: it is torch-side)
    max_len = npu.max_model_len or min(4096, getattr(spec.dims, "max_position_embeddings", 4096))
    return npu.decode_batch_buckets[-1] * math.ceil(max_len / spec.kv_cache.block_size)


def rank_memory(spec: ModelSpec, graphs: Iterable[Graph]) -> RankMemory:
    """``graphs``: the spec's graphs after ``shard`` (every variant reads the same weights; the union
    is counted once)."""
    fam = FAMILIES[spec.family]
    layout = fam.checkpoint_layout(fam.dims_of(spec.dims), stacked=True)
    size = ITEMSIZE[spec.kv_cache.dtype]
    names = graph_weight_names(graphs)
    weight_bytes = 0
    for name in sorted(names):
        key, dim, parts = parse_shard(name)
        shape = list(layout[key])
        if dim is not None:
            shape[dim] = math.ceil(shape[dim] / parts)
        weight_bytes += math.prod(shape) * size
    comps = rank_kv_components(spec.family, dataclasses.asdict(spec.dims), spec.parallel.tp)
    kv = spec.kv_layers * spec.kv_cache.block_size * sum(math.prod(s) for _, s in comps) * size
    par = spec.parallel
    return RankMemory(par.tp, par.ep, weight_bytes, kv, kv_blocks_needed(spec), par.dp, par.cp)


def memory_problems(spec: ModelSpec, mem: RankMemory, device_memory_gib: Optional[float] = None) -> list[str]:
    """The layout's per-rank weights + KV against ``device_memory_gib`` (default: the spec's
    ``targets.npu.device_memory_gib``; none: nothing to check)."""
    npu = spec.targets.npu
    where = "--device-memory-gib" if device_memory_gib is not None else "targets.npu.device_memory_gib"
    if device_memory_gib is None:
        device_memory_gib = npu.device_memory_gib if npu is not None else None
    if device_memory_gib is None:
        return []
    limit = device_memory_gib * GIB
    if mem.total_bytes > limit:
        return [f"per-rank weights {mem.weight_bytes / GIB:.2f} GiB + KV {mem.kv_blocks} blocks "
                f"{mem.kv_blocks * mem.kv_bytes_per_block / GIB:.2f} GiB exceed {where} "
                f"({device_memory_gib:g} GiB); fix: raise parallel.tp (and ep for MoE), or dp with ep = dp × tp"]
    return []
