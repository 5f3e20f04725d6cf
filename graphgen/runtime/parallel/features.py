"""Rank features: what makes a target's runner (CPU or NPU) one rank of a layout, applied by one
`RankRunner` around it. `graphgen.runtime.parallel.rank.build_rank` picks them from the layout:

* `PlanCheck` (``dp = 1``, more than one rank): before every forward the ranks all-gather a fingerprint
  of the plan (variant, rows, tokens, positions, block tables); a mismatch raises on every rank (never a
  hang, never a silent wrong collective). Ranks run in lockstep, each with its own scheduler; this is
  what keeps that honest (`graphgen.runtime.parallel.rank`, "Why lockstep").
* a `DPForward` (``dp > 1``, DP attention): every real forward begins with a handshake over the DP
  ranks, and a rank with nothing (more) to run serves the others' forwards with dummy ones, so the MoE's
  collectives pair up. One protocol, two implementations: the CPU's
  (`graphgen.runtime.parallel.dp_rank.CpuDPForward`: a MAX per forward, the dummy on zero tokens) and
  the NPU's (`graphgen.npu.run.data_parallel.NpuDPForward`: one agreed padded bucket per graph call, a
  dummy of the agreed kind). The target names its own (`RankTarget.dp_forward`).
* `graphgen.runtime.parallel.context_parallel.ContextSplit` (``cp > 1``): the head-tail split of a
  prefill step over the CP ranks (a pure function of the plan) and the logits reduce; it plugs into the
  runner's ``split`` seam (the CPU and NPU runners have one; a runner without it is refused).

A feature has ``name``, ``attach(runner)`` (called once, on the target's own runner) and
``before_forward(plan)`` (called by `RankRunner.submit` before a plan with rows runs).
"""

from __future__ import annotations

import hashlib
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from ..engine.request import StepPlan

__all__ = ["RankFeature", "DPForward", "PlanCheck", "RankRunner", "plan_fingerprint", "check_plan"]


class RankFeature(Protocol):
    name: str

    def attach(self, runner) -> None: ...

    def before_forward(self, plan: StepPlan) -> None: ...


class DPForward(RankFeature, Protocol):
    """DP attention's forward agreement (module doc); what the DP rank commands drive between steps."""
    dp_rank: int
    dummy_forwards: int

    def serve_others(self) -> int:
        """This rank has nothing (more) to run this tick: dummy forwards while another rank runs real
        ones; how many ran."""
        ...

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any DP rank (a collective)."""
        ...

    def barrier(self) -> None: ...


def plan_fingerprint(plan: StepPlan) -> int:
    """A 63-bit digest of what every rank must plan alike (pool keys excluded: they name the rank's shard)."""
    h = hashlib.sha256(plan.variant.encode())
    for row in plan.rows:
        h.update(repr((row.start, row.token_ids, row.block_table, row.load_block_ids, row.save_block_ids,
                       row.logits_positions, row.samples, row.decode)).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1


def check_plan(plan: StepPlan, group=None) -> None:
    """Compare the ranks' plans (all_gather of `plan_fingerprint`); a rank whose plan differs would
    issue other collectives, so every rank raises instead (a collective: every rank calls it)."""
    mine = torch.tensor([plan_fingerprint(plan)], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    if any(int(t) != int(mine) for t in every):
        raise RuntimeError(f"the ranks planned different steps (plan fingerprints {[int(t) for t in every]}): "
                           f"lockstep lost (a rank got other requests or a sampler without a seed?)")


class PlanCheck:
    """`check_plan` before every forward, on ``group`` (the host-side gloo group; None: the world's)."""
    name = "plan_check"

    def __init__(self, group=None):
        self.group = group

    def attach(self, runner) -> None:
        pass

    def before_forward(self, plan: StepPlan) -> None:
        check_plan(plan, self.group)


class RankRunner:
    """A target's runner as one rank: ``submit`` runs every feature's ``before_forward`` first, on the
    caller's thread before the forward starts (a plan with no rows issues no collective: nothing to agree
    on), then the forward (``background``: on the target runner's forward thread, async scheduling:
    `graphgen.runtime.parallel.rank`, "Threads"); everything else is the runner's own (attributes read and
    set go to it)."""

    _OWN = ("inner", "features")

    def __init__(self, inner, features: Sequence[RankFeature]):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "features", tuple(features))
        for f in self.features:
            f.attach(inner)

    def feature(self, name: str):
        """The feature called ``name``, or None."""
        return next((f for f in self.features if f.name == name), None)

    @property
    def dp(self) -> Optional[DPForward]:
        return self.feature("dp")

    @property
    def dummy_forwards(self) -> int:
        """How many dummy forwards this rank ran (DP attention; 0 otherwise): a probe for tests."""
        dp = self.dp
        return dp.dummy_forwards if dp is not None else 0

    def submit(self, plan: StepPlan, *, background: bool = False):
        if plan.rows:
            for f in self.features:
                f.before_forward(plan)
        return self.inner.submit(plan, background=background)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value) -> None:
        if name in self._OWN:
            raise AttributeError(f"RankRunner.{name} is set once")
        setattr(self.inner, name, value)
