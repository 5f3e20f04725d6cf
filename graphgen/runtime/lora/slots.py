"""Device slots for LoRA adapters: loaded on demand, evicted least recently used, never while a step reads them.

One ``[S + 1, max_lora_rank, in]`` A stack and ``[S + 1, out, max_lora_rank]`` B stack per adapted projection, with
S = max_loras x the steps in flight (2: async scheduling plans one step while the previous one runs; the scheduler
keeps each step within max_loras adapters, so a step's adapters always find slots) (`graphgen.lora.lora_weight_keys`); slot 0 stays zero (base-model tokens), an adapter of rank
r < max_lora_rank is zero-padded (the padded products add exact zeros). A step ``acquire``s its adapters --
each already in a slot, else loaded into a free slot or into the least recently used one no step holds -- and
``release``s them when its outputs are read: that is the run-time half of the race proof (the graphs only read
the ``lora_slots`` buffers; the ``insert_lora`` pass proves nothing in a graph writes them), so a slot is not
overwritten while a step that reads it runs (`SlotBusyError` otherwise, never a silent overwrite).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable, Optional

import torch

from ...lora import lora_weight_keys

if TYPE_CHECKING:
    from ...modelspec.model import ModelSpec
    from .peft import Adapter

__all__ = ["LoraSlots", "SlotBusyError"]


class SlotBusyError(RuntimeError):
    """More distinct adapters than free or evictable slots for one step (the scheduler keeps a step within
    ``max_loras``; this is the guard, not the policy)."""


class LoraSlots:
    def __init__(self, spec: "ModelSpec", dtype: torch.dtype = torch.float32, steps_in_flight: int = 2,
                 device: Optional[torch.device] = None):
        assert spec.lora is not None
        self.per_step, self.rank = spec.lora.max_loras, spec.lora.max_lora_rank
        self.max_loras = self.per_step * steps_in_flight  # slots
        S, R = self.max_loras + 1, self.rank
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
            key: (torch.zeros(S, R, i, dtype=dtype, device=device), torch.zeros(S, o, R, dtype=dtype, device=device))
            for key, (o, i) in lora_weight_keys(spec).items()}
        self._slot_of: "OrderedDict[str, int]" = OrderedDict()  # digest -> slot, least recently used first
        self._pins: dict[int, int] = {}  # slot -> steps holding it
        self.loads = 0  # adapters copied into a slot (a hit costs none)

    def slot_of(self, digest: str) -> Optional[int]:
        return self._slot_of.get(digest)

    def _free_slot(self) -> int:
        used = set(self._slot_of.values())
        for s in range(1, self.max_loras + 1):
            if s not in used:
                return s
        for digest, s in self._slot_of.items():  # LRU order
            if not self._pins.get(s):
                del self._slot_of[digest]
                return s
        raise SlotBusyError(f"all {self.max_loras} LoRA slots are held by running steps")

    def _load(self, adapter: "Adapter", slot: int) -> None:
        if self._pins.get(slot):
            raise SlotBusyError(f"LoRA slot {slot} is read by a running step")  # _free_slot never picks one
        for key, (A, B) in self.stacks.items():
            A[slot].zero_()
            B[slot].zero_()
            ab = adapter.weights.get(key)
            if ab is not None:
                a, b = ab
                A[slot, :a.shape[0]].copy_(a)
                B[slot, :, :b.shape[1]].copy_(b)
        self.loads += 1

    def acquire(self, adapters: Iterable[Optional["Adapter"]]) -> dict[str, int]:
        """Slots of the step's adapters (digest -> slot; None: the base model, slot 0), each pinned until
        `release`; SlotBusyError when they do not fit (nothing pinned then)."""
        want: dict[str, "Adapter"] = {}
        for a in adapters:
            if a is not None:
                want.setdefault(a.digest, a)
        if len(want) > self.per_step:
            raise SlotBusyError(f"{len(want)} adapters in one step, max_loras is {self.per_step}")
        got: dict[str, int] = {}
        try:
            for digest in want:  # pin the resident ones first: loading the others must not evict them
                s = self._slot_of.get(digest)
                if s is not None:
                    self._pin(s)
                    got[digest] = s
                    self._slot_of.move_to_end(digest)
            for digest, adapter in want.items():
                if digest in got:
                    continue
                s = self._free_slot()
                self._load(adapter, s)
                self._slot_of[digest] = s
                self._pin(s)
                got[digest] = s
        except SlotBusyError:
            self.release(got.values())
            raise
        return got

    def _pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def release(self, slots: Iterable[int]) -> None:
        for s in slots:
            n = self._pins.get(s, 0) - 1
            if n < 0:
                raise RuntimeError(f"LoRA slot {s} released more often than acquired")
            if n:
                self._pins[s] = n
            else:
                self._pins.pop(s, None)

    def views(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """What a generated module reads as ``b.lora[key]``."""
        return self.stacks
