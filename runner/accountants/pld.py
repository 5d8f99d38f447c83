"""`pld`: privacy-loss-distribution accounting of DP-SGD via dp-accounting (the default for exact methods).

    acc = ACCOUNTANTS.build("pld")
    acc.step(SubsampledGaussian(sample_rate=256/60000, noise_multiplier=1.3), count=3516)
    acc.epsilon(1e-5)   # -> 0.8646 (dp-accounting 0.6.0; pinned in tests/test_accountant_values.py)

Each run of identical steps in `history` becomes one SelfComposedDpEvent(PoissonSampled(Gaussian)), so composing
T steps costs one FFT power, not T convolutions. The PLD is discretised pessimistically (Connect-the-Dots), so
the reported epsilon is an upper bound up to the 1e-4 grid.
"""
from __future__ import annotations

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant

from runner.accountants.base import ACCOUNTANTS, Accountant
from runner.accountants.mechanisms import SubsampledGaussian


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

    def _epsilon(self, delta: float) -> float:
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=self.discretization)
        for event in gaussian_events(self.history):
            acc.compose(event)
        return float(acc.get_epsilon(delta))
