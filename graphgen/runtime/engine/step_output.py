"""What one step returns: `StepOutput`, the one object that flows back from the runner to the
scheduler (vLLM's ``ModelRunnerOutput`` with its ``KVConnectorOutput``).

``runner.collect(future)`` returns it with what the step computed and what it did with the KV saves:
each row's logits (and hidden states, for a spec with MTP layers), the `SaveReport` (the blocks it
pinned for commits, the commits that landed since) and the spans it measured. Sampling
(`graphgen.runtime.engine.sample_step`) fills the token fields of the same object (a runner that
samples on its device could fill them itself); ``Scheduler.update(plan, output)`` takes them, and the
`SaveReport` into its `SaveLedger` (over ranks: `RanksSaveReport`).

What is a tensor here: ``logits``, ``hidden`` and ``kept_logits`` rows (torch tensors, on the
host); the rest is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["SaveReport", "SaveLedger", "RanksSaveReport", "StepOutput"]


@dataclass(frozen=True)
class SaveReport:
    """The KV saves of one step, as the runner executed them (vLLM's ``KVConnectorOutput``).

    ``pinned``: the cache blocks this step pinned and handed to a commit — the forward's save, then
    the cache saves of its plan (decode-time saves and write-backs); each pin is released when its
    commit is done (inline for ``write: sync``, on the host stream for ``async``), never before.
    ``landed``: commits that finished since the previous report (their pins released). ``in_flight``:
    commits not finished when the step was collected."""

    pinned: tuple[int, ...] = ()
    landed: int = 0
    in_flight: int = 0


@dataclass
class SaveLedger:
    """What a scheduler took from its steps' `SaveReport`s (``Scheduler.update``): ``steps`` reported,
    blocks ``pinned`` for commits, commits ``landed``, and ``in_flight`` at the last report. A row's blocks
    count as saved (``RequestResult.saved_blocks``) only where the report says the runner pinned them."""
    steps: int = 0
    pinned: int = 0
    landed: int = 0
    in_flight: int = 0

    def take(self, report: "SaveReport") -> frozenset:
        """Count ``report``; the block ids it pinned."""
        self.steps += 1
        self.pinned += len(report.pinned)
        self.landed += report.landed
        self.in_flight = report.in_flight
        return frozenset(report.pinned)


@dataclass(frozen=True)
class RanksSaveReport:
    """The saves of every rank of a layout, aggregated (vLLM's ``KVConnectorWorkerMetadata.aggregate``):
    ``shards``: pool-key shard ``(owner, tp)`` -> the `SaveLedger` summed over the ranks that put it (one per
    shard in lockstep; every DP rank, each its own requests, under DP attention; a rank that leaves its puts
    to the shard's owner adds nothing: ``SaveOncePool``), ``ranks``: every rank's ledger, in rank order. What a multi-rank P role needs to say "these blocks are saved on every shard"."""
    shards: dict
    ranks: tuple

    @classmethod
    def aggregate(cls, replies) -> "RanksSaveReport":
        """From each rank's ``(ledger, shard, writes)``, in rank order."""
        shards: dict = {}
        for ledger, shard, writes in replies:
            if writes:
                got = shards.setdefault(tuple(shard), SaveLedger())
                got.steps += ledger.steps
                got.pinned += ledger.pinned
                got.landed += ledger.landed
                got.in_flight += ledger.in_flight
        return cls(shards, tuple(ledger for ledger, _, _ in replies))

    @property
    def in_flight(self) -> int:
        return sum(ledger.in_flight for ledger in self.shards.values())

    @property
    def pinned(self) -> int:
        return sum(ledger.pinned for ledger in self.shards.values())


@dataclass(frozen=True)
class StepOutput:
    """One step's results, per row of its plan (row ``i`` of ``plan.rows``).

    From the runner: ``logits[i]`` ``[len(row.logits_positions), vocab]``; ``hidden[i]``
    ``[row.num_tokens, H]`` for a spec with MTP layers (None otherwise); ``saves``; ``spans``:
    ``(what, t_start, t_end)`` the runner measured (``"forward"``). A step with no forward (a plan
    with no rows: write-backs only) has no rows and only ``saves``.

    From sampling: ``tokens[i]`` (an int, a verify row's tuple, or None for a row that samples
    nothing), ``logprobs[i]`` / ``prompt_logprobs[i]`` (None where not asked), ``kept_logits[i]``
    (``collect_logits``: the sampled rows' logits) and ``sampling_fallbacks``."""

    logits: tuple[Any, ...] = ()
    hidden: Optional[tuple[Any, ...]] = None
    saves: SaveReport = SaveReport()
    spans: tuple[tuple[str, float, float], ...] = ()
    tokens: Optional[tuple[Any, ...]] = None
    logprobs: tuple[Any, ...] = ()
    prompt_logprobs: tuple[Any, ...] = ()
    kept_logits: Optional[tuple[Any, ...]] = None
    sampling_fallbacks: int = 0
