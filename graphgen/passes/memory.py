"""Per-rank memory of a spec's layout: weights (from the sharded graphs' weight names and the
family's checkpoint layout) and KV per block (from the rank's KV components), for ``graphgen
validate``. Weights are counted in the KV cache's dtype (the specs' checkpoints are stored in it).
Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..families import FAMILIES
from ..families.parallel import rank_kv_components
from ..ir.weights import graph_weight_names, parse_shard

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30


@dataclass(frozen=True)
class RankMemory:
    tp: int
    ep: int
    weight_bytes: int  # one rank's weights (the largest rank: padded chunks count whole)
    kv_bytes_per_block: int  # one rank's KV of one block, all layers

    def text(self) -> str:
        w = (f"{self.weight_bytes / GIB:.2f} GiB" if self.weight_bytes >= GIB / 10
             else f"{self.weight_bytes / (1 << 20):.2f} MiB")
        return (f"per rank (tp={self.tp}, ep={self.ep}): weights {w}, "
                f"KV {self.kv_bytes_per_block / 1024:.1f} KiB per block")


def rank_memory(spec, graphs) -> RankMemory:
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
    return RankMemory(spec.parallel.tp, spec.parallel.ep, weight_bytes, kv)


def memory_problems(spec, mem: RankMemory) -> list[str]:
    npu = spec.targets.npu
    if npu is None or npu.device_memory_gib is None:
        return []
    limit = npu.device_memory_gib * GIB
    if mem.weight_bytes > limit:
        return [f"per-rank weights {mem.weight_bytes / GIB:.2f} GiB exceed targets.npu.device_memory_gib "
                f"({npu.device_memory_gib:g} GiB); fix: raise parallel.tp (and ep for MoE)"]
    return []
