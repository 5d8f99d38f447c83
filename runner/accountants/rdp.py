"""`rdp`: Renyi-DP accounting of DP-SGD via dp-accounting (Mironov et al. 2019 for the subsampled Gaussian).

    acc = ACCOUNTANTS.build("rdp")
    acc.step(SubsampledGaussian(sample_rate=256/60000, noise_multiplier=1.3), count=3516)
    acc.epsilon(1e-5)   # -> 0.9546 (dp-accounting 0.6.0), looser than pld's 0.8646

RDP composes exactly (orders add) but converting to (epsilon, delta) is lossy, so rdp >= pld for DP-SGD.
"""
from __future__ import annotations

from dp_accounting.rdp import rdp_privacy_accountant

from runner.accountants.base import ACCOUNTANTS, Accountant
from runner.accountants.mechanisms import SubsampledGaussian
from runner.accountants.pld import gaussian_events


@ACCOUNTANTS.register("rdp")
class RDPAccountant(Accountant):
    name = "rdp"
    supported = (SubsampledGaussian,)

    def _epsilon(self, delta: float) -> float:
        acc = rdp_privacy_accountant.RdpAccountant()
        for event in gaussian_events(self.history):
            acc.compose(event)
        return float(acc.get_epsilon(delta))
