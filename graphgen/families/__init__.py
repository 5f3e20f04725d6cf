"""Model families: one module per family, one registry.

``FAMILIES`` maps a spec's ``family`` name to its :class:`~graphgen.families.base.Family`; everything
graphgen knows about an architecture is reached through it (see ``base.py`` for what a family
holds, and docs/design.md, "Adding a model family"). Pure Python, no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Union

from . import deepseek_v3, qwen3_dense
from .base import Family
from .deepseek_v3 import DeepseekV3Dims, RopeScaling, mla_softmax_scale
from .qwen3_dense import Qwen3Dims

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen3_dense.FAMILY, deepseek_v3.FAMILY)}

# The spec's ``family`` (the registry's names) and ``dims`` (one of the families' dims classes, chosen
# by ``family``): built from FAMILIES, and spelled out for the type checker, which cannot evaluate that.
if TYPE_CHECKING:
    FamilyName = Literal["qwen3_dense", "deepseek_v3"]
    Dims = Union[Qwen3Dims, DeepseekV3Dims]
else:
    FamilyName = Literal[tuple(FAMILIES)]
    Dims = Union[tuple(f.dims_cls for f in FAMILIES.values())]

BY_HF_MODEL_TYPE: dict[str, Family] = {f.hf_model_type: f for f in FAMILIES.values()}

__all__ = ["FAMILIES", "BY_HF_MODEL_TYPE", "Dims", "FamilyName", "Family", "Qwen3Dims", "DeepseekV3Dims", "RopeScaling",
           "mla_softmax_scale"]
