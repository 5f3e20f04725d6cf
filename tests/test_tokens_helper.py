"""support.tokens.assert_agree: the rule for token equality on random weights (docs/testing.md) holds both ways."""
import pytest
import torch

from support.tokens import assert_agree, assert_results_agree, top2_margin


def _l(*top):  # one step's logits over a vocabulary of 4
    return torch.tensor([*top, *[-9.0] * (4 - len(top))])


def test_a_near_tie_may_go_either_way_and_ends_the_comparison():
    ref = [_l(5.09, 5.00), _l(1.0, 3.0)]
    got = [_l(5.03, 5.03), _l(7.0, 0.0)]  # step 1 is not comparable: the prefixes diverged at step 0
    assert top2_margin(ref[0]) == pytest.approx(0.09, abs=1e-6)
    a = assert_agree([0, 1], ref, [1, 0], got, tol=0.1)
    assert (a.steps, a.tie_at) == (1, 0) and a.max_diff == pytest.approx(0.06, abs=1e-6)


def test_equal_tokens_are_compared_to_the_end():
    ref = [_l(5.0, 1.0), _l(1.0, 5.0), _l(2.0, 1.9)]
    got = [_l(5.1, 1.0), _l(1.0, 5.1), _l(1.95, 1.95)]
    a = assert_agree([0, 1, 0], ref, [0, 1, 0], got, tol=0.1)
    assert (a.steps, a.tie_at) == (3, None)


def test_a_wide_margin_token_must_agree():
    ref, got = [_l(5.0, 1.0)], [_l(5.0, 1.0)]
    with pytest.raises(AssertionError, match="is wider than"):
        assert_agree([0], ref, [1], got, tol=0.1)


def test_logits_beyond_the_tolerance_fail_even_at_a_tie():
    with pytest.raises(AssertionError, match=r"step 0 .*logits differ by 0\.5"):
        assert_agree([0], [_l(5.0, 5.0)], [0], [_l(5.5, 5.0)], tol=0.1)
    with pytest.raises(AssertionError, match="logits differ by nan"):
        assert_agree([0], [_l(5.0, 1.0)], [0], [_l(float("nan"), 1.0)], tol=0.1)


def test_different_lengths_or_no_logits_fail():
    with pytest.raises(AssertionError, match="1 reference tokens vs 2"):
        assert_agree([0], [_l(1.0)], [0, 1], [_l(1.0)], tol=0.1)
    with pytest.raises(AssertionError, match="no step logits"):
        assert_agree([0], [], [0], [], tol=0.1)


def test_results_are_compared_pairwise():
    class R:
        def __init__(self, tokens, logits):
            self.tokens, self.step_logits = tokens, logits
    ok = assert_results_agree([R([0], [_l(5.0, 1.0)])], [R([0], [_l(5.0, 1.0)])], tol=0.1, where="x")
    assert [a.steps for a in ok] == [1]
    with pytest.raises(AssertionError, match=r"x \[0\]: step 0"):
        assert_results_agree([R([0], [_l(5.0, 1.0)])], [R([0], [_l(1.0, 5.0)])], tol=0.1, where="x")


def test_a_flip_is_allowed_up_to_a_margin_of_twice_the_tolerance():
    # margin 0.18 <= 2 x 0.1: the two logits moved 0.09 each, within tol, and crossed
    a = assert_agree([0], [_l(5.09, 4.91)], [1], [_l(5.0, 5.0)], tol=0.1)
    assert (a.steps, a.tie_at) == (1, 0)
    # margin 0.3 > 2 x 0.1: logits within tol cannot cross there, so a different token is not rounding
    with pytest.raises(AssertionError, match="not the argmax"):
        assert_agree([0], [_l(5.15, 4.85)], [1], [_l(5.1, 4.9)], tol=0.1)


def test_tokens_only_agree_up_to_a_near_tie_of_the_reference():
    from support.tokens import assert_tokens_agree

    ref = [_l(5.0, 1.0), _l(2.0, 2.00001), _l(1.0, 3.0)]
    assert assert_tokens_agree([0, 1, 1], ref, [0, 0, 3], margin=1e-4) == 2  # step 1 is a tie: stop there
    assert assert_tokens_agree([0], ref[:1], [0], margin=1e-4) == 1
    with pytest.raises(AssertionError, match="not the reference's 0"):
        assert_tokens_agree([0, 1], ref[:2], [2, 1], margin=1e-4)
