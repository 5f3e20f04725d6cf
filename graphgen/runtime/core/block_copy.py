"""Copies of whole KV blocks between a staging and the paged cache: the graph's ``kv_load`` (a load
staging's rows into the cache blocks a prefill's loaded history goes to) and ``kv_save`` (the cache
blocks a step completed into a save staging's rows). Runs of consecutive block ids are slice copies."""
from __future__ import annotations

from typing import Sequence

import torch

from .attention import StepMemo

__all__ = ["block_id_runs", "copy_into_blocks", "copy_from_blocks"]

# a run of at least this many consecutive block ids is copied as one slice; shorter runs go
# together through one index_copy_ (a slice copy costs one torch call, ~3 us; index_copy_ ~1.6 us
# per 8 KiB block at the cache's size: two blocks already pay for the call)
_MIN_SLICE_RUN = 2


def block_id_runs(block_ids: Sequence[int]) -> tuple[list[tuple[int, int, int]], list[int]]:
    """``block_ids`` (distinct) split into runs of consecutive ids: ``(position in block_ids, first
    id, length)`` per run of at least ``_MIN_SLICE_RUN`` ids, and the positions of the others."""
    runs, rest, lo, n = [], [], 0, len(block_ids)
    for i in range(1, n + 1):
        if i == n or block_ids[i] != block_ids[i - 1] + 1:
            if i - lo >= _MIN_SLICE_RUN:
                runs.append((lo, block_ids[lo], i - lo))
            else:
                rest.extend(range(lo, i))
            lo = i
    return runs, rest


# every layer's kv_load (kv_save) of a step gets the same block_ids tensor: its runs are found once
_load_runs, _save_runs = StepMemo(), StepMemo()


def _runs_of(block_ids: torch.Tensor) -> tuple[list, list]:
    return block_id_runs(block_ids.tolist())


def copy_into_blocks(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    """``dst[c][block_ids[j]] = src[c][j]`` for every component ``c`` and j (a layer's loaded
    history into its cache blocks: the graph's ``kv_load``). ``block_ids`` are distinct. A fresh
    allocation is mostly runs of consecutive ids (the FIFO allocator), and a run is one slice copy,
    at memcpy speed; ``index_copy_`` (the scattered rest) is ~2x slower per block (issue 17 (a):
    6.3 -> 2.4 ms as rows, 1.2 ms as runs, 12 MiB of a 2048-token hit)."""
    n = block_ids.shape[0]
    if n == 0:
        return
    runs, rest = _load_runs.get(_runs_of, block_ids)
    rest_ids = block_ids[rest].long() if runs else block_ids.long()
    for c, s in zip(dst, src):
        if s.shape[0] < n:
            raise ValueError(f"kv_load: load staging holds {s.shape[0]} blocks, {n} requested")
        for at, first, length in runs:
            c[first:first + length].copy_(s[at:at + length])
        if not rest:
            continue
        # the scattered rows: all of them in place, or (mixed with runs) gathered once, a copy of
        # those rows only
        part = s[rest] if runs else s[:n]
        if c.is_contiguous():
            # one row per block: index_copy_ from a 4-d source is an elementwise loop (~3x slower on
            # the CPU than the same copy as [n, block elements] rows)
            c.view(c.shape[0], -1).index_copy_(0, rest_ids, part.reshape(len(rest), -1))
        else:
            c.index_copy_(0, rest_ids, part)


def copy_from_blocks(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    """``dst[c][j] = src[c][block_ids[j]]`` for every component ``c`` and j (a layer's cache blocks into
    its save staging: the graph's ``kv_save``). The blocks a chunk completes are mostly one run (the
    FIFO allocator): a run is one slice copy, where ``index_select`` + ``copy_`` copied every block twice."""
    n = block_ids.shape[0]
    runs, rest = _save_runs.get(_runs_of, block_ids)
    for s, c in zip(dst, src):
        if s.shape[0] < n:
            raise ValueError(f"kv_save: staging holds {s.shape[0]} blocks, {n} requested")
        for at, first, length in runs:
            s[at:at + length].copy_(c[first:first + length])
        if rest:
            gathered = c.index_select(0, block_ids[rest].long() if runs else block_ids.long())
            if runs:
                s[rest] = gathered
            else:
                s[:n].copy_(gathered)
