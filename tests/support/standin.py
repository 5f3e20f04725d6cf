"""What the NPU tests share about the CPU stand-in (the fixtures themselves are in tests/npu/conftest.py)."""
from __future__ import annotations

from .paths import TESTS

# the hardware-shaped tiny Qwen3 (bf16, head_dim 128, block 128) most stand-in compile tests use
HW_TINY_QWEN3 = TESTS / "npu" / "data" / "hw_tiny_qwen3.yaml"
# A hang guard for the stand-in compiles a test runs (in its interpreter or a subprocess), far above a quiet
# run's time (the longest, 24 steps of every variant of HW_TINY_QWEN3 on meta tensors, takes ~20 s of CPU):
# they must never fail on a busy machine for lack of CPU alone.
STANDIN_TIMEOUT_S = 1800
