"""Multi-LoRA in the NPU runner (docs/lora.md, "NPU"): a step's adapters acquired in their slots when it is
submitted and released when it is collected, and the step inputs the LoRA modules read (``b.lora_sel``, each
token's one-hot slot padded to the bucket; ``b.lora``, the slot stacks). The slots are the engine's
`graphgen.runtime.lora.LoraSlots` (built by `build_engine` in the runner's dtype, on its device); the lowering
is `graphgen.lower.npu_calls.lora_weight` and the helpers' ``_linear``."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ...runtime.engine import StepFuture, StepPlan


def acquire_lora(slots: Any, plan: StepPlan) -> tuple[dict[int, int], list[int]]:
    """(each row's adapter slot by row index; the slots the step holds until it is collected): the rows'
    adapters loaded on demand (LRU) into slots no running step holds, as the CPU runner does."""
    if slots is None:
        return {}, []
    adapters = [row.request.lora for row in plan.rows]
    if all(a is None for a in adapters):
        return {}, []
    got = slots.acquire(adapters)
    return {i: got[a.digest] for i, a in enumerate(adapters) if a is not None}, list(got.values())


def release_lora(slots: Any, fut: StepFuture) -> None:
    if fut.lora_slots:
        slots.release(fut.lora_slots)
        fut.lora_slots = []


def add_lora_inputs(b: Any, token_slots: Sequence[int], views: dict) -> Any:
    """``b`` (`NpuStepInputs`) with its LoRA inputs: ``token_slots`` each real token's slot (0: the base model)
    in token order (the padding tokens, appended after them, select none: an all-zero row); ``views`` the slot
    stacks by checkpoint weight (read in place: a slot a step holds is not reloaded before it is collected)."""
    a0 = next(iter(views.values()))[0]
    t = b.input_ids.shape[0]
    if len(token_slots) > t:
        raise ValueError(f"{len(token_slots)} token slots for a step of {t} tokens")
    sel = torch.zeros(t, a0.shape[0], dtype=a0.dtype)
    for i, s in enumerate(token_slots):
        if s:
            sel[i, s] = 1
    b.lora_sel, b.lora = sel.to(a0.device), views
    return b


def zero_slots(spec: Any, dtype: Optional[torch.dtype] = None) -> dict:
    """Slot stacks of ``spec``'s adapted weights with every slot zero (structure traces: no adapter loaded);
    the shapes `LoraSlots` gives them (max_loras x 2 steps in flight + the base model's slot 0)."""
    from ...lora import lora_weight_keys

    s, r = 2 * spec.lora.max_loras + 1, spec.lora.max_lora_rank
    dt = dtype or torch.float32
    return {k: (torch.zeros(s, r, i, dtype=dt), torch.zeros(s, o, r, dtype=dt))
            for k, (o, i) in lora_weight_keys(spec).items()}
