"""Greedy tokens of two implementations that are not bit-identical, compared as random weights allow
(docs/testing.md, "Token equality on random weights").

Random weights give near ties: two top logits a few hundredths apart. Two implementations that round
differently (two targets, bf16 vs float32, W8A8 vs its CPU emulation, ranks vs one rank where a reduction
reorders) may pick either side of such a tie, and which side wins depends on the machine's kernels. So equal
greedy tokens is asserted only while the reference's top-2 margin is wider than the comparison's logit
tolerance; at every step whose prefix both sides share, the logits must agree within that tolerance (that is
what catches a real break: a miswired scale, a wrong layer, moves them by far more). At the first step where
the tokens differ the reference must be at a near tie (margin <= ``tol``) and the logits must still agree;
the sequences then go different ways and nothing after that step is comparable.

`assert_agree` takes one sequence's tokens and per-step logits on each side; `assert_results_agree` takes two
lists of results with ``.tokens`` / ``.step_logits`` (``RequestResult``, ``collect_logits=True``).
`top2_margin` is the reference's margin at a step, for tests that pick a prompt with a margin and assert it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Agreement", "agree", "assert_agree", "assert_results_agree", "top2_margin", "greedy_margins"]


def top2_margin(logits) -> float:
    """top-1 minus top-2 logit of one step (float)."""
    v = torch.as_tensor(logits).float().reshape(-1)
    top = torch.topk(v, 2).values
    return float(top[0] - top[1])


def greedy_margins(step_logits) -> list[float]:
    """`top2_margin` of every step."""
    return [top2_margin(x) for x in step_logits]


@dataclass(frozen=True)
class Agreement:
    """What `agree` compared: ``steps`` steps with a shared prefix (tokens equal before each), the largest
    logit difference over them, and ``tie_at``: the step where the tokens parted at a near tie (None: equal
    throughout)."""
    steps: int
    max_diff: float
    tie_at: int | None


def agree(ref_tokens: Sequence[int], ref_logits, got_tokens: Sequence[int], got_logits, tol: float,
          *, where: str = "") -> Agreement:
    """Check ``got`` against ``ref`` (module doc); raise AssertionError with the step, both top-2 pairs and the
    margin when they disagree beyond what a near tie allows; return what was compared."""
    ref_tokens, got_tokens = list(ref_tokens), list(got_tokens)
    at = f"{where}: " if where else ""
    if not ref_logits or not got_logits:
        raise AssertionError(f"{at}no step logits to compare (run with collect_logits=True)")
    n = min(len(ref_tokens), len(got_tokens), len(ref_logits), len(got_logits))
    worst = 0.0
    for i in range(n):
        r = torch.as_tensor(ref_logits[i]).float().reshape(-1)
        g = torch.as_tensor(got_logits[i]).float().reshape(-1)
        if r.shape != g.shape:
            raise AssertionError(f"{at}step {i}: logits of shape {tuple(r.shape)} vs {tuple(g.shape)}")
        diff = float((r - g).abs().max())
        worst = max(worst, diff)
        if math.isnan(diff) or diff > tol:
            raise AssertionError(
                f"{at}step {i} (tokens equal before it): logits differ by {diff:.4g} > tol {tol} "
                f"(ref top-2 {_top2(r)}, got top-2 {_top2(g)}) -- not a near tie, the implementations disagree")
        if ref_tokens[i] != got_tokens[i]:
            margin = top2_margin(r)
            if margin > tol:
                raise AssertionError(
                    f"{at}step {i}: token {got_tokens[i]} is not the argmax {ref_tokens[i]} although the reference's top-2 "
                    f"margin {margin:.4g} is wider than tol {tol} (ref top-2 {_top2(r)}, got top-2 {_top2(g)}); "
                    f"tokens so far {ref_tokens[:i]}")
            return Agreement(i + 1, worst, i)
    if len(ref_tokens) != len(got_tokens):
        raise AssertionError(f"{at}{len(ref_tokens)} reference tokens vs {len(got_tokens)}, equal as far as both "
                             f"go ({ref_tokens} vs {got_tokens})")
    return Agreement(n, worst, None)


def assert_agree(ref_tokens, ref_logits, got_tokens, got_logits, tol: float, *, where: str = "") -> Agreement:
    """`agree` under the name the tests read as an assertion."""
    return agree(ref_tokens, ref_logits, got_tokens, got_logits, tol, where=where)


def assert_results_agree(refs, gots, tol: float, *, where: str = "") -> list[Agreement]:
    """`agree` over two lists of results (``.tokens``, ``.step_logits``), pairwise."""
    refs, gots = list(refs), list(gots)
    assert len(refs) == len(gots), f"{where}: {len(refs)} reference results vs {len(gots)}"
    return [agree(r.tokens, r.step_logits, g.tokens, g.step_logits, tol, where=f"{where} [{k}]")
            for k, (r, g) in enumerate(zip(refs, gots))]


def _top2(v: torch.Tensor) -> str:
    t = torch.topk(v, 2)
    return ", ".join(f"{int(i)}:{float(x):.4g}" for x, i in zip(t.values, t.indices))
