"""A full-size launch on CPU, kernels aside (``graphgen dry-run``; docs/npu.md, "Full-size launch").

`dry_run_rank` does for one rank what a launch does before its first step, on a ledger device
(`graphgen.dryrun.ledger.Ledger`: meta tensors that count their bytes and raise past the device's
capacity): it streams the rank's slices from the real checkpoint files through the runtime's one
loader (`graphgen.runtime.core.weights.place_weights`, as the NPU runner and the CPU engine do), builds
the load-time weights, sizes and allocates the KV cache with the launch's rule
(`graphgen.runtime.core.device_memory.kv_blocks_that_fit`), allocates the staging rings, and lists the
graphs the warm-up would compile. The ledger is the one part that differs from a launch.
"""

from .rank import RankReport, dry_run_rank, graph_list

__all__ = ["RankReport", "dry_run_rank", "graph_list"]
