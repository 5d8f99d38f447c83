"""`pld`: privacy-loss-distribution accounting of DP-SGD via dp-accounting (the default for exact methods).

    acc = ACCOUNTANTS.build("pld")
    acc.step(SubsampledGaussian(sample_rate=256/60000, noise_multiplier=1.3), count=3516)
    acc.epsilon(1e-5)   # -> 0.8646 (dp-accounting 0.6.0; pinned in tests/test_accountant_values.py)

Each run of identical steps in `history` becomes one SelfComposedDpEvent(PoissonSampled(Gaussian)), so composing
T steps costs one FFT power, not T convolutions. The PLD is discretised pessimistically (Connect-the-Dots), so
the reported epsilon is an upper bound up to the 1e-4 grid.

The grid spans one step's privacy loss, about 1/(2 sigma^2) + 10/sigma (dp-accounting cuts the Gaussian at ~10
sigma), so its size grows like 1/sigma^2: sigma = 1e-3 would need 5e9 points (38 GiB). `check` refuses a sigma
whose grid exceeds MAX_GRID_POINTS (sigma below ~0.028 at the 1e-4 grid) and points to `rdp`, which has no grid.
Composing T steps widens the grid too (about linearly in T: 1e9 epochs of digits would need 1e11 points, 769 GiB):
`check_composition` refuses, before the FFT, a composition of more than MAX_COMPOSED_POINTS points (jl's too).
"""
from __future__ import annotations

import functools
import math

import dp_accounting
from dp_accounting.pld import privacy_loss_distribution

from runner.accountants.base import ACCOUNTANTS, Accountant
from runner.accountants.mechanisms import SubsampledGaussian
from runner.errors import DprunError

MAX_GRID_POINTS = 1e7  # ~80 MB per array; composition holds a few of them
MAX_COMPOSED_POINTS = 5e7  # the composed PLD: ~75 bytes a point at the FFT's peak (measured 2.4 GB at 3.1e7), ~4 GB
BYTES_PER_POINT = 75


class CompositionTooLarge(DprunError):
    """A composition whose PLD would exceed MAX_COMPOSED_POINTS (raised before anything is allocated)."""


def composed_points(pld, count: int) -> int:
    """Points of `pld` self-composed `count` times, as dp-accounting sizes them (its Chernoff truncation bounds,
    dp_accounting.pld.common.compute_self_convolve_bounds: no FFT); 0 where it cannot tell (a sparse PMF)."""
    from dp_accounting.pld import common

    points = 0
    pmfs = {id(p): p for p in (getattr(pld, "_pmf_remove", None), getattr(pld, "_pmf_add", None)) if p is not None}
    for pmf in pmfs.values():
        probs = getattr(pmf, "_probs", None)
        if probs is None or count <= 1 or (len(probs) - 1) * count + 1 <= MAX_COMPOSED_POINTS:
            continue  # (the trivial bound already fits: no need to ask)
        low, high = common.compute_self_convolve_bounds(probs, int(count), 1e-15)  # self_compose's truncation
        points = max(points, high - low + 1)
    return points


def check_composition(pld, count: int, accountant: str, what: str, instead: str) -> None:
    """CompositionTooLarge (one line) when composing `count` steps of `pld` would exceed MAX_COMPOSED_POINTS."""
    points = composed_points(pld, count)
    if points > MAX_COMPOSED_POINTS:
        raise CompositionTooLarge(f"accountant={accountant} cannot compose {count} steps of {what}: its privacy-loss "
                                  f"distribution would need {points:.2g} points (~{points * BYTES_PER_POINT / 2**30:.0f}"
                                  f" GiB, at most {MAX_COMPOSED_POINTS:.0e}); {instead}")


def grid_points(sigma: float, discretization: float) -> float:
    """Points of one step's PLD grid (matches dp-accounting's allocation to ~1%: 5.1e9 at sigma=1e-3, grid 1e-4)."""
    return (0.5 / sigma ** 2 + 10 / sigma) / discretization


def smallest_sigma(discretization: float) -> float:
    """The sigma whose grid has MAX_GRID_POINTS points: 0.5 u^2 + 10 u = P d with u = 1/sigma."""
    return 1 / (-10 + math.sqrt(100 + 2 * MAX_GRID_POINTS * discretization))


def gaussian_events(history) -> list:
    """history (mechanism -> count) -> dp-accounting events, one self-composed event per distinct mechanism."""
    return [dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(m.sample_rate, dp_accounting.GaussianDpEvent(m.noise_multiplier)), n)
        for m, n in history.items()]


@ACCOUNTANTS.register("pld")
class PLDAccountant(Accountant):
    name = "pld"
    supported = (SubsampledGaussian,)

    def __init__(self, discretization: float = 1e-4):
        super().__init__()
        self.discretization = discretization

    def check(self, mechanism: SubsampledGaussian) -> None:
        sigma = mechanism.noise_multiplier
        if sigma > 0 and grid_points(sigma, self.discretization) > MAX_GRID_POINTS:  # sigma = 0: epsilon inf, no grid
            raise DprunError(f"accountant=pld cannot account sigma={sigma:g}: its privacy-loss grid would need "
                             f"{grid_points(sigma, self.discretization):.2g} points; use sigma >= "
                             f"{smallest_sigma(self.discretization):.3g} or accountant=rdp")

    def _epsilon(self, delta: float) -> float:
        """As dp-accounting's PLDAccountant composes the same events (identity, then each mechanism's one-step PLD
        self-composed count times; the same numbers, tested), with the one-step PLDs cached: a run asks for epsilon
        every epoch, and building the subsampled Gaussian's PLD was ~60% of each call (0.4 of 0.7 s)."""
        pld = privacy_loss_distribution.identity(value_discretization_interval=self.discretization)
        for m, count in self.history.items():
            if m.sample_rate == 0:  # nobody sampled: nothing released (dp-accounting skips it too)
                continue
            step = one_step_pld(m.noise_multiplier, m.sample_rate, self.discretization)
            check_composition(step, count, "pld", f"sigma={m.noise_multiplier:g} at q={m.sample_rate:.4g}",
                              "use accountant=rdp (no grid) or fewer epochs")
            pld = pld.compose(step.self_compose(count))
        return float(pld.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=32)
def one_step_pld(sigma: float, sample_rate: float, discretization: float):
    """The Poisson-subsampled Gaussian's PLD (add-or-remove neighbours, pessimistic), as dp-accounting builds it for
    PoissonSampledDpEvent(GaussianDpEvent); immutable, so shared by every accountant and call."""
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, value_discretization_interval=discretization, sampling_prob=sample_rate)
