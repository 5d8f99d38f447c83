"""Review 63: jl_pld.tail_lower_bound (the certified lower bound behind `inf (> X)`) bounded P_lower(S) from above
with u, a LOWER bound on P_upper(loss > b); its delta came out 1-6% above what the argument certifies. It now takes
an upper bound (tail_upper_bound), which must lie above the exact tail probability (an integral over Z_r here)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, special, stats

from runner.accountants import jl_pld

CASES = [(0.01, 1.0, 1, 1, 2.0), (0.5, 1.0, 1, 1, 1.0), (0.01, 2.0, 2, 1, 0.5), (0.1, 1.0, 1, 10, 3.0)]


def exact_tail(q: float, sigma: float, r: int, b: float) -> float:
    """P(remove-direction loss > b) of one step: E_Z[q Phi(mu - x_b) + (1 - q) Phi(-x_b)], x_b = c / mu + mu / 2,
    mu = Z / sigma, Z = 1 / sqrt(chi2_r / r), c = log((e^b - 1 + q) / q) (the reviewer's integral)."""
    log_c = b + math.log1p(-(1.0 - q) * math.exp(-b)) - math.log(q)

    def integrand(t):  # over w = e^t, the chi2_r value
        w = math.exp(t)
        mu = 1.0 / math.sqrt(w / r) / sigma
        x_b = log_c / mu + mu / 2
        return stats.chi2.pdf(w, r) * (q * special.ndtr(mu - x_b) + (1 - q) * special.ndtr(-x_b)) * w
    return integrate.quad(integrand, -80, 6, limit=2000, epsabs=0, epsrel=1e-8)[0]


@pytest.mark.parametrize("q, sigma, r, count, eps", CASES)
def test_the_tail_bound_is_below_what_the_exact_tail_certifies(q, sigma, r, count, eps):
    s = math.log(count) + 3.0
    b = eps + s
    U = exact_tail(q, sigma, r, b)
    assert jl_pld.tail_upper_bound(q, sigma, r, b) >= U
    log_c = b + math.log1p(-(1.0 - q) * math.exp(-b)) - math.log(q)
    z0 = np.geomspace(1e-2, 1e12, 2000)
    u = float(np.max(jl_pld.z_survival(z0, r) * q * special.ndtr(z0 / sigma / 2.0 - log_c / (z0 / sigma))))
    certified = -math.expm1(count * math.log1p(-u)) - count * math.exp(-s) * U  # the argument with the exact U
    assert jl_pld.tail_lower_bound([(q, sigma, r, count)], eps) <= certified
