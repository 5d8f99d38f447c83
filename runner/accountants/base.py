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
    # certified: epsilon() upper-bounds the privacy loss of the mechanism as implemented, so a run may publish it as
    # its `epsilon`. A non-certified accountant (gdp: a CLT approximation; hsa: a bound under assumptions the
    # implemented step does not meet) names a certified fallback in certified_epsilon(), and its own number is
    # published only in the labelled column epsilon_<label> (runner/accountants/published.py).
    certified: ClassVar[bool] = True
    label: ClassVar[str] = ""  # column suffix for a non-certified accountant's own number, e.g. "gdp_approx"
    assumes_sampling: ClassVar[str] = "poisson"  # the batch sampling its analysis assumes (runner/data/sampler.py)

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

    def why_infinite(self, delta: float) -> str:
        """One line for a run whose epsilon(delta) is inf (the CLI's last lines, summary.json's epsilon_note)."""
        if any(getattr(m, "noise_multiplier", None) == 0 for m in self.history):
            return "epsilon is inf: sigma=0 adds no noise, so the clipped sums are released exactly (no privacy)"
        return f"epsilon is inf: accountant={self.name} certifies no finite epsilon at delta={delta:g} for these steps"

    def extra_metrics(self, delta: float) -> dict[str, float]:
        """Extra per-epoch columns for metrics.csv (jl: the certified lower bound where epsilon is inf)."""
        return {}

    def certified_epsilon(self, delta: float) -> float:
        """An epsilon that holds for the implemented mechanism: epsilon() itself if this accountant is certified;
        a non-certified accountant overrides this with a certified computation over the same steps."""
        if not self.certified:
            raise NotImplementedError(f"accountant {self.name!r} is not certified and names no certified fallback")
        return self.epsilon(delta)
