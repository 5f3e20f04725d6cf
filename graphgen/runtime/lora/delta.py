"""The batched LoRA delta of the CPU target: a projection's weight wrapped with its adapter slots and each
token's slot (``rt.lora(W, b.lora_index, b.lora[key], ...)`` in a generated module), so that the runtime ops'
products (`graphgen.runtime.core.matmul`) add ``delta = (x A_s^T) B_s^T`` per token -- each row's slot gathered,
then the shrink and expand products (vLLM's and vllm-ascend's sgmv: per slot, over its rows). Slot 0 is all zeros (a base-model
token), so one batch mixes base requests and several adapters. PEFT's order of operations: the base product,
then ``lora_B(lora_A(x)) * scaling`` added (the scaling is folded into B when the adapter is read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

Tensor = torch.Tensor

__all__ = ["LoraWeight", "lora", "lora_delta"]


@dataclass(frozen=True)
class LoraWeight:
    """A linear layer's weight (``base``: a tensor or an `Int8Weight`, in the layout its product expects) whose
    output columns ``[offset, offset + B.shape[1])`` get each segment's delta. ``segments``: (offset, A slots
    ``[S, R, in]``, B slots ``[S, out, R]``); ``index``: each token's slot ``[T]`` (int64)."""

    base: Any
    index: Tensor
    segments: tuple[tuple[int, Tensor, Tensor], ...]

    @property
    def shape(self):
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype


def lora_delta(x: Tensor, index: Tensor, a: Tensor, b: Tensor,
               slot_rows: Optional[list[tuple[int, Tensor]]] = None) -> Tensor:
    """``[T, out]``: token t's ``x[t] A[index[t]]^T B[index[t]]^T`` (shrink to the rank, then expand), zero for
    slot 0. Computed per slot over its tokens (the rows of one adapter are gathered, shrunk and expanded as two
    plain matmuls: vLLM's sgmv; on the CPU the host knows the slots, so no [T, R, in] gather of the stacks is
    made, which per token -- bgmv -- costs more than the products here). ``slot_rows``: `_slot_rows(index)`,
    when the caller already has it (one projection's segments share it)."""
    if index.shape[0] != x.shape[0]:
        raise ValueError(f"lora: {index.shape[0]} token slots for {x.shape[0]} rows")
    out = x.new_zeros(x.shape[0], b.shape[1])
    for s, rows in _slot_rows(index) if slot_rows is None else slot_rows:
        xs = x.index_select(0, rows)
        out.index_copy_(0, rows, (xs @ a[s].t().to(x.dtype)) @ b[s].t().to(x.dtype))  # shrink, then expand
    return out


def _slot_rows(index: Tensor) -> list[tuple[int, Tensor]]:
    """Each adapter slot of the step (slot 0, the base model's, left out) with its token rows."""
    return [(s, (index == s).nonzero().squeeze(1)) for s in torch.unique(index).tolist() if s != 0]


def apply(x: Tensor, w: LoraWeight, product) -> Tensor:
    y = product(x, w.base)
    slot_rows = _slot_rows(w.index)  # once per projection, not once per segment
    if not slot_rows:  # a batch of base-model tokens only: the base product as it is
        return y
    for offset, a, b in w.segments:
        y[:, offset:offset + b.shape[1]] += lora_delta(x, w.index, a, b, slot_rows)
    return y


def lora(base: Any, index: Optional[Tensor], segments: Sequence[tuple[int, Optional[tuple[Tensor, Tensor]]]]) -> Any:
    """``rt.lora(W[...], b.lora_index, ((offset, b.lora[key]), ...))``: ``base`` wrapped with the slots of its
    adapted output segments; ``base`` itself when the step has no adapter (``index`` None)."""
    if index is None:
        return base
    segs = tuple((int(off), ab[0], ab[1]) for off, ab in segments if ab is not None)
    return LoraWeight(base, index, segs) if segs else base
