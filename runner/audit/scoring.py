"""Canary scores -> guesses -> the audit's counts and bounds, without letting the choice of guesses inflate them.

The auditor guesses the k+ highest-scoring canaries "in" and the k- lowest "out" and abstains on the rest. Choosing
k+ and k- by looking at which guesses turned out correct would be a search over hypotheses, paid for nowhere. So the
canaries are split at random (a fixed, seeded permutation) into two halves:

    selection half   its inclusion bits pick the fractions (k+/m, k-/m) with the best bound on that half
    bound half       the same fractions applied to its own scores; its counts alone give the reported bounds, with
                     m = the half's size (the selection half's bits are independent of the bound half's: fixed data
                     for the analysis, and the guesses are a post-processing of the run's output)

    result = audit_scores(scores, included, beta=0.05, delta=1e-5, seed=0)   # scores: (m,), higher = more "in"
    result.epsilon_lower_bound, result.epsilon_lower_bound_fdp, result.ceiling, result.guesses, result.correct
    result.rejects(claimed_epsilon)   # the audit's verdict: does either test refute (claimed, delta)-DP?

Three analyses, each with its own fractions (chosen on the selection half): Steinke et al.'s test and Mahloujifar et
al.'s test of the (eps, delta)-DP tradeoff curve are tests of an (eps, delta) claim, each a false rejection with
probability <= beta; `rejects` uses both, so a run that has its claimed (eps, delta) is flagged with probability
<= 2 beta (a union bound). The Gaussian-DP number (epsilon_gdp) is reported beside them and never flags: it refutes
mu-GDP only, and a run that is (eps, delta)-DP but not mu-GDP-shaped (randomized response) often exceeds eps there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from runner.audit import bounds

# the fractions of a half guessed "in" (top scores) and "out" (bottom scores); the selection half picks one pair
FRACTIONS_IN = (0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5)
FRACTIONS_OUT = (0.0, 0.01, 0.05, 0.1, 0.2, 0.35, 0.5)


@dataclass
class AuditResult:
    canaries: int  # m, all of them
    scored: int  # the bound half's size: the m in the bounds
    guesses: int  # r on the bound half (Steinke et al.'s fractions)
    correct: int  # v on the bound half
    epsilon_lower_bound: float  # Steinke et al.: a lower bound on epsilon at confidence 1 - beta
    epsilon_lower_bound_fdp: float  # Mahloujifar et al. on the (eps, delta)-DP tradeoff: a lower bound too
    epsilon_gdp: float  # Mahloujifar et al. for Gaussian DP, converted at delta: assumes a Gaussian-shaped curve
    mu_lower_bound: float  # the largest mu whose mu-GDP is rejected
    ceiling: float  # Steinke et al. with every guess right (the best r), on the bound half
    ceiling_fdp: float
    ceiling_gdp: float
    fraction_in: float
    fraction_out: float
    guesses_fdp: int = 0  # r, v at the (eps, delta)-tradeoff test's fractions
    correct_fdp: int = 0
    beta: float = 0.05
    delta: float = 0.0

    def rejects(self, claimed: float | None) -> bool:
        """Does the audit refute (claimed, delta)-DP: Steinke et al.'s p-value <= beta, or Mahloujifar et al.'s test of
        the claimed (eps, delta) tradeoff curve rejecting it? Probability <= 2 beta for a run that has its claim."""
        if claimed is None or math.isinf(claimed):  # nothing claimed, or nothing to refute
            return False
        steinke = self.guesses > 0 and bounds.p_value(self.scored, self.guesses, self.correct, claimed,
                                                       self.delta) <= self.beta
        return steinke or bounds.epsdp_rejects(claimed, self.delta, self.scored, self.guesses_fdp, self.correct_fdp,
                                               self.beta)


def guesses(scores: np.ndarray, k_in: int, k_out: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices guessed in, indices guessed out): the k_in highest and the k_out lowest scores (disjoint)."""
    order = np.argsort(scores, kind="stable")  # ascending
    k_in, k_out = min(k_in, len(order)), min(k_out, max(len(order) - k_in, 0))
    return order[len(order) - k_in:], order[:k_out]


def counts(scores: np.ndarray, included: np.ndarray, f_in: float, f_out: float) -> tuple[int, int]:
    """(r, v): guesses made and guesses correct with the fractions f_in, f_out of len(scores)."""
    m = len(scores)
    g_in, g_out = guesses(scores, int(round(f_in * m)), int(round(f_out * m)))
    return len(g_in) + len(g_out), int(included[g_in].sum() + (~included[g_out]).sum())


def best_fractions(scores: np.ndarray, included: np.ndarray, beta: float, delta: float, bound) -> tuple[float, float]:
    """The (f_in, f_out) with the largest `bound(m, r, v, beta, delta)` on these canaries (the selection half)."""
    m, best, pick = len(scores), -1.0, (FRACTIONS_IN[0], 0.0)
    for f_in in FRACTIONS_IN:
        for f_out in FRACTIONS_OUT:
            if f_in + f_out > 1:
                continue
            r, v = counts(scores, included, f_in, f_out)
            if r == 0 or v / r <= 0.5:  # no better than a coin: bound 0, skip the search
                continue
            value = bound(m, r, v, beta, delta)
            if value > best:
                best, pick = value, (f_in, f_out)
    return pick


def audit_scores(scores, included, *, beta: float, delta: float, seed: int = 0) -> AuditResult:
    """The audit of one run: scores (m,) with higher meaning "in", included (m,) the canaries' true bits."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    m = len(scores)
    perm = np.random.default_rng(seed).permutation(m)
    select, held = perm[: m // 2], perm[m // 2:]
    f_in, f_out = best_fractions(scores[select], included[select], beta, delta, bounds.epsilon_lower_bound)
    r, v = counts(scores[held], included[held], f_in, f_out)
    r_fdp, v_fdp = counts(scores[held], included[held],
                          *best_fractions(scores[select], included[select], beta, delta,
                                          bounds.epsilon_lower_bound_tradeoff))
    r_gdp, v_gdp = counts(scores[held], included[held],
                          *best_fractions(scores[select], included[select], beta, delta, bounds.epsilon_gdp))
    n = len(held)
    mu = bounds.mu_lower_bound(n, r_gdp, v_gdp, beta) if r_gdp else 0.0
    return AuditResult(
        canaries=m, scored=n, guesses=r, correct=v,
        epsilon_lower_bound=bounds.epsilon_lower_bound(n, r, v, beta, delta) if r else 0.0,
        epsilon_lower_bound_fdp=bounds.epsilon_lower_bound_tradeoff(n, r_fdp, v_fdp, beta, delta) if r_fdp else 0.0,
        epsilon_gdp=bounds.gdp_epsilon(mu, delta), mu_lower_bound=mu,
        ceiling=bounds.ceiling(n, beta, delta), ceiling_fdp=bounds.ceiling_tradeoff(n, beta, delta),
        ceiling_gdp=bounds.ceiling_gdp(n, beta, delta), fraction_in=f_in, fraction_out=f_out,
        guesses_fdp=r_fdp, correct_fdp=v_fdp, beta=beta, delta=delta)
