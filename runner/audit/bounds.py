"""Lower bounds on epsilon from one run's canary guesses (docs/audit.md has the equations).

m canaries, each included independently with probability 1/2; the auditor makes r guesses (the rest abstain), v of
them correct. Three analyses of the same kind of counts:

    epsilon_lower_bound(m, r, v, beta, delta)       Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training
                                                    Run" (NeurIPS 2023): the largest epsilon whose (epsilon, delta)-DP
                                                    makes >= v correct guesses a p-value <= beta event (Theorem 3.1
                                                    and its delta extension, the paper's Algorithm 2 p-value)
    epsdp_rejects(eps, delta, m, r, v, beta)        Mahloujifar, Melis & Chaudhuri, "Auditing f-Differential Privacy in
    epsilon_lower_bound_tradeoff(m, r, v, beta,     One Run" (ICML 2025), for the tradeoff curve of (eps, delta)-DP
                                 delta)             itself, f(x) = max(0, 1 - delta - e^eps x, e^-eps (1 - delta - x)):
                                                    every (eps, delta)-DP mechanism is f-DP for it, so a rejection
                                                    refutes the claim whatever the shape of the run's privacy curve
    mu_lower_bound(m, r, v, beta)                   the same recursion for the Gaussian-DP tradeoff f_mu: the largest
    epsilon_gdp(m, r, v, beta, delta)               mu rejected, then mu-GDP's epsilon at delta (Dong, Roth & Su,
                                                    Corollary 2.13). NOT a lower bound on epsilon: it refutes mu-GDP
                                                    only, and a run that is (eps, delta)-DP without a Gaussian-shaped
                                                    curve (randomized response, Laplace) often exceeds its eps here.
                                                    An empirical number that assumes a Gaussian-shaped curve.
    ceiling(m, beta, delta)                         what perfect guessing could show with m canaries (the best r)

    >>> round(epsilon_lower_bound(m=1000, r=100, v=100, beta=0.05, delta=0.0), 3)
    3.493

Exact binomial tails from scipy.stats (no normal approximation); root finding by bisection on a monotone p-value.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from scipy import stats
from scipy.special import expit, ndtr, ndtri

EPS_MAX = 64.0  # no audit with <= 10^6 canaries certifies more; the search stops here
BISECTION_STEPS = 40  # 64 / 2^40: far below any reported digit


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[>= v of r guesses correct] under the null hypothesis "(eps, delta)-DP" (Steinke et al., Algorithm 2):
    beta = P[Binomial(r, q) >= v] with q = e^eps / (1 + e^eps), plus 2 m delta max_{i=1..v} P[v > Bin(r, q) >= v-i] / i.
    """
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got m={m} r={r} v={v}")
    if v == 0:
        return 1.0
    q = float(expit(eps))  # the accuracy of eps-DP randomized response
    beta = float(stats.binom.sf(v - 1, r, q))
    if delta == 0:
        return beta
    i = np.arange(1, v + 1)
    between = stats.binom.sf(v - i - 1, r, q) - beta  # P[v > Bin(r, q) >= v - i], i = 1..v
    alpha = float(np.max(between / i))
    return min(beta + alpha * delta * 2 * m, 1.0)


def largest_rejected(rejects, hi: float = EPS_MAX) -> float:
    """The largest x in [0, hi] with rejects(x) True, for a predicate true on [0, x*) and false after; 0 if none."""
    if not rejects(0.0):
        return 0.0
    if rejects(hi):
        return hi
    lo = 0.0
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rejects(mid) else (lo, mid)
    return lo


def epsilon_lower_bound(m: int, r: int, v: int, beta: float, delta: float) -> float:
    """The largest epsilon such that (epsilon, delta)-DP is rejected at confidence 1 - beta by v of r correct."""
    return largest_rejected(lambda eps: p_value(m, r, v, eps, delta) <= beta)


# -- f-DP (Mahloujifar et al.) ------------------------------------------------------------------------------------
def tradeoff_rejects(blow_up, m: int, r: int, v: int, beta: float) -> bool:
    """Does v correct of r guesses reject "the run is f-DP" at confidence 1 - beta? The recursion of Mahloujifar et
    al. (Algorithm 'audit with cap') for a symmetric tradeoff function f, given by its inverse blow-up
    g(x) = f(1 - x) (`blow_up`): starting from the observed rates c = beta v / m (correct) and w = beta (r - v) / m
    (incorrect), push the mass of each smaller count of correct guesses through g; the claim is rejected when the
    mass left exceeds r / m. A weaker f (pointwise lower) pushes less mass: it is rejected less often."""
    if v == 0:
        return False
    correct = beta * v / m
    wrong = beta * (r - v) / m
    for i in range(v - 1, -1, -1):
        pushed = max(wrong, blow_up(correct))
        if pushed == wrong:  # neither rate changes again
            break
        correct = min(correct + (i / (r - i)) * (pushed - wrong), 1.0)
        wrong = pushed
    return correct + wrong - r / m > 0


def epsdp_rejects(eps: float, delta: float, m: int, r: int, v: int, beta: float) -> bool:
    """Does v correct of r reject (eps, delta)-DP at confidence 1 - beta? tradeoff_rejects for the (eps, delta)-DP
    tradeoff f(x) = max(0, 1 - delta - e^eps x, e^-eps (1 - delta - x)) (Dong, Roth & Su, Proposition 2.5; every
    (eps, delta)-DP mechanism is f-DP for it, whatever its privacy curve's shape)."""
    e, inv = math.exp(min(eps, 700.0)), math.exp(-eps)
    return tradeoff_rejects(lambda x: max(0.0, 1.0 - delta - e * (1.0 - x), inv * (x - delta)), m, r, v, beta)


def epsilon_lower_bound_tradeoff(m: int, r: int, v: int, beta: float, delta: float) -> float:
    """The largest epsilon such that (epsilon, delta)-DP is rejected at confidence 1 - beta by Mahloujifar et al.'s
    test: a lower bound on epsilon, like epsilon_lower_bound (Steinke et al.), from a different test."""
    return largest_rejected(lambda eps: epsdp_rejects(eps, delta, m, r, v, beta))


def gdp_rejects(mu: float, m: int, r: int, v: int, beta: float) -> bool:
    """Does v correct of r guesses reject mu-GDP at confidence 1 - beta? tradeoff_rejects for f_mu, whose inverse
    blow-up is x -> Phi(Phi^-1(x) - mu)."""
    return tradeoff_rejects(lambda x: float(ndtr(ndtri(x) - mu)), m, r, v, beta)


def mu_lower_bound(m: int, r: int, v: int, beta: float) -> float:
    """The largest mu such that mu-GDP is rejected at confidence 1 - beta (0 if even mu = 0 is not)."""
    return largest_rejected(lambda mu: gdp_rejects(mu, m, r, v, beta), hi=20.0)


def gdp_delta(mu: float, eps: float) -> float:
    """delta(eps) of mu-GDP: Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), in log space."""
    if mu <= 0:
        return 0.0
    a = stats.norm.logcdf(-eps / mu + mu / 2)
    b = eps + stats.norm.logcdf(-eps / mu - mu / 2)
    return float(math.exp(a) * -math.expm1(b - a)) if b < a else 0.0


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon of mu-GDP at delta (the smallest eps with delta(eps) <= delta)."""
    return largest_rejected(lambda eps: gdp_delta(mu, eps) > delta)


def epsilon_gdp(m: int, r: int, v: int, beta: float, delta: float) -> float:
    """The Gaussian-DP analysis as an epsilon at delta: the epsilon of the largest rejected mu. It assumes the run's
    privacy curve is Gaussian-shaped (mu-GDP); it is no lower bound on the epsilon of an (eps, delta)-DP claim
    (jax_privacy's epsilon_one_run_fdp, PrivacyGuard's FDPAnalysisNode report this number)."""
    return gdp_epsilon(mu_lower_bound(m, r, v, beta), delta)


# -- what the audit could find -------------------------------------------------------------------------------------
def guess_counts(m: int) -> list[int]:
    """The numbers of guesses the ceiling tries: a geometric grid from 1 to m (the bound is flat near its best r)."""
    return sorted({int(round(x)) for x in np.geomspace(1, max(m, 1), 24)} & set(range(1, m + 1)))


@functools.lru_cache(maxsize=64)  # a figure or a test audits many runs with the same m
def ceiling(m: int, beta: float, delta: float) -> float:
    """The largest epsilon lower bound m canaries can give: every one of r guesses correct, the best r."""
    return max((epsilon_lower_bound(m, r, r, beta, delta) for r in guess_counts(m)), default=0.0)


@functools.lru_cache(maxsize=64)
def ceiling_tradeoff(m: int, beta: float, delta: float) -> float:
    """ceiling for Mahloujifar et al.'s test of the (eps, delta)-DP tradeoff."""
    return max((epsilon_lower_bound_tradeoff(m, r, r, beta, delta) for r in guess_counts(m)), default=0.0)


@functools.lru_cache(maxsize=64)
def ceiling_gdp(m: int, beta: float, delta: float) -> float:
    """ceiling for the Gaussian-DP number (epsilon_gdp)."""
    return max((epsilon_gdp(m, r, r, beta, delta) for r in guess_counts(m)), default=0.0)
