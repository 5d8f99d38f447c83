"""DP-SBCD's noise schedule o(eta, k, j): the noise multiplier sigma_k of epoch k (0-based) of K.

The noise std on layer d is s = sigma_k * eta * S_g,d / b, i.e. o(eta, k, j) = s^2 / (2 eta), so a key step costs
alpha / (2 sigma_k^2) before the hidden-state contraction. Under the hidden state the last epochs dominate the
final loss (runner/sbcd_curves.py), so `adaptive` keeps the run's sigma in the last epoch and lowers it
geometrically towards the start, never below floor * sigma:

    sigma_k = sigma * max(decay^(K - 1 - k), floor)        (adaptive)
    sigma_k = sigma                                         (constant)

    noise_multiplier("adaptive", sigma=2.0, epoch=0, epochs=10, decay=0.9, floor=0.25)   # -> 0.775
"""
from __future__ import annotations

from runner.errors import DprunError

SCHEDULES = ("constant", "adaptive")


def noise_multiplier(schedule: str, *, sigma: float, epoch: int, epochs: int, decay: float = 0.9,
                     floor: float = 0.25) -> float:
    if schedule == "constant":
        return sigma
    if schedule == "adaptive":
        if not (0 < decay <= 1 and 0 < floor <= 1):
            raise DprunError(f"method.noise_decay={decay} and method.noise_floor={floor} must be in (0, 1]")
        return sigma * max(decay ** max(epochs - 1 - epoch, 0), floor)
    raise DprunError(f"unknown method.noise_schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
