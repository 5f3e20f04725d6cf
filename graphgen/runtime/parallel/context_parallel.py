"""Context parallel (``parallel.cp``): the head-tail split of a prefill step over the CP ranks, as a
rank feature (`ContextSplit`, applied by `graphgen.runtime.parallel.features.RankRunner`), the per-layer
KV all-gather, and replicated KV saved by CP rank 0 only.

The graphs are `graphgen.passes.context_parallel`'s: every prefill variant (each chunk of a chunked
prefill too) all-gathers each layer's KV parts over group ``cp`` before its ``kv_write``; the decode
graph is the single-group one. What this module adds is the runner side of that contract:

* **the split** (`head_tail_pieces`): each prefill row's ``n`` new tokens are cut into ``2 × cp``
  chunks (sizes differ by at most one) and CP rank ``i`` computes chunks ``i`` and ``2cp - 1 - i``,
  so every rank gets the same causal work. Its step inputs (`cp_step_inputs`) hold only its tokens
  and positions; each of its pieces is one attention row over the request's block table whose
  ``seq_len`` is the piece's end (so ``attend``'s "queries sit at the last positions" is the causal
  mask of the split: a piece sees the history, the earlier pieces of every rank and itself, causally);
* **the gather** (`CollectiveRuntime.all_gather` on group ``cp``, its counts given by `ContextSplit`): ranks may hold different token counts (a prompt
  that ``2 × cp`` does not divide, a decode row of a mixed batch: one token, on rank 0), so each
  rank pads its part to the step's largest, gathers, and keeps every rank's real rows, in rank order.
  The ``slot_mapping`` lists every rank's slots in that order, the same tensor on every rank, so
  every CP rank writes the whole step's KV into its own cache;
* **the logits**: a rank has the LM-head rows of the sampled positions it computed (the last token
  of a prompt is in chunk ``2cp - 1``: rank 0's); `ContextSplit` scatters them into the step's
  full ``[rows, vocab]`` logits, zero elsewhere, and all-reduces (a sum with zeros: exact), so every
  rank samples from the same logits and the schedulers stay in lockstep;
* **decode** runs unsplit and replicated (every rank the same inputs), as the graph is — the verify rows of
  speculative decoding too (a verify row in a mixed prefill step is split like the step's other rows);
* **MTP** (``--speculative mtp``): the target's hidden states are gathered back into the step's token order
  after each split step (`ContextSplit.gather_hidden`), so every rank's drafter holds a request's hidden states
  as one rank's would; each draft run (a plan with ``prev_hidden``: the prompt's positions after its prefill,
  a request's verified positions after a verify, one row per recursive draft) is split head-tail like a
  prefill — row t holds token t+1, which every rank knows, so the shift crosses piece boundaries with no
  exchange — each rank taking the previous hidden states of its own tokens; the MTP graph all-gathers its
  layer's KV over cp before its ``kv_write`` (as the decoder layers'), its logits are reduced and its hidden
  states gathered as the target's, and its save (the prompt's blocks, successor-keyed) is CP rank 0's;
* **pool**: KV is the same on every CP rank, so keys are those of one group (no CP rank in them:
  ``r0of1`` at tp = 1) and only CP rank 0 puts (the graph's ``writers=cp0``; `SaveOncePool` on the others);
  every rank looks up and loads, hits agreed by MIN (`RankLoader`), commits made visible to all
  before the next lookup (`RankConnector`'s drain barrier): `graphgen.runtime.parallel.rank_kv`.

**cp × tp**: world rank ``cp_rank × tp + tp_rank`` (TP innermost); the layout's table gives each rank its
TP group and its CP group (`graphgen.runtime.parallel.layout`); its weights, KV heads and keys
``r{owner}of{tp}`` are its TP rank's (as at cp = 1), and only CP rank 0 of each TP rank's column puts.

The split is a function of the plan alone (`cp_pieces`), so another target's runner takes it too: the NPU
runner's ``split`` seam pads each CP rank's pieces to one bucket per call (its gather is an equal-shard
``all_gather_into_tensor``) and reduces the logits with `ContextSplit.reduce_logits`
(`graphgen.npu.run.context_parallel`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..core.kvcache import slot_mapping
from ..engine.request import StepPlan
from ..engine.runner import StepInputs
from .collectives import gather_rows

__all__ = ["head_tail_pieces", "cp_pieces", "CpStepInputs", "CpMtpInputs", "cp_step_inputs", "ContextSplit"]

CP_GROUP = "cp"  # the IR's group name (graphgen.passes.context_parallel.CP_GROUP)


def head_tail_pieces(n: int, cp: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[lo, hi)`` token ranges of ``n`` that CP rank ``cp_rank`` of ``cp`` computes: chunks
    ``cp_rank`` and ``2cp - 1 - cp_rank`` of ``2cp`` chunks whose sizes differ by at most one (the
    first ``n mod 2cp`` one longer). Either may be empty (``n < 2cp``)."""
    parts = 2 * cp
    base, extra = divmod(n, parts)
    bounds = [0]
    for j in range(parts):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    head, tail = cp_rank, parts - 1 - cp_rank
    return (bounds[head], bounds[head + 1]), (bounds[tail], bounds[tail + 1])


@dataclass
class CpStepInputs(StepInputs):
    """A CP rank's inputs of one prefill step: `StepInputs` over its own tokens (attention rows =
    its pieces), plus ``cp_counts`` (every rank's token count: the gather's shapes), ``logits_rows``
    (the row of the step's full logits each of its local logits fills) and ``num_logits``."""

    cp_counts: tuple[int, ...] = ()
    logits_rows: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    num_logits: int = 0
    # the plan-order index (over the step's tokens, row by row) of every gathered token, rank 0's first:
    # where each rank's hidden states go once gathered, and which previous hidden states a draft run reads
    order: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def mine(self, cp_rank: int) -> torch.Tensor:
        """The plan-order indices of this rank's tokens (its slice of ``order``)."""
        first = sum(self.cp_counts[:cp_rank])
        return self.order[first:first + self.cp_counts[cp_rank]]


@dataclass
class CpMtpInputs(CpStepInputs):
    """A CP rank's share of an MTP draft run: `CpStepInputs` plus the previous hidden states of its tokens
    (row t of a draft run holds token t+1 and the hidden state at t: both known to every rank, so the split
    is the prefill's, shifted by nothing but the plan's token ids)."""

    prev_hidden: Optional[torch.Tensor] = None


def cp_pieces(plan: StepPlan, cp: int) -> list[list[list[tuple[int, int]]]]:
    """``pieces[r][i]``: the non-empty ``[lo, hi)`` token ranges of row ``i`` of ``plan`` that CP rank ``r`` computes
    (`head_tail_pieces`), for every rank: a pure function of the plan, so every rank knows every rank's share (the
    gather's order and counts; the NPU runner's one bucket per call, `graphgen.npu.run.context_parallel`)."""
    return [[[p for p in head_tail_pieces(row.num_tokens, cp, r) if p[1] > p[0]] for row in plan.rows]
            for r in range(cp)]


def cp_step_inputs(plan: StepPlan, block_size: int, cp_rank: int, cp: int) -> CpStepInputs:
    """CP rank ``cp_rank``'s inputs for the prefill step ``plan`` (the same plan on every rank)."""
    long = torch.long
    pieces = cp_pieces(plan, cp)
    # the gathered order: rank 0's tokens, then rank 1's, ...; each rank's row by row, piece by piece
    slots = [slot_mapping(row.block_table, row.start + lo, row.start + hi, block_size)
             for mine in pieces for row, ps in zip(plan.rows, mine) for lo, hi in ps]
    firsts = [sum(r.num_tokens for r in plan.rows[:i]) for i in range(len(plan.rows))]
    order = [firsts[i] + t for mine in pieces for i, ps in enumerate(mine) for lo, hi in ps for t in range(lo, hi)]
    ids, pos, tables, seq_lens, query_lens, logit_idx, logit_rows = [], [], [], [], [], [], []
    offset, first_logit = 0, 0
    for row, ps in zip(plan.rows, pieces[cp_rank]):
        for lo, hi in ps:
            ids.extend(row.token_ids[lo:hi])
            pos.extend(range(row.start + lo, row.start + hi))
            tables.append(row.block_table)
            seq_lens.append(row.start + hi)   # the piece's causal mask: everything before its end
            query_lens.append(hi - lo)
            for j, p in enumerate(row.logits_positions):
                if lo <= p < hi:
                    logit_idx.append(offset + p - lo)
                    logit_rows.append(first_logit + j)
            offset += hi - lo
        first_logit += len(row.logits_positions)
    width = max(len(r.block_table) for r in plan.rows)
    block_tables = torch.zeros((len(tables), width), dtype=long)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t, dtype=long)
    return CpStepInputs(
        input_ids=torch.tensor(ids, dtype=long), positions=torch.tensor(pos, dtype=long),
        slot_mapping=torch.cat(slots) if slots else torch.zeros(0, dtype=long), block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=long), query_lens=torch.tensor(query_lens, dtype=long),
        logits_indices=torch.tensor(logit_idx, dtype=long),
        save_block_ids=torch.tensor(plan.save_block_ids, dtype=long),
        load_block_ids=torch.tensor(plan.load_block_ids, dtype=long),
        cp_counts=tuple(sum(hi - lo for ps in mine for lo, hi in ps) for mine in pieces),
        logits_rows=torch.tensor(logit_rows, dtype=long), num_logits=first_logit,
        order=torch.tensor(order, dtype=long))


class ContextSplit:
    """The CP rank feature (`graphgen.runtime.parallel.features`): CP rank ``cp_rank`` of ``cp`` builds only
    its share of each prefill step (`cp_step_inputs`; decode runs unsplit and replicated), tells the
    runtime the step's rows per CP rank (the KV gather's counts), and after the forward scatters its
    logits rows into the step's full logits and all-reduces them over the CP group (the others add
    zeros: exact), so every rank samples from the same logits. It plugs into the runner's ``split``
    seam (`graphgen.runtime.engine.runner.CpuModelRunner`, and the NPU runner's, which builds its own padded
    inputs from `cp_pieces` and calls `reduce_logits`: `graphgen.npu.run.context_parallel`); a runner without one
    has no CP."""
    name = "cp"

    def __init__(self, cp_rank: int, cp: int):
        self.cp_rank, self.cp = cp_rank, cp
        self.rt: Any = None  # the CPU runner's CollectiveRuntime, once attached (None on the NPU runner)
        self.group: Any = None  # the CP process group (the logits reduce)

    def attach(self, runner) -> None:
        if not hasattr(runner, "split"):
            raise ValueError(f"{type(runner).__name__} has no step split: context parallel does not run on it")
        runner.split, self.rt = self, getattr(runner, "rt", None)
        self.group = (self.rt.groups if self.rt is not None else runner.groups)[CP_GROUP]

    def reduce_logits(self, local, rows, num_logits: int):
        """The step's full ``[num_logits, vocab]`` logits from this rank's ``local`` rows (row ``rows[j]`` of the
        full logits is ``local[j]``; zeros elsewhere), summed over the CP group: every rank gets every row (the
        ranks' rows are disjoint, so the sum with zeros is exact)."""
        full = local.new_zeros((num_logits, local.shape[-1]))
        full[rows] = local
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group)
        return full

    def before_forward(self, plan: StepPlan) -> None:
        pass

    def step_inputs(self, plan: StepPlan, block_size: int) -> Optional[StepInputs]:
        """This rank's inputs of ``plan`` (None: a decode step, whole on every rank). An MTP draft run (a plan
        with ``prev_hidden``) is split as a prefill is, each rank taking the previous hidden states of its own
        tokens: its graph gathers the MTP layer's KV over cp (`graphgen.passes.context_parallel`)."""
        if plan.prev_hidden is not None:
            share = cp_step_inputs(plan, block_size, self.cp_rank, self.cp)
            return CpMtpInputs(**{f.name: getattr(share, f.name) for f in dataclasses.fields(share)},
                               prev_hidden=plan.prev_hidden[share.mine(self.cp_rank)])
        if plan.phase == "decode":
            return None
        return cp_step_inputs(plan, block_size, self.cp_rank, self.cp)

    def gather_hidden(self, local: torch.Tensor, inputs: CpStepInputs) -> torch.Tensor:
        """The step's hidden states ``[tokens, H]`` in plan order from this rank's ``local`` rows (its tokens, in
        its pieces' order): one counts-padded gather over the CP group, then each rank's rows put back where
        its pieces lie, so the drafter keeps a request's hidden states as one rank would."""
        gathered = gather_rows(local, inputs.cp_counts, self.cp_rank, self.group)
        full = gathered.new_empty(gathered.shape)
        full[inputs.order] = gathered
        return full

    def execute(self, run: Callable, variant: str, inputs, staging=None, loads=()):
        """``run(variant, inputs, staging, loads)`` (the runner's own forward) around the CP share."""
        if not isinstance(inputs, CpStepInputs):
            return run(variant, inputs, staging, loads)
        self.rt.set_rows(CP_GROUP, inputs.cp_counts)  # the CP gather's rows per rank (CollectiveRuntime)
        handles = run(variant, inputs, staging, loads)
        # whole-vocabulary rows (at tp > 1 the LM head gathered them); the hidden states (a spec with MTP
        # layers: what the draft runs read) gathered back into the step's token order
        hidden = None if handles.hidden is None else self.gather_hidden(handles.hidden, inputs)
        return dataclasses.replace(handles, logits=self.reduce_logits(handles.logits, inputs.logits_rows,
                                                                      inputs.num_logits), hidden=hidden)
