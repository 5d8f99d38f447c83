"""`gdp`: the central-limit (Gaussian-DP) approximation of Bu et al. 2019. Approximate: it can UNDERestimate.

    acc = ACCOUNTANTS.build("gdp")
    acc.step(SubsampledGaussian(sample_rate=256/60000, noise_multiplier=1.3), count=3516)
    acc.epsilon(1e-5)   # ~0.8

T steps of the Poisson-subsampled Gaussian at rate q are approximately mu-GDP with
    mu = q sqrt(T (e^{1/sigma^2} - 1))          (mu^2 adds over runs of different steps),
and mu-GDP is (eps, delta)-DP on the curve delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2),
which is decreasing in eps; we solve it for eps. The CLT is only a limit (q sqrt(T) fixed, T -> infinity) and
not an upper bound: on digits, 2 epochs, a gdp-calibrated target of 2 is certified only at eps >= 3.27. So gdp is
never published as a run's `epsilon`: runs publish the PLD epsilon of the same steps (certified_epsilon) and put
gdp's number in the column `epsilon_gdp_approx`; sigma calibration uses PLD unless calibration_accountant=gdp.
"""
from __future__ import annotations

import math

from scipy import optimize, special

from runner.accountants.base import ACCOUNTANTS, Accountant
from runner.accountants.mechanisms import SubsampledGaussian


def gdp_mu(history) -> float:
    """inf when e^{1/sigma^2} overflows (sigma < ~0.038): no useful guarantee, and never an OverflowError."""
    try:
        return math.sqrt(sum(n * m.sample_rate ** 2 * math.expm1(1.0 / m.noise_multiplier ** 2)
                             for m, n in history.items()))
    except OverflowError:
        return math.inf


def gdp_delta(eps: float, mu: float) -> float:
    # e^eps Phi(-eps/mu - mu/2) in logs: e^eps overflows long before the product does
    return float(special.ndtr(-eps / mu + mu / 2) - math.exp(eps + special.log_ndtr(-eps / mu - mu / 2)))


def gdp_epsilon(mu: float, delta: float) -> float:
    if math.isinf(mu):
        return math.inf
    if mu == 0 or gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(hi, mu) > delta:
        hi *= 2
    return float(optimize.brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-10))


@ACCOUNTANTS.register("gdp")
class GDPAccountant(Accountant):
    name = "gdp"
    supported = (SubsampledGaussian,)
    approximate = True
    certified = False
    label = "gdp_approx"

    def _epsilon(self, delta: float) -> float:
        return gdp_epsilon(gdp_mu(self.history), delta)

    def certified_epsilon(self, delta: float) -> float:
        """The PLD epsilon of the same steps (dp-accounting's PLD composition: an upper bound)."""
        pld = ACCOUNTANTS.build("pld")
        for mechanism, count in self.history.items():
            pld.step(mechanism, count)
        return pld.epsilon(delta)
