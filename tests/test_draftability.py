"""GLANCE's draftability law (outrider/bench/draftability.py; issue 44 item 4): the fit recovers a
known law from rounds drawn from it, its four checks pass there and fail on acceptance that does not
depend on entropy, and a law fitted on one half predicts the other half better than a constant."""

import math

import numpy as np
import pytest

from outrider.bench.draftability import expected_accepted, expected_accepted_slow, fit_law, held_out, spearman


def rounds(n, b0, b1, cap, seed):
    rng = np.random.default_rng(seed)
    H = rng.uniform(0.0, 3.0, n)
    p = 1 / (1 + np.exp(-(b0 - b1 * H)))
    a = np.minimum(rng.geometric(1 - p) - 1, cap)  # successes before the first miss: mean p / (1 - p)
    return H, a.astype(float)


def test_the_vectorized_law_equals_the_slow_one():
    H = [0.0, 0.4, 1.7, 3.2]
    for b0, b1, cap in ((1.0, 0.7, 7), (3.5, 0.1, 7), (-1.0, 2.0, 15)):
        want = [expected_accepted_slow(h, b0, b1, cap) for h in H]
        assert expected_accepted(H, b0, b1, cap).tolist() == pytest.approx(want, rel=1e-9)


def test_the_fit_recovers_a_known_law_and_its_checks_hold():
    H, a = rounds(4000, 1.2, 0.9, 60, seed=0)
    fit = fit_law(H, a, cap=60)
    assert fit.b0 == pytest.approx(1.2, abs=0.15) and fit.b1 == pytest.approx(0.9, abs=0.12)
    assert fit.holds() and fit.r2_curve > 0.9 and fit.spearman_rho < -0.3
    assert fit.curve[0][1] > fit.curve[-1][1]  # decile means fall with entropy
    other_H, other_a = rounds(4000, 1.2, 0.9, 60, seed=1)
    check = held_out(fit, other_H, other_a, float(a.mean()))
    assert check.beats_constant and check.r2_curve > 0.9


def test_acceptance_that_ignores_entropy_fails_the_checks():
    rng = np.random.default_rng(2)
    H = rng.uniform(0.0, 3.0, 600)
    a = np.minimum(rng.geometric(0.4, 600) - 1, 7).astype(float)
    fit = fit_law(H, a, cap=7)
    assert not fit.checks()["negative_rank_correlation"] and not fit.holds()
    with pytest.raises(ValueError):
        fit_law(H[:10], a[:10], cap=7)


def test_spearman_with_ties():
    rho, p = spearman(np.array([1.0, 2.0, 2.0, 3.0, 4.0] * 10), np.array([5.0, 4.0, 4.0, 2.0, 1.0] * 10))
    assert rho < -0.9 and p < 1e-6
    assert math.isnan(spearman(np.ones(5), np.arange(5.0))[0])
