"""Context parallel on the NPU runner: a prefill step's head-tail pieces as graph calls of one bucket on every
CP rank (``--target npu --cp N``; docs/npu.md, "Sequence and context parallel on the NPU runner").

The CPU ranks' split (`graphgen.runtime.parallel.context_parallel`: CP rank ``i`` computes chunks ``i`` and
``2cp - 1 - i`` of each row's ``2 × cp`` chunks, each piece one attention row over the row's block table
whose ``seq_len`` is the piece's end) is a pure function of the plan (`cp_pieces`); this module turns it into
the NPU runner's graph calls. What differs from the CPU ranks is the KV gather: before each prefill layer's KV
write the NPU graph all-gathers the KV parts over group ``cp`` with ``all_gather_into_tensor``, which takes
the same number of rows from every rank. So:

* **one bucket per call on every CP rank**: a call holds whole rows (every piece of each of its rows, on
  every rank: after the call every rank's cache holds those rows' whole KV, so the call may save their
  blocks), at most ``prefill_seqs`` pieces and the largest token bucket on each rank; every rank pads its
  pieces to the bucket of the rank that needs the largest (`Buckets.padding(..., at_least=)`), which it
  knows without a collective (every rank plans the same steps: the plan check);
* **the gathered slots**: the gather returns every rank's padded tokens, rank-major, so the call's
  ``kv_index`` lists the slots in that order (each rank's padded slot list; padding rows write the pad
  block), the same tensor on every rank — the CPU ranks' ``slot_mapping`` contract;
* **the logits**: a rank has the logits rows of the pieces holding a row's last token (chunk ``2cp - 1``: CP
  rank 0's), which `ContextSplit.reduce_logits` scatters into the step's rows and all-reduces over the CP
  group, so every rank samples the same tokens;
* saves and loads are a call's rows' (every rank loads; only CP rank 0 puts: `SaveOncePool`).

Decode runs unsplit and replicated, as on the CPU ranks. A row's two pieces are two sequences of a call, so
``prefill_seqs`` must be at least 2. The real-device path (HCCL's gather in a GE graph) never ran.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime.engine import StepPlan
from ...runtime.parallel.context_parallel import cp_pieces
from .bucketing import Buckets
from .inputs import StepPadding

__all__ = ["CpCall", "cp_calls"]


@dataclass(frozen=True)
class CpCall:
    """One graph call of a CP prefill step: ``rows`` (plan row indices, in order), ``pieces[r]`` (CP rank ``r``'s
    ``(row, lo, hi)`` pieces of them, in row order), ``pad`` (the bucket every rank pads to)."""
    rows: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    pad: StepPadding

    def gathered_kv_index(self, sequences, block_size: int) -> torch.Tensor:
        """``[cp × T, 2]`` (block, offset) of the gathered rows: every rank's padded slots, rank-major
        (``sequences(pieces)``: the runner's sequences of one rank's pieces)."""
        slots: list = []
        for mine in self.pieces:
            seqs = sequences(mine)
            ids = [t for s in seqs for t in s["ids"]]
            padded = self.pad.apply(ids, [p for s in seqs for p in s["pos"]], [x for s in seqs for x in s["slots"]],
                                    [s["table"] for s in seqs], [s["seq_len"] for s in seqs],
                                    [len(s["ids"]) for s in seqs], [0] * len(seqs), None, block_size)
            slots += padded[2]
        t = torch.as_tensor(slots, dtype=torch.int64)
        return torch.stack((t // block_size, t % block_size), dim=-1)


def cp_calls(plan: StepPlan, cp: int, buckets: Buckets, phase: str, pad_block: int) -> list[CpCall]:
    """The graph calls of the prefill step ``plan`` over ``cp`` CP ranks (module doc): rows in order, as many
    per call as every rank's pieces fit (``prefill_seqs`` sequences, the largest token bucket)."""
    if buckets.prefill_seqs < 2:
        raise ValueError(f"context parallel on the NPU runs a row's two head-tail pieces as two sequences of a call: "
                         f"targets.npu.prefill_seqs must be at least 2 (it is {buckets.prefill_seqs})")
    every = cp_pieces(plan, cp)  # [rank][row] -> [(lo, hi), ...]
    batch, top = buckets.prefill_seqs + 1, buckets.prefill_tokens[-1]

    def need(rows) -> list[tuple[int, int]]:  # each rank's (sequences, tokens + one per padding sequence)
        out = []
        for mine in every:
            n = sum(len(mine[i]) for i in rows)
            out.append((n, sum(hi - lo for i in rows for lo, hi in mine[i]) + batch - n))
        return out

    def fits(rows) -> bool:
        return all(n <= buckets.prefill_seqs and t <= top for n, t in need(rows))

    groups: list[list[int]] = []
    for i, row in enumerate(plan.rows):
        if not fits([i]):
            raise ValueError(f"a prefill row of {row.num_tokens} tokens does not fit one call of the largest prefill "
                             f"bucket ({top} tokens) on every CP rank; lower max_num_batched_tokens")
        if groups and fits(groups[-1] + [i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    calls = []
    for rows in groups:
        pad = buckets.padding(phase, 0, 0, pad_block, at_least=max(t for _, t in need(rows)))  # the largest rank's
        calls.append(CpCall(tuple(rows), tuple(tuple((i, lo, hi) for i in rows for lo, hi in mine[i])
                                               for mine in every), pad))
    return calls
