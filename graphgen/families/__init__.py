"""Model families: one module per family, one registry.

``FAMILIES`` maps a spec's ``family`` name to its :class:`~graphgen.families.base.Family`; everything
graphgen knows about an architecture is reached through it (see ``base.py`` for what a family
holds, and docs/design.md, "Adding a model family"). Pure Python, no torch.
"""

from __future__ import annotations

from typing import Union

from . import deepseek_v3, qwen3_dense
from .base import Family
from .deepseek_v3 import DeepseekV3Dims, RopeScaling, mla_softmax_scale
from .qwen3_dense import Qwen3Dims

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen3_dense.FAMILY, deepseek_v3.FAMILY)}

# The spec's ``dims`` type: one of the families' dims classes, chosen by ``family``.
Dims = Union[tuple(f.dims_cls for f in FAMILIES.values())]

BY_HF_MODEL_TYPE: dict[str, Family] = {f.hf_model_type: f for f in FAMILIES.values()}

__all__ = ["FAMILIES", "BY_HF_MODEL_TYPE", "Dims", "Family", "Qwen3Dims", "DeepseekV3Dims", "RopeScaling",
           "mla_softmax_scale"]
