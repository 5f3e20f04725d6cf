"""Rejection sampling for speculative decoding at temperature > 0 (arXiv 2211.17192): the tokens it
emits are distributed as the target's distribution p, whatever the draft distribution q is.

A small vocabulary and position-dependent (context-free) p_t and q_t: a generation of two tokens
drafts from q, verifies with `rejection_sample` cycle after cycle, and the joint distribution of the
two tokens must be p_0 x p_1 (chi-square over the 16 cells, fixed seed). Negative control: a
verifier that accepts every draft emits q's distribution, and the same test rejects it."""

from __future__ import annotations

import torch

from graphgen.runtime.engine.sampling import rejection_sample

V, LENGTH, K, TRIALS = 4, 2, 2, 4000
CHI2_DF15_999 = 37.70  # the chi-square distribution's 0.999 quantile, 15 degrees of freedom


def _dists(seed: int, zero_at: int = -1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = torch.softmax(torch.randn(LENGTH + K, V, generator=g) * 1.5, -1)
    if zero_at >= 0:  # a draft distribution without mass where the target has some
        d[:, zero_at] = 0
        d = d / d.sum(-1, keepdim=True)
    return d


P, Q = _dists(1), _dists(2, zero_at=0)


def _accept_all(target, draft, drafts, generator):
    return [*map(int, drafts), int(torch.multinomial(target[len(drafts)], 1, generator=generator))], len(drafts)


def _chi2(verify) -> float:
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(V, V)
    for _ in range(TRIALS):
        tokens: list[int] = []
        while len(tokens) < LENGTH:
            t = len(tokens)
            drafts = [int(torch.multinomial(Q[t + i], 1, generator=g)) for i in range(K)]
            emitted, _ = verify(P[t:t + K + 1], Q[t:t + K], drafts, g)
            tokens += emitted
        counts[tokens[0], tokens[1]] += 1
    expected = torch.outer(P[0], P[1]) * TRIALS
    return float(((counts - expected) ** 2 / expected).sum())


def test_emitted_tokens_follow_the_target_distribution():
    assert _chi2(rejection_sample) < CHI2_DF15_999


def test_negative_control_accepting_every_draft_fails():
    assert _chi2(_accept_all) > 10 * CHI2_DF15_999


def test_accepted_count_and_bonus():
    g = torch.Generator().manual_seed(0)
    same = P[:K + 1]
    emitted, accepted = rejection_sample(same, same[:K], [1, 2], g)  # q == p: every draft is accepted
    assert accepted == K and emitted[:K] == [1, 2] and len(emitted) == K + 1
    onehot = torch.zeros(K + 1, V)
    onehot[:, 3] = 1.0  # the target never emits a draft it gives no mass: rejected, replaced by 3
    emitted, accepted = rejection_sample(onehot, Q[:K], [1, 2], g)
    assert (emitted, accepted) == ([3], 0)
