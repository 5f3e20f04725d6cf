"""Greedy tokens of two implementations that are not bit-identical, compared as random weights allow
(docs/testing.md, "Token equality on random weights").

Random weights give near ties: two top logits a few hundredths apart. Two implementations that round
differently (two targets, bf16 vs float32, W8A8 vs its CPU emulation, ranks vs one rank where a reduction
reorders) may pick either side of such a tie, and which side wins depends on the machine's kernels. So: at every
step whose prefix both sides share, the logits must agree within ``tol`` (max abs difference; NaN fails): that
is what catches a real break (a miswired scale, a wrong layer moves them by far more). Equal greedy tokens are
asserted wherever the reference's top-2 margin is wider than ``2 * tol`` (logits each within ``tol`` of the
reference's move its top-2 gap by up to ``2 * tol``, so a flip there is a bug, not rounding; the repository's
older hand-written checks, tests/npu/test_npu_runner.py and test_npu_ranks.py, used the same bound). At the
first step where the tokens differ at a near tie, the comparison stops: the sequences go different ways and
nothing after that step is comparable.

`assert_agree` takes one sequence's tokens and per-step logits on each side; `assert_results_agree` takes two
lists of results with ``.tokens`` / ``.step_logits`` (``RequestResult``, ``collect_logits=True``).
`top2_margin` is the reference's margin at a step, for tests that pick a prompt with a margin and assert it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Agreement", "agree", "assert_agree", "assert_results_agree", "assert_tokens_agree", "top2_margin",
           "greedy_margins"]


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
    throughout). A test asserts ``steps`` is more than the first step of each sequence where it matters: a
    comparison that always ends at step 0 proves little."""
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
            if margin > 2 * tol:
                raise AssertionError(
                    f"{at}step {i}: token {got_tokens[i]} is not the argmax {ref_tokens[i]} although the reference's top-2 "
                    f"margin {margin:.4g} is wider than 2 x tol {tol} (ref top-2 {_top2(r)}, got top-2 {_top2(g)}); "
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


def assert_tokens_agree(ref_tokens, ref_logits, got_tokens, margin: float, *, where: str = "") -> int:
    """The tokens-only form, for a side that keeps no per-token logits (speculative decoding's verify rows):
    ``got_tokens`` equal the reference's up to the first step whose reference top-2 margin is <= ``margin``
    (the rounding difference the caller allows; a different token there is allowed and ends the comparison).
    Returns the steps compared."""
    ref_tokens, got_tokens = [int(t) for t in ref_tokens], [int(t) for t in got_tokens]
    at = f"{where}: " if where else ""
    if len(ref_logits) != len(ref_tokens):
        raise AssertionError(f"{at}{len(ref_logits)} reference step logits for {len(ref_tokens)} tokens "
                             f"(generate with collect_logits=True)")
    if len(got_tokens) != len(ref_tokens):
        raise AssertionError(f"{at}{len(ref_tokens)} reference tokens vs {len(got_tokens)} ({ref_tokens} vs {got_tokens})")
    for i, (r, g) in enumerate(zip(ref_tokens, got_tokens)):
        m = top2_margin(ref_logits[i])
        if m <= margin:
            return i + 1  # a near tie: either token may win, and the sequences may part from here
        if r != g:
            raise AssertionError(f"{at}step {i}: token {g} is not the reference's {r} although its top-2 margin "
                                 f"{m:.4g} is wider than {margin} (tokens before: {ref_tokens[:i]})")
    return len(ref_tokens)


def _top2(v: torch.Tensor) -> str:
    t = torch.topk(v, 2)
    return ", ".join(f"{int(i)}:{float(x):.4g}" for x, i in zip(t.values, t.indices))
