"""Descriptions of one training step's privacy mechanism, as told to an accountant.

A method returns one of these per step; the accountant composes them. They are plain frozen
dataclasses so that equal steps compare equal (accountants batch runs of identical steps) and so
that they serialise to the run log (`asdict`).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from runner.errors import DprunError


@dataclass(frozen=True)
class Mechanism:
    """Base class. `kind` names the mechanism in logs and error messages."""

    @property
    def kind(self) -> str:
        return type(self).__name__


def check_rate_and_sigma(q: float, sigma: float) -> None:
    """Refused here, so that no accountant ever composes a step whose q is not a probability or sigma a noise level."""
    if not 0 <= q <= 1:
        raise DprunError(f"sample rate q={q} must be in [0, 1]")
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise DprunError(f"sigma={sigma} must be a finite number >= 0")


@dataclass(frozen=True)
class SubsampledGaussian(Mechanism):
    """DP-SGD step: Poisson sampling at rate q, per-example clipping to C, noise N(0, (sigma*C)^2 I) on the sum."""

    sample_rate: float  # q = expected batch size / N
    noise_multiplier: float  # sigma

    def __post_init__(self):
        check_rate_and_sigma(self.sample_rate, self.noise_multiplier)


@dataclass(frozen=True)
class SubsampledJL(Mechanism):
    """DP-SGD-JL step (JL paper, Algorithm 1 / Theorem 4.1): like SubsampledGaussian but the clip factor uses a
    norm estimate from r Gaussian projections, so the sensitivity is C * Z_r with Z_r = 1/sqrt(chi^2_r / r)."""

    sample_rate: float
    noise_multiplier: float
    r: int

    def __post_init__(self):
        check_rate_and_sigma(self.sample_rate, self.noise_multiplier)
        if not (isinstance(self.r, numbers.Integral) and self.r >= 1):
            raise DprunError(f"r={self.r!r} must be an integer >= 1 (the number of JL projections)")


@dataclass(frozen=True)
class HiddenStateStep(Mechanism):
    """One DP-SBCD step (runner/methods/sbcd/), accounted by accountant=hsa: batch `batch` (of `num_batches` fixed
    batches) of epoch `epoch`; per layer d = 0..D the noise std s_d, the shift eta * S_g,d / b (how far the key
    example can move the gradient map) and L_F, L_T. Built by runner/methods/sbcd/bounds.hidden_state_step only."""

    epoch: int
    batch: int
    num_batches: int
    batch_size: int
    n: int
    noise_std: tuple[float, ...]
    shift: tuple[float, ...]
    lipschitz_grad: tuple[float, ...]
    lipschitz_prox: tuple[float, ...]
    normalisation: str = "project"


@dataclass(frozen=True)
class NoPrivacy(Mechanism):
    """A non-private step: no accountant supports it."""
