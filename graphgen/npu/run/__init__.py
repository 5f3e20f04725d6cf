"""The NPU target at run time: compile with shape buckets, step inputs, staging ring, the model runner.

Importing this package registers the target with the runtime (``open_engine(..., target="npu")``);
the runtime itself never imports NPU code."""
from . import engine  # noqa: F401  (registers the "npu" target)
from .compile import NpuUnavailable  # noqa: F401  (what a caller of the NPU target catches)
