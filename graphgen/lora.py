"""Multi-LoRA on the build path: which linear layers of a spec take adapters, and how their slots are named.

One home for the rule the ``insert_lora`` pass, the PEFT reader (`graphgen.runtime.lora.peft`) and the slot
store (`graphgen.runtime.lora.slots`) share: a checkpoint weight ``model.layers.<i>.<block>.<module>.weight``
takes an adapter when ``<module>`` is one of the spec's ``lora.targets`` (all of the family's
``lora_modules`` when empty) and the weight is a *dense* projection of the graph -- the MoE layers' experts
and shared experts take none (``model.layers.<i>.mlp.shared_experts.gate_proj`` is not ``mlp.gate_proj``).
Pure Python, no torch (docs/lora.md).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .families import FAMILIES

if TYPE_CHECKING:
    from .modelspec.model import ModelSpec

__all__ = ["LORA_INDEX", "SLOT_KIND", "lora_modules", "lora_weight_keys", "module_of", "slot_buffer"]

# the step input: each token's adapter slot (0: no adapter, the zero slot; 1..max_loras: the device slots)
LORA_INDEX = "lora_index"
SLOT_KIND = "lora_slots"  # the IR name kind of one projection's adapter slots (a buffer the host fills)
_DENSE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)\.weight$")


def lora_modules(spec: "ModelSpec") -> tuple[str, ...]:
    """The module names adapters may target under ``spec`` (() without a ``lora:`` section)."""
    if spec.lora is None:
        return ()
    return spec.lora.targets or FAMILIES[spec.family].lora_modules


def module_of(key: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``q_proj``."""
    return key.rsplit(".", 2)[-2]


def lora_weight_keys(spec: "ModelSpec") -> dict[str, tuple[int, int]]:
    """Checkpoint key -> (out, in) of every decoder-layer projection that takes an adapter, in layer order
    (the MTP layers take none: the adapter targets the target model, as vLLM's)."""
    mods = set(lora_modules(spec))
    if not mods:
        return {}
    layout = FAMILIES[spec.family].checkpoint_layout(spec.dims)
    out: dict[str, tuple[int, int]] = {}
    for key, shape in layout.items():
        m = _DENSE.match(key)
        if m and int(m.group(1)) < spec.dims.num_hidden_layers and m.group(3) in mods and len(shape) == 2:
            out[key] = (int(shape[0]), int(shape[1]))
    return out


def slot_buffer(key: str) -> str:
    """The IR buffer of one projection's adapter slots (``lora_slots.model.layers.0.self_attn.q_proj``)."""
    return f"{SLOT_KIND}.{key.removesuffix('.weight')}"
