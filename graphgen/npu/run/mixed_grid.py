"""The shape grid of mixed batches on the NPU: decode rows and prefill chunks in one splitfuse graph.

A mixed step (docs/runtime.md, "Mixed batches") runs the history prefill variant with ``n_d`` decode
rows of ``k`` tokens each (``k = 1``; speculative decoding's verify rows: ``k = spec tokens + 1``)
first, then at most ``prefill_seqs`` chunk rows. Its TND graph has static shapes per **cell**
``(tokens T, decode rows D, tokens per decode row K)``:

* ``T`` tokens (the prefill token buckets), ``D + prefill_seqs + 1`` sequences (block-table rows and
  length lists; the one padding sequence after the chunks absorbs the surplus tokens), and
* ``D * K + prefill_seqs + 1`` logits rows (a verify row needs the logits of each of its K tokens).

Query and KV lengths stay values (SymInt lists), as in the plain buckets (`bucketing.py`), so any mix
that fits a cell reuses its graph: a variant compiles at most one graph per cell, and the cells are
known up front (``MixedGrid.cells``), so the count is a fixed cost, never a storm. The ``D = 0``
column is the plain prefill bucket (``Buckets.padding``): mixed cells add ``len(cells())`` graphs to
a history variant. A step is padded to the smallest cell that holds it: smallest ``D >= n_d``, ``K >=
k``, then the smallest ``T`` holding its tokens plus one token per padding sequence. Padding decode
slots are padding sequences (one token, the pad block only), like every padding sequence.

CPU stand-in only: the graph count is what GE compiles would cost; nothing here ran on an NPU.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from .inputs import StepPadding

__all__ = ["MixedCell", "MixedGrid", "MixedPadding", "MixedStep"]


@dataclass(frozen=True)
class MixedCell:
    tokens: int          # T
    decode_rows: int     # D: decode-row slots (real ones first, the rest padding sequences)
    tokens_per_row: int  # K


@dataclass(frozen=True)
class MixedPadding(StepPadding):
    """`StepPadding` with a static logits-row count: each real decode row brings K logits rows, each
    padding sequence one, so the rows are topped up to ``logits_rows`` (repeating the last index:
    rows nobody samples) — for K = 1 no top-up is ever needed."""

    logits_rows: int = 0

    def apply(self, ids, pos, slots, tables, seq_lens, qlens, logit_idx, save, bs):
        out = list(super().apply(ids, pos, slots, tables, seq_lens, qlens, logit_idx, save, bs))
        idx = out[6]
        if len(idx) > self.logits_rows:
            raise ValueError(f"{len(idx)} logits rows > the cell's {self.logits_rows}")
        out[6] = idx + [idx[-1]] * (self.logits_rows - len(idx))
        return tuple(out)


@dataclass(frozen=True)
class MixedStep:
    """One mixed step as ``(history, new tokens)`` rows: decode rows (``k`` tokens each) first, then chunks."""

    decodes: tuple[tuple[int, int], ...]
    chunks: tuple[tuple[int, int], ...]

    @property
    def seqs(self) -> list[tuple[int, int]]:
        return [*self.decodes, *self.chunks]

    @property
    def tokens_per_row(self) -> int:
        return max(q for _, q in self.decodes)


@dataclass(frozen=True)
class MixedGrid:
    tokens: tuple[int, ...]
    decode_rows: tuple[int, ...]
    tokens_per_row: tuple[int, ...] = (1,)
    prefill_seqs: int = 2
    max_blocks: int = 4
    save_rows: int = 8

    @classmethod
    def from_buckets(cls, buckets, tokens_per_row: Sequence[int] = (1,)) -> "MixedGrid":
        """The grid over a spec's buckets (a `bucketing.Buckets`): its prefill token buckets x its
        decode batch buckets x ``tokens_per_row`` (1; with speculative decoding also k + 1)."""
        return cls(tuple(buckets.prefill_tokens), tuple(buckets.decode_batch), tuple(sorted(set(tokens_per_row))),
                   buckets.prefill_seqs, buckets.max_blocks, buckets.save_rows)

    def batch(self, cell: MixedCell) -> int:
        return cell.decode_rows + self.prefill_seqs + 1

    def cells(self) -> list[MixedCell]:
        """Every cell a mixed step can be padded to: at least one token per sequence of its batch
        (K per decode slot counted at 1: a padding slot takes one token)."""
        return [MixedCell(t, d, k) for k in self.tokens_per_row for d in self.decode_rows for t in self.tokens
                if t >= d * k + self.prefill_seqs + 1]

    def count(self) -> int:
        """Graphs the mixed cells add to a history variant, at most (one per cell)."""
        return len(self.cells())

    def cell_for(self, step: MixedStep) -> MixedCell:
        n_d, n_c = len(step.decodes), len(step.chunks)
        if not 1 <= n_c <= self.prefill_seqs or n_d < 1:
            raise ValueError(f"a mixed step has 1..{self.prefill_seqs} chunk rows and >= 1 decode row "
                             f"(got {n_c} and {n_d})")
        d = next((x for x in self.decode_rows if x >= n_d), None)
        k = next((x for x in self.tokens_per_row if x >= step.tokens_per_row), None)
        if d is None or k is None:
            raise ValueError(f"{n_d} decode rows of {step.tokens_per_row} tokens exceed the grid "
                             f"(decode rows {self.decode_rows}, tokens per row {self.tokens_per_row})")
        real = sum(q for _, q in step.seqs)
        need = real + (d + self.prefill_seqs + 1) - (n_d + n_c)  # one token per padding sequence
        t = next((x for x in self.tokens if x >= need), None)
        if t is None:
            raise ValueError(f"a mixed step of {real} tokens (+{need - real} padding) exceeds the largest "
                             f"token bucket {self.tokens[-1]}")
        return MixedCell(t, d, k)

    def padding(self, step: MixedStep, pad_block: int) -> MixedPadding:
        """``step`` padded to its cell; padding rows write and read only ``pad_block`` (`bucketing.PAD_BLOCK`)."""
        cell = self.cell_for(step)
        return MixedPadding(self.batch(cell), cell.tokens, self.max_blocks, pad_block, self.save_rows,
                            logits_rows=cell.decode_rows * cell.tokens_per_row + self.prefill_seqs + 1)

    def cell_steps(self, block_size: int) -> list[MixedStep]:
        """One deterministic step per cell, in ``cells()`` order, padded to exactly that cell (what
        warm-up compiles): ``D`` decode rows of ``K`` tokens and ``prefill_seqs`` chunks sharing the
        cell's other tokens but the one its padding sequence takes, every history crossing a block
        boundary (as `bucketing.bucket_steps`)."""
        cap, n = self.max_blocks * block_size, self.prefill_seqs
        out = []
        for cell in self.cells():
            k = cell.tokens_per_row
            real = cell.tokens - cell.decode_rows * k - 1
            qs = [real // n + (1 if i < real % n else 0) for i in range(n)]
            hist, dec = min(block_size + 1, cap - max(qs)), min(block_size + 1, cap - k)
            if hist < 0 or dec < 0:
                raise ValueError(f"cell {cell}: its rows cannot fit within {cap} positions")
            step = MixedStep(tuple((dec, k) for _ in range(cell.decode_rows)), tuple((hist, q) for q in qs))
            assert self.cell_for(step) == cell, (cell, step)
            out.append(step)
        return out

    def steps(self, n: int, block_size: int, seed: int = 0) -> list[MixedStep]:
        """``n`` random mixed steps that fit the grid: a varying number of decode rows (growing
        lengths, as decoding does) and 1..prefill_seqs chunks over a varying history."""
        rnd = random.Random(seed)
        cap = self.max_blocks * block_size
        hist = [rnd.randrange(1, cap // 2) for _ in range(self.decode_rows[-1])]
        out = []
        for _ in range(n):
            k = rnd.choice(self.tokens_per_row)
            n_d = rnd.randint(1, self.decode_rows[-1])
            hist = [h + 1 if h + k + 1 < cap else 1 for h in hist]
            decodes = tuple((h, k) for h in hist[:n_d])
            n_c = rnd.randint(1, self.prefill_seqs)
            room = self.tokens[-1] - n_d * k - (self.decode_rows[-1] - n_d) - (self.prefill_seqs + 1 - n_c)
            chunks = []
            for _ in range(n_c):
                q = rnd.randint(1, max(1, min(cap // 2, room // n_c)))
                chunks.append((rnd.randrange(0, cap - q), q))
            out.append(MixedStep(decodes, tuple(chunks)))
        return out
