"""DP attention on the NPU runner: every DP rank's MoE collectives pair up, at one token count.

The CPU DP ranks (`graphgen.runtime.parallel.dp_rank`) pair their forwards with a handshake and let each
group's step keep its own token count (the gather pads at run time). An NPU graph has static shapes (one
per bucket), and the MoE's DP ``all_gather_into_tensor`` takes the same number of rows from every rank,
so every DP rank must run each graph call **at the same padded token count**, as vllm-ascend pads every
DP rank to the largest one's tokens (``num_tokens_across_dp``). Per graph call, `NpuDPSync.round`
all-gathers each rank's intent ``(kind, tokens)`` (kind 1: a decode bucket, T = its batch; 2: a prefill
bucket, T = its tokens; 3: a draft run of the MTP layer's graph (speculative decoding, docs/mtp.md), in the
prefill buckets, T = its tokens; ``VERIFY - 2 + r`` (r >= 2): a decode bucket of verify rows of r tokens
each, T = batch × r; ``(0, 0)``: nothing to run) on the host-side gloo group:

* every rank idle: the tick is over (`serve_others` returns);
* else the kind of the lowest DP rank with an intent goes, at the largest T asked for that kind (a bucket
  of that kind: each intent is one): a rank whose intent is of that kind runs its call padded to T
  (`agree_padding`); every other rank runs a **dummy call** of that kind at T (`dummy_forward`: the
  kind's graph on padding rows only, in the reserved pad block, as a warm-up step — its experts still
  process the other ranks' gathered tokens) and, if it had an intent, offers it again next round.

So calls of one kind run together (all the DP ranks' decodes in one round), and a prefill on one rank
costs the decoding ranks one dummy prefill. `NpuDPForward` is the runtime's `DPForward` protocol (as the
CPU's `CpuDPForward`), so the runtime's DP commands (`dp_tick`, `dp_generate`) drive the NPU ranks unchanged;
`graphgen.runtime.parallel.rank.build_rank` picks it (`register_rank_target(..., dp_forward=NpuDPForward)`). Mixed batches run through the prefill buckets (no mixed-grid cell: its shapes are not
one of the kinds); so under speculative decoding the DP ranks' engines run no mixed steps (`npu_engine`:
chunked prefill off), as verify rows need a decode call or a mixed cell.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ...runtime import current_progress
from .warmup import pad_sequence

__all__ = ["NpuDPSync", "NpuDPForward", "agree_padding", "dummy_forward", "DECODE", "PREFILL", "DRAFT", "VERIFY"]

DECODE, PREFILL, DRAFT, VERIFY = 1, 2, 3, 4  # VERIFY - 2 + r: verify rows of r >= 2 tokens (module doc)


class NpuDPSync:
    """The per-graph-call agreement over the DP ranks (every rank of the world; ``group``: a gloo group, None:
    the world's when it is gloo). Every rank calls the same rounds in the same order."""

    def __init__(self, group=None):
        self.group = group

    def round(self, intent: tuple[int, int] = (0, 0)) -> Optional[tuple[int, int]]:
        """``(kind, tokens)`` every rank runs in this round, or None: no rank has a call to make."""
        mine = torch.tensor(list(intent), dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        live = [(int(t[0]), int(t[1])) for t in every if int(t[0])]
        if not live:
            return None
        kind = live[0][0]  # the lowest rank's kind goes first
        return kind, max(tokens for k, tokens in live if k == kind)

    def serve_others(self, dummy_forward) -> int:
        """This rank has nothing (more) to run this tick: a dummy call for each round another rank runs."""
        n = 0
        while (agreed := self.round()) is not None:
            dummy_forward(*agreed)
            n += 1
        return n

    def any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class NpuDPForward:
    """The NPU runner's DP attention feature (`graphgen.runtime.parallel.features.DPForward`): it plugs
    `agree_padding` into the runner's ``call_padding`` seam (every graph call at one agreed bucket), and an
    idle rank runs a dummy call of the agreed kind for each round another rank runs (`serve_others`)."""
    name = "dp"

    def __init__(self, dp_rank: int, group=None):
        self.dp_rank, self.sync = dp_rank, NpuDPSync(group)
        self.runner = None
        self.dummy_forwards = 0
        self.dummy_kinds: dict[int, int] = {}  # dummy calls per kind (a probe for tests)

    def attach(self, runner) -> None:
        self.runner = runner
        runner.call_padding = lambda phase, n_seqs, n_tokens, per_row=1: agree_padding(self, phase, n_seqs, n_tokens,
                                                                                      per_row)

    def before_forward(self, plan) -> None:
        pass  # the agreement is per graph call (call_padding), at its bucket

    def serve_others(self) -> int:
        return self.sync.serve_others(lambda kind, tokens: dummy_forward(self, kind, tokens))

    def any(self, flag: bool) -> bool:
        return self.sync.any(flag)

    def barrier(self) -> None:
        self.sync.barrier()


def _kind(phase: str, per_row: int = 1) -> int:
    if phase == "decode":
        return DECODE if per_row == 1 else VERIFY - 2 + per_row
    return DRAFT if phase == "mtp" else PREFILL


def _phase_of(kind: int) -> tuple[str, int]:
    """(the module phase, tokens per row) of a kind."""
    if kind >= VERIFY:
        return "decode", kind - VERIFY + 2
    return {DECODE: "decode", PREFILL: "prefill", DRAFT: "mtp"}[kind], 1


def _padding(runner, phase: str, n_seqs: int, n_tokens: int, per_row: int, at_least: int = 0):
    """The bucket of a call (``at_least``: the agreed T); verify rows: the decode bucket of ``at_least / per_row``
    rows, each ``per_row`` tokens (`UniformPadding`)."""
    from .inputs import UniformPadding

    if phase != "decode" or per_row == 1:
        return runner.buckets.padding(phase, n_seqs, n_tokens, runner.pad_block, at_least=at_least)
    pad = runner.buckets.padding(phase, n_seqs, n_seqs, runner.pad_block, at_least=-(-at_least // per_row))
    return UniformPadding(pad.batch, pad.batch * per_row, pad.max_blocks, pad.pad_block, pad.save_rows,
                          per_row=per_row)


def agree_padding(dp: NpuDPForward, phase: str, n_seqs: int, n_tokens: int, per_row: int = 1):
    """The padding of a real graph call (``n_seqs`` sequences, ``n_tokens`` tokens; a verify call ``per_row`` tokens
    a row) every DP rank agreed on: rounds (running dummy calls for the other kinds meanwhile) until this call's
    kind goes, at the agreed T."""
    runner = dp.runner
    mine = _kind(phase, per_row)
    pad = _padding(runner, phase, n_seqs, n_tokens, per_row)
    while True:
        kind, tokens = dp.sync.round((mine, pad.tokens))
        if kind == mine:
            return _padding(runner, phase, n_seqs, n_tokens, per_row, at_least=tokens)
        dummy_forward(dp, kind, tokens)


def dummy_forward(dp: NpuDPForward, kind: int, tokens: int) -> None:
    """A call of ``kind`` at ``tokens`` on padding only (the pad block; a saving graph writes a staging slot
    that is never committed, as a warm-up step): the MoE's collectives pair with the other ranks' call."""
    runner = dp.runner
    phase, per_row = _phase_of(kind)
    variant = next(v for v, m in runner.modules.items()
                   if m.META["phase"] == phase and not m.META.get("history"))
    mod = runner.modules[variant]
    chunk = [pad_sequence(runner, 1 if phase == "decode" else 0, per_row)]
    if phase == "mtp":  # the MTP graph reads each token's previous hidden state: zeros
        chunk[0]["hidden"] = torch.zeros(per_row, runner.spec.dims.hidden_size, dtype=runner.dtype)
    if per_row > 1:  # every logits row of a verify call
        chunk[0]["logits"] = tuple(range(per_row))
    b, _ = runner._step_inputs(mod, chunk, pad=_padding(runner, phase, 1, per_row, per_row, at_least=tokens))
    target = runner.compiled(variant)
    runner._first_use(variant, b)
    saves = bool(mod.META["saves"])
    idx, slot = runner.commits.ring.acquire() if saves else (None, None)
    try:
        with torch.no_grad(), runner._limits():
            target.forward(runner.W, b, runner.kv, slot.device if saves else ())
    finally:
        if saves:  # the next graph writing this slot is queued after this one (same stream)
            runner.commits.ring.release(idx)
    dp.dummy_forwards += 1
    dp.dummy_kinds[kind] = dp.dummy_kinds.get(kind, 0) + 1
    current_progress().stepping()  # a graph compiled on first use is done: the step deadline again
