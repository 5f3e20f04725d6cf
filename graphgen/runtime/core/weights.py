"""Weights in the dtype a target computes in, except the keys the family keeps in float32.

One home for the rule every engine applies (the CPU target, a CPU rank, the NPU runner): matrices and
norms take the compute dtype (the spec's ``kv_cache.dtype`` on CPU, ``targets.npu.dtype`` on the NPU),
while the family's ``fp32_suffixes`` (DeepSeek's router weight and score-correction bias) stay float32:
routing compares sigmoid scores plus a small bias, and bf16's 8 bits of mantissa would change which
experts win. Names may carry a shard suffix (``key[d0/2]``): the rule reads the checkpoint key.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ...families import FAMILIES
from ...ir.weights import parse_shard

__all__ = ["keeps_fp32", "cast_weights"]


def keeps_fp32(family: str, name: str) -> bool:
    """Whether weight ``name`` (a checkpoint key, or a graph name with a shard suffix) stays float32."""
    keep = FAMILIES[family].fp32_suffixes
    return bool(keep) and parse_shard(name)[0].endswith(keep)


def cast_weights(weights: Mapping[str, torch.Tensor], family: str, dtype: torch.dtype,
                 device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
    """``weights`` in ``dtype`` (on ``device``), the family's float32 keys in float32."""
    return {k: v.to(device=device, dtype=torch.float32 if keeps_fp32(family, k) else dtype)
            for k, v in weights.items()}
