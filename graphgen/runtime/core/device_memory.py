"""How many KV blocks fit on a device once the weights are on it (vLLM's ``gpu_memory_utilization`` rule).

The engine may use ``utilization`` of the device's memory; what it already uses when the cache is sized
(the weights: the device's free memory at the engine's start minus now) and what it allocates after the
cache (the staging rings) come off first, and the rest is KV blocks. One function for the launch
(``torch.npu.mem_get_info()``) and the dry run (its ledger's numbers): the device's report is the one
place they differ. The (1 - utilization) share left over is the headroom for what no
tensor accounts for (graph workspace, allocator fragmentation); see `graphgen.passes.memory`.
"""

from __future__ import annotations

__all__ = ["kv_blocks_that_fit"]


def kv_blocks_that_fit(used: int, total: int, block_bytes: int, *, utilization: float, after_bytes: int = 0) -> int:
    """KV blocks of ``block_bytes`` each that fit in ``utilization × total`` next to what the engine
    already uses (``used``: the weights, measured since the engine started) and ``after_bytes`` still to
    come (the staging rings); 0 when none does. What the runtime held before the engine started lies
    in the other (1 - utilization), as in vLLM."""
    if not 0 < utilization <= 1:
        raise ValueError(f"device memory utilization must be in (0, 1], got {utilization}")
    return max(0, (int(utilization * total) - used - after_bytes) // block_bytes)
