"""The accountant interface: told each step's mechanism, answers epsilon(delta).

    acc = ACCOUNTANTS.build("pld")
    acc.step(SubsampledGaussian(sample_rate=256/60000, noise_multiplier=1.3), count=3516)
    acc.epsilon(1e-5)   # -> ~0.865

Contract (tests/test_accountant_contract.py): no steps -> epsilon 0; an unsupported mechanism raises
UnsupportedMechanism (never a number for the wrong mechanism); epsilon is non-decreasing in the steps; a step with
noise multiplier 0 (no noise) -> epsilon inf, for every accountant. A mechanism the analysis or its numerics cannot
handle (jl at q = 1, pld at a tiny sigma) is refused by `check` with a one-line DprunError when it is first told.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import ClassVar

from runner.accountants.mechanisms import Mechanism
from runner.errors import DprunError
from runner.registry import Registry

ACCOUNTANTS = Registry("accountant")


class UnsupportedMechanism(DprunError):
    pass


class Accountant:
    """Subclasses set `name`, `supported` (mechanism classes) and implement `_epsilon(delta)` over `self.history`."""

    name: ClassVar[str] = "base"
    supported: ClassVar[tuple[type, ...]] = ()
    approximate: ClassVar[bool] = False  # True: may underestimate (logged as such)

    def __init__(self):
        # mechanism -> number of steps; insertion-ordered so composition order is kept where it matters
        self.history: Counter[Mechanism] = Counter()

    def supports(self, mechanism: Mechanism) -> bool:
        return isinstance(mechanism, self.supported)

    def step(self, mechanism: Mechanism, count: int = 1) -> None:
        if not self.supports(mechanism):
            ok = ", ".join(c.__name__ for c in self.supported)
            raise UnsupportedMechanism(
                f"accountant {self.name!r} does not support mechanism {mechanism.kind} ({mechanism}); it supports: {ok}"
            )
        if count < 0:
            raise ValueError("count must be >= 0")
        self.check(mechanism)
        if count:
            self.history[mechanism] += count

    def check(self, mechanism: Mechanism) -> None:
        """Raise DprunError (one line) for a supported mechanism this accountant still cannot compute."""

    @property
    def steps(self) -> int:
        return sum(self.history.values())

    def epsilon(self, delta: float) -> float:
        if not 0 < delta < 1:
            raise DprunError(f"delta must be in (0, 1), got {delta}")
        if self.steps == 0:
            return 0.0
        if any(getattr(m, "noise_multiplier", None) == 0 for m in self.history):
            return math.inf  # a noiseless step releases its clipped sum exactly: no finite epsilon
        return self._epsilon(delta)

    def _epsilon(self, delta: float) -> float:
        raise NotImplementedError

    def extra_metrics(self, delta: float) -> dict[str, float]:
        """Extra per-epoch columns for metrics.csv (hsa: the composition baseline's epsilon)."""
        return {}
