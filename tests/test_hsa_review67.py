"""Review 67: DP-SBCD's hidden-state cost (the `epsilon_hsa_assumed` shown beside the published epsilon) summed
V = cumsum(s^2 w^2) in float64; where a step expands (L_F L_T > 1, method.eta > 2/L) the weights w_t fall by that
factor a step, the later increments vanished below V's precision, and the cost came out inf (57 of 108 run-shaped
settings) or off in either direction (0.17x to 1.04x the exact one, above the composition cost it may never exceed).
The staircase is now formed from positive range sums in log2 (never a difference of cumulative sums) and the hull
compares adjacent ranges only (review 68); the reference here is the same formula in mpmath, with as many digits as
the weights span, and in exact fractions."""
from __future__ import annotations

from fractions import Fraction

import mpmath as mp
import numpy as np
import pytest

from runner.accountants.hsa_bound import composition_cost, pabi_cost, pabi_step_costs


def hull_cost(w, shift, s, key, number):
    """The formula (docs/sbcd.md: the lower convex hull of the staircase, 1/2 sum dU^2 / dV) over the weights w in
    the number type `number` (mpmath's mpf, or Fraction): a reference with no rounding of its own."""
    V, acc = [], number(0)
    for t in range(len(s)):
        acc += number(float(s[t])) ** 2 * w[t] ** 2
        V.append(acc)
    keys = [t for t in range(len(s)) if key[t]]
    P, acc = [], number(0)
    for k in keys:
        acc += w[k] * number(float(shift[k]))
        P.append(acc)
    xs = [V[keys[0] - 1] if keys[0] > 0 else number(0)] + [V[k - 1] for k in keys[1:]] + [V[-1]]
    ys = [number(0)] + P[:-1] + [P[-1]]
    hull: list[int] = []
    for i in range(len(xs)):
        while len(hull) >= 2 and ((ys[hull[-1]] - ys[hull[-2]]) * (xs[i] - xs[hull[-2]])
                                  >= (ys[i] - ys[hull[-2]]) * (xs[hull[-1]] - xs[hull[-2]])):
            hull.pop()
        hull.append(i)
    total = number(0)
    for a, b in zip(hull, hull[1:]):
        if ys[b] > ys[a]:
            if xs[b] <= xs[a]:
                return float("inf")
            total += (ys[b] - ys[a]) ** 2 / (xs[b] - xs[a])
    return float(total / 2)


def reference(shift, s, lf, lt, key) -> float:
    """In mpmath, with as many digits as the weights span (their logarithms summed in mpmath)."""
    T = len(s)
    spread = sum(abs(np.log10(a * b)) for a, b in zip(lf, lt))  # the weights' range in decades
    with mp.workdps(int(60 + 2 * spread)):  # V sums increments that far apart
        log_c = [mp.log(mp.mpf(float(a)) * mp.mpf(float(b))) for a, b in zip(lf, lt)]
        suffix = [mp.mpf(0)] * (T + 1)
        for t in range(T - 1, -1, -1):
            suffix[t] = suffix[t + 1] + log_c[t]
        w = [mp.mpf(float(lt[t])) * mp.exp(suffix[t + 1]) for t in range(T)]
        return hull_cost(w, shift, s, key, mp.mpf)


def exact(shift, s, lf, lt, key) -> float:
    """In exact fractions of the float64 inputs (review 68's reference; zero Lipschitz constants too)."""
    T = len(s)
    w, acc = [None] * T, Fraction(1)
    for t in range(T - 1, -1, -1):
        w[t] = Fraction(float(lt[t])) * acc
        acc *= Fraction(float(lf[t])) * Fraction(float(lt[t]))
    return hull_cost(w, shift, s, key, Fraction)


CASES = [  # (T, batches, key batch j, L_F, L_T): method.eta = 100 gives L_F = 99, L_T = 1/6 on a middle layer
    (40, 10, 0, 99.0, 1 / 6), (40, 10, 5, 3.0, 1.0), (8, 4, 3, 49.0, 1 / 6), (200, 4, 1, 99.0, 1 / 6),
    (24, 3, 2, 2.0, 1 / 1.075), (30, 5, 0, 1.0, 1 / 1.075), (60, 6, 2, 1.0, 1.0)]


@pytest.mark.parametrize("T, batches, j, lf, lt", CASES)
def test_the_hidden_state_cost_is_exact_and_at_most_the_compositions(T, batches, j, lf, lt):
    rng = np.random.default_rng(T + j)
    s = rng.uniform(0.5, 2.0, T)  # per-step noise (adaptive schedules differ per step)
    shift = np.ones(T)
    key = (np.arange(T) % batches) == j
    args = (shift, s, np.full(T, lf), np.full(T, lt), key)
    cost = pabi_cost(*args)
    assert np.isfinite(cost) and cost <= composition_cost(shift, s, key) * (1 + 1e-12)
    assert cost == pytest.approx(reference(*args), rel=1e-12)
    assert pabi_step_costs(*args).sum() == pytest.approx(cost, rel=1e-9)


def test_extreme_ranges_a_zero_lipschitz_constant_and_zero_noise_match_exact_fractions():
    """Review 68: noise and shifts over 1e+-30 (a short steep last range behind a long one: 1.7e-5 against 4.1e73
    when the hull compared sums from a to i), L_F = 0 on one step (a MemoryError in the integer version), zero noise
    after a key step (inf, and the per-step costs must say so too)."""
    rng = np.random.default_rng(1)
    for trial in range(150):
        T = int(rng.integers(1, 40))
        s = 10.0 ** rng.uniform(-30, 30, T) if trial % 2 else rng.uniform(0.3, 3, T)
        shift = 10.0 ** rng.uniform(-30, 30, T) if trial % 3 == 0 else rng.uniform(0, 2, T)
        lf = np.full(T, float(rng.choice([1 / 1.075, 1.0, 16.5, 1e10, 1e-10])))
        lt = rng.uniform(0.5, 1.0, T)
        key = rng.random(T) < 0.4
        if not key.any():
            continue
        if trial % 5 == 0:
            lf[rng.integers(T)] = 0.0
        if trial % 7 == 0:
            s[rng.integers(T)] = 0.0
        args = (shift, s, lf, lt, key)
        cost, ref, steps = pabi_cost(*args), exact(*args), pabi_step_costs(*args).sum()
        assert cost <= composition_cost(shift, s, key)
        assert (np.isinf(cost) and np.isinf(ref) and np.isinf(steps)) or cost == pytest.approx(ref, rel=1e-12), trial
        assert np.isinf(cost) or steps == pytest.approx(cost, rel=1e-9), trial


def test_a_long_expanding_run_is_fast():
    """The integer version grew as T^2 (729 MB at T = 20,000; 9.7 s for one epsilon of a 30-epoch run)."""
    import time
    T = 20000
    key = np.arange(T) % 144 == 3
    start = time.perf_counter()
    cost = pabi_cost(np.ones(T), np.ones(T), np.full(T, 99.0), np.full(T, 1 / 6), key)
    assert time.perf_counter() - start < 2.0 and 0 < cost < composition_cost(np.ones(T), np.ones(T), key)
