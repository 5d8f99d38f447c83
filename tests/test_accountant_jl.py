"""The JL accountant (Theorem 4.1 with the full tail of Z_r): limits, monotonicity, discretisation, Monte Carlo."""
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_mechanism as plm

from runner.accountants import ACCOUNTANTS, SubsampledGaussian, SubsampledJL
from runner.accountants import jl_pld
from runner.accountants.jl import JLAccountant

SMALL = dict(q=0.05, sigma=1.0, steps=40)


def jl(r, q, sigma, steps, **kw):
    acc = JLAccountant(**kw)
    acc.step(SubsampledJL(q, sigma, r), count=steps)
    return acc


def gaussian(q, sigma, steps, delta=1e-5):
    acc = ACCOUNTANTS.build("pld")
    acc.step(SubsampledGaussian(q, sigma), count=steps)
    return acc.epsilon(delta)


def test_closed_form_deltas_match_dp_accounting():
    eps = np.array([0.05, 0.5, 2.0])
    for mu in (0.3, 1.0, 3.0):
        for adj, mine in ((plm.AdjacencyType.REMOVE, jl_pld.delta_remove), (plm.AdjacencyType.ADD, jl_pld.delta_add)):
            ref = plm.GaussianPrivacyLoss(1.0, sensitivity=mu, sampling_prob=0.05, adjacency_type=adj)
            assert mine(mu, 0.05, eps) == pytest.approx(ref.get_delta_for_epsilon(eps), rel=1e-6, abs=1e-15)


def test_large_r_converges_to_gaussian():
    q, sigma, steps = 256 / 60000, 1.3, 3516
    assert jl(1000, q, sigma, steps).epsilon(1e-5) == pytest.approx(gaussian(q, sigma, steps), rel=0.02)


def test_non_decreasing_in_steps_and_discretisation_stable():
    acc = JLAccountant(max_loss=16.0)
    m = SubsampledJL(SMALL["q"], SMALL["sigma"], 50)
    previous = 0.0
    for count in (10, 30, 120):
        acc.step(m, count=count)
        assert acc.epsilon(1e-5) >= previous
        previous = acc.epsilon(1e-5)
    coarse = jl(50, **SMALL, max_loss=16.0, discretization=2e-3).epsilon(1e-5)
    fine = jl(50, **SMALL, max_loss=16.0, discretization=1e-3).epsilon(1e-5)
    assert abs(coarse - fine) < 0.02 * fine and coarse >= fine - 1e-9  # pessimistic: coarser is never smaller


def test_r1_is_worse_than_gaussian_and_reported_as_a_bound():
    acc = jl(1, **SMALL, max_loss=16.0)
    g = gaussian(SMALL["q"], SMALL["sigma"], SMALL["steps"])
    assert acc.epsilon(1e-5) > g
    assert math.isinf(acc.epsilon(1e-5))  # the infinity mass of the heavy tail alone exceeds delta
    assert acc.epsilon_lower_bound(1e-5) > 16.0  # certified: the analysis' epsilon is beyond the grid


def test_smallest_finite_r_is_the_edge_of_the_certainly_infinite_region():
    """The advice an infinite run prints (why_infinite): r - 1 is certainly infinite, r is not, and its epsilon is a
    finite number (MNIST's paper setting: r = 1, 2, 4 are inf, r = 8 gives ~15.8)."""
    q, sigma, steps = 256 / 60000, 1.3, 3516
    acc = jl(1, q, sigma, steps)
    r = acc.smallest_finite_r(1e-5)
    assert 4 < r <= 8
    assert jl(r - 1, q, sigma, steps)._certainly_infinite(1e-5) and not jl(r, q, sigma, steps)._certainly_infinite(1e-5)
    note = acc.why_infinite(1e-5)
    eps = jl(r, q, sigma, steps).epsilon(1e-5)
    assert math.isfinite(eps) and f"r={r} is the smallest" in note and f"epsilon {eps:.4g}" in note
    assert jl(1, q, 0.0, steps).smallest_finite_r(1e-5) is None  # no noise: no r gives a finite epsilon


def test_infinity_mass_shortcut_agrees_with_the_pld():
    args = (SMALL["q"], SMALL["sigma"], 6, 1e-3, 12.0)
    pld = jl_pld.step_pld(*args)
    assert jl_pld.step_infinity_mass(*args) == pytest.approx(pld._pmf_remove._infinity_mass, rel=1e-9)


def monte_carlo_delta(eps, q, sigma, r, steps, n, rng):
    """delta(eps) = E_upper[(1 - e^{eps - L})_+] for both directions, L = sum of per-step losses."""
    out = []
    for direction in ("remove", "add"):
        total = np.zeros(n)
        for _ in range(steps):
            mu = 1.0 / np.sqrt(rng.chisquare(r, n) / r) / sigma
            shift = mu * (rng.random(n) < q) if direction == "remove" else 0.0
            w = rng.standard_normal(n) + shift
            loss = np.logaddexp(math.log1p(-q), math.log(q) + mu * w - mu * mu / 2)
            total += loss if direction == "remove" else -loss
        vals = np.maximum(0.0, -np.expm1(eps - total))
        out.append((vals.mean(), vals.std() / math.sqrt(n)))
    return max(out)


def test_monte_carlo_delta_within_the_accountants_bound():
    q, sigma, r, steps = 0.05, 1.0, 4, 40
    acc = jl(r, q, sigma, steps, max_loss=12.0)
    rng = np.random.default_rng(0)
    for eps in (1.0, 2.0):
        mc, se = monte_carlo_delta(eps, q, sigma, r, steps, 100_000, rng)
        bound = acc.delta(eps)
        assert mc <= bound + 4 * se  # pessimistic
        assert mc >= 0.7 * bound - 4 * se  # and not wildly so


def test_a_step_at_sample_rate_zero_releases_nothing():
    """q = 0 samples nobody: epsilon 0, as pld and rdp say, and no change to the others' composition (it raised
    ValueError: math domain error from the analysis' log(q))."""
    empty = ACCOUNTANTS.build("jl")
    empty.step(SubsampledJL(0.0, 1.0, 4), count=10)
    assert empty.epsilon(1e-5) == 0.0 and empty.delta(1.0) == 0.0 and empty.epsilon_lower_bound(1e-5) == 0.0
    both, alone = ACCOUNTANTS.build("jl"), ACCOUNTANTS.build("jl")
    for acc in (both, alone):
        acc.step(SubsampledJL(0.01, 1.0, 64), count=20)
    both.step(SubsampledJL(0.0, 1.0, 64), count=5)
    assert both.epsilon(1e-5) == alone.epsilon(1e-5) > 0
