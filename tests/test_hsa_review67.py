"""Review 67: DP-SBCD's hidden-state cost (the `epsilon_hsa_assumed` shown beside the published epsilon) summed
V = cumsum(s^2 w^2) in float64; where a step expands (L_F L_T > 1, method.eta > 2/L) the weights w_t fall by that
factor a step, the later increments vanished below V's precision, and the cost came out inf (57 of 108 run-shaped
settings) or off in either direction (0.17x to 1.04x the exact one, above the composition cost it may never exceed).
The hull is now formed in exact integer arithmetic; the reference here is the same formula in mpmath, with as many
digits as the weights span."""
from __future__ import annotations

import mpmath as mp
import numpy as np
import pytest

from runner.accountants.hsa_bound import composition_cost, pabi_cost, pabi_step_costs


def reference(shift, s, lf, lt, key) -> float:
    """pabi_cost's formula (docs/sbcd.md: the lower convex hull of the staircase, 1/2 sum dU^2 / dV) in mpmath."""
    T = len(s)
    spread = sum(abs(np.log10(a * b)) for a, b in zip(lf, lt))  # the weights' range in decades
    with mp.workdps(int(60 + 2 * spread)):  # V sums increments that far apart
        log_c = [mp.log(mp.mpf(float(a)) * mp.mpf(float(b))) for a, b in zip(lf, lt)]
        suffix = [mp.mpf(0)] * (T + 1)
        for t in range(T - 1, -1, -1):
            suffix[t] = suffix[t + 1] + log_c[t]
        w = [mp.mpf(float(lt[t])) * mp.exp(suffix[t + 1]) for t in range(T)]
        V, acc = [], mp.mpf(0)
        for t in range(T):
            acc += mp.mpf(float(s[t])) ** 2 * w[t] ** 2
            V.append(acc)
        keys = [t for t in range(T) if key[t]]
        P, acc = [], mp.mpf(0)
        for k in keys:
            acc += w[k] * mp.mpf(float(shift[k]))
            P.append(acc)
        xs = [V[keys[0] - 1] if keys[0] > 0 else mp.mpf(0)] + [V[k - 1] for k in keys[1:]] + [V[-1]]
        ys = [mp.mpf(0)] + P[:-1] + [P[-1]]
        hull: list[int] = []
        for i in range(len(xs)):
            while len(hull) >= 2 and ((ys[hull[-1]] - ys[hull[-2]]) * (xs[i] - xs[hull[-2]])
                                      >= (ys[i] - ys[hull[-2]]) * (xs[hull[-1]] - xs[hull[-2]])):
                hull.pop()
            hull.append(i)
        return float(mp.fsum((ys[b] - ys[a]) ** 2 / (xs[b] - xs[a]) for a, b in zip(hull, hull[1:])
                             if ys[b] > ys[a]) / 2)


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
