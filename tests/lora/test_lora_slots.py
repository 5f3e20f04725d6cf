"""The LoRA device slots (graphgen.runtime.lora.slots): loaded on demand, evicted least recently used, never
overwritten while a step that reads them runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from graphgen.lora import lora_weight_keys
from graphgen.modelspec.loader import load_spec
from graphgen.runtime.lora import Adapter, LoraSlots, SlotBusyError
from graphgen.runtime.lora.delta import lora_delta

SPEC = load_spec(Path(__file__).resolve().parents[2] / "specs/tiny_qwen3_lora.yaml")  # max_loras 2, rank 8


def _adapter(name: str, r: int = 4) -> Adapter:
    g = torch.Generator().manual_seed(hash(name) % 1000)
    w = {k: (torch.randn(r, i, generator=g), torch.randn(o, r, generator=g)) for k, (o, i) in lora_weight_keys(SPEC).items()}
    return Adapter(name, name, r, 8.0, False, digest=name * 8, weights=w)


def test_slots_load_on_demand_evict_lru_and_never_a_held_one():
    slots = LoraSlots(SPEC, steps_in_flight=1)  # 2 slots
    a, b, c = _adapter("a"), _adapter("b"), _adapter("c", r=8)
    step1 = slots.acquire([a, None, b])
    assert sorted(step1.values()) == [1, 2] and slots.loads == 2
    with pytest.raises(SlotBusyError):  # both slots are held by the running step: c must wait
        slots.acquire([c])
    slots.release(step1.values())
    slots.release(slots.acquire([a]).values())  # a hit: no load; a is now the most recently used
    assert slots.loads == 2
    got = slots.acquire([c])  # evicts b, the least recently used
    assert got["c" * 8] == step1["b" * 8] and slots.slot_of("b" * 8) is None and slots.slot_of("a" * 8) == step1["a" * 8]
    key = next(iter(lora_weight_keys(SPEC)))
    A, B = slots.views()[key]
    s = got["c" * 8]
    assert torch.equal(A[s], c.weights[key][0]) and torch.equal(B[s], c.weights[key][1])
    assert not A[0].any() and not B[0].any()  # slot 0, the base model's, stays zero
    with pytest.raises(SlotBusyError, match="3 adapters in one step"):
        LoraSlots(SPEC, steps_in_flight=2).acquire([a, b, c])


def test_delta_gathers_each_rows_slot_and_pads_rank_with_exact_zeros():
    slots = LoraSlots(SPEC)
    a = _adapter("a", r=4)  # rank 4 in rank-8 slots: zero-padded
    got = slots.acquire([a])
    key = next(iter(lora_weight_keys(SPEC)))
    A, B = slots.views()[key]
    x = torch.randn(3, A.shape[2])
    index = torch.tensor([0, got["a" * 8], 0])
    d = lora_delta(x, index, A, B)
    wa, wb = a.weights[key]
    torch.testing.assert_close(d[1], (x[1] @ wa.T) @ wb.T, rtol=1e-5, atol=1e-5)
    assert not d[0].any() and not d[2].any()
