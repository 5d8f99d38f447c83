"""`jl`: the f-DP analysis of DP-SGD-JL (JL paper, Theorem 4.1), computed numerically with the FULL tail of Z_r.

    acc = ACCOUNTANTS.build("jl")
    acc.step(SubsampledJL(sample_rate=256/60000, noise_multiplier=1.3, r=10), count=3516)
    acc.epsilon(1e-5)          # -> ~7.2 (Gaussian DP-SGD: 0.87); r = 1, 2, 4 -> inf (see below)
    acc.epsilon_lower_bound(1e-5)   # certified: the analysis' epsilon is larger than this

One step's PLD is built in runner/accountants/jl_pld.py (pessimistic: bins of Z_r to their upper end, heavy tail
to infinity, Connect-the-Dots on a grid of `discretization` up to `max_loss`); T identical steps are composed with
dp-accounting's FFT self-composition. Per-step PLDs and compositions are cached, so the per-epoch epsilon in the
training loop costs one FFT power.

epsilon(delta) is math.inf when the composed infinity mass (losses above `max_loss`, mostly from the tail
P(Z_r > a) ~ a^-r) exceeds delta: no finite epsilon <= max_loss is certified. epsilon_lower_bound(delta) then says
how large the analysis' epsilon really is (a certified lower bound from the tail alone; docs/privacy.md).
"""
from __future__ import annotations

import math
from functools import lru_cache

from scipy import optimize

from runner.epsilon_shown import shown_epsilon, shown_lower_bound
from runner.accountants import jl_pld
from runner.accountants.base import ACCOUNTANTS, Accountant
from runner.accountants.mechanisms import SubsampledJL
from runner.accountants.pld import check_composition
from runner.errors import DprunError


@lru_cache(maxsize=32)
def _step(q: float, sigma: float, r: int, d: float, max_loss: float):
    return jl_pld.step_pld(q, sigma, r, d, max_loss)


@lru_cache(maxsize=32)
def _infinity_mass(q: float, sigma: float, r: int, d: float, max_loss: float) -> float:
    return jl_pld.step_infinity_mass(q, sigma, r, d, max_loss)


@lru_cache(maxsize=8)
def _composed(key: tuple):
    """key: ((q, sigma, r, count), ...), d, max_loss -> the composed PLD."""
    runs, d, max_loss = key
    out = None
    for q, sigma, r, n in runs:
        step = _step(q, sigma, r, d, max_loss)
        check_composition(step, n, "jl", f"JL(r={r}) at sigma={sigma:g}, q={q:.4g}", "use fewer epochs")
        pld = step.self_compose(n)
        out = pld if out is None else out.compose(pld)
    return out


@ACCOUNTANTS.register("jl")
class JLAccountant(Accountant):
    name = "jl"
    supported = (SubsampledJL,)

    def __init__(self, discretization: float = 1e-3, max_loss: float = 64.0):
        super().__init__()
        self.discretization = float(discretization)
        self.max_loss = float(max_loss)

    def check(self, mechanism: SubsampledJL) -> None:
        # the analysis amplifies by subsampling (its losses take log(1 - q)): without subsampling it has no PLD here
        if mechanism.sample_rate >= 1:
            raise DprunError(f"accountant=jl needs a sample rate q < 1, got q={mechanism.sample_rate:g} (batch_size "
                             "equals the training set size); use a smaller batch_size")

    def _runs(self) -> tuple:
        """(q, sigma, r, count) of the steps that can release something: a step at q = 0 samples nobody (its
        privacy loss is 0; the analysis' log(q) has no value there)."""
        return tuple((m.sample_rate, m.noise_multiplier, m.r, n) for m, n in self.history.items() if m.sample_rate > 0)

    def _certainly_infinite(self, delta: float) -> bool:
        """The composed infinity mass 1 - prod (1 - m)^n already exceeds delta (cheap: no PLD is built)."""
        log_keep = sum(n * math.log1p(-_infinity_mass(q, s, r, self.discretization, self.max_loss))
                       for q, s, r, n in self._runs())
        return -math.expm1(log_keep) > delta

    def _pld(self):
        return _composed((self._runs(), self.discretization, self.max_loss))

    def _epsilon(self, delta: float) -> float:
        if not self._runs():
            return 0.0
        if self._certainly_infinite(delta):
            return math.inf
        return float(self._pld().get_epsilon_for_delta(delta))

    def delta(self, epsilon: float) -> float:
        """Pessimistic delta(epsilon) of the composition (0 when nothing is composed)."""
        if not self._runs():
            return 0.0
        return float(self._pld().get_delta_for_epsilon(epsilon))

    def epsilon_lower_bound(self, delta: float) -> float:
        """A certified lower bound on the analysis' epsilon(delta) from the tail of Z_r (0 if none found)."""
        if not self._runs():
            return 0.0
        if any(s == 0 for _, s, _, _ in self._runs()):
            return math.inf  # no noise: no finite epsilon (as epsilon() says)
        runs = [(q, s, r, n) for q, s, r, n in self._runs()]
        excess = lambda e: jl_pld.tail_lower_bound(runs, e) - delta  # noqa: E731  decreasing in e
        if excess(0.0) <= 0:
            return 0.0
        hi = 1.0
        while excess(hi) > 0 and hi < 1e15:
            hi *= 2
        if excess(hi) > 0:
            return hi
        eps = float(optimize.brentq(excess, 0.0, hi, xtol=1e-9 * hi))
        while excess(eps) <= 0:  # keep only an epsilon the bound certifies
            eps *= 0.999
        return eps

    def smallest_finite_r(self, delta: float, limit: int = 4096) -> int | None:
        """The smallest JL dimension r that, put in place of every step's r (same q, sigma and steps), leaves at most
        delta of composed infinity mass: below it epsilon(delta) is certainly inf. Cheap (no PLD is built); None when
        none up to `limit` does (sigma = 0). Scanned r = 1..64, then doubled, so it does not assume monotonicity."""
        if not self._runs() or any(s == 0 for _, s, _, _ in self._runs()):
            return None
        candidates = list(range(1, 65)) + [2**k for k in range(7, limit.bit_length())]
        return next((r for r in candidates if not self._with_r(r)._certainly_infinite(delta)), None)

    def _with_r(self, r: int) -> JLAccountant:
        """This accountant's steps (same q, sigma and counts) with every step's JL dimension set to r."""
        trial = JLAccountant(self.discretization, self.max_loss)
        for m, n in self.history.items():
            trial.step(SubsampledJL(m.sample_rate, m.noise_multiplier, r), count=n)
        return trial

    def why_infinite(self, delta: float) -> str:
        """One line for a run whose epsilon is inf: why, how far (the certified lower bound) and the smallest r that
        can give a finite epsilon with the same sigma, batch and steps (and that epsilon, one PLD: a few seconds)."""
        if any(s == 0 for _, s, _, _ in self._runs()):
            return super().why_infinite(delta)  # sigma = 0: no r helps
        rs = sorted({r for _, _, r, _ in self._runs()})
        text = (f"epsilon is inf: accountant=jl certifies no finite epsilon at delta={delta:g} for r={'/'.join(map(str, rs))} "
                f"(the analysis' epsilon is > {shown_lower_bound(self.epsilon_lower_bound(delta), 3)}): the JL norm estimate's heavy tail "
                f"(P(Z_r > a) ~ a^-r) leaves more than delta of probability to an unbounded privacy loss")
        r = self.smallest_finite_r(delta)
        if r is None:
            return text + "; no r up to 4096 gives a finite one here"
        return (text + f". r={r} is the smallest r without that (epsilon {shown_epsilon(self._with_r(r).epsilon(delta))} with this run's "
                f"sigma, batch and steps); larger r approaches exact DP-SGD (README, 'JL epsilon')")

    def extra_metrics(self, delta: float) -> dict[str, float]:
        """An infinite epsilon also gets its certified lower bound (metrics.csv, summary.json), as dprun-eps prints
        it: "inf" alone cannot be written as JSON and says nothing about how far from private the run is."""
        if not math.isinf(self.epsilon(delta)):
            return {}
        return {"epsilon_lower_bound": self.epsilon_lower_bound(delta)}
