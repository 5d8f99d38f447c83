"""Noise calibration: the smallest sigma whose epsilon after `steps` steps is at most a target, for any accountant.

    from runner.accountants import calibrate_sigma
    sigma = calibrate_sigma("pld", method.mechanism, sample_rate=256/60000, steps=3516,
                            target_epsilon=0.865, delta=1e-5)        # -> ~1.30

`mechanism_for(sample_rate)` is the method's Method.mechanism: it describes one step at the method's CURRENT sigma
(SubsampledGaussian or SubsampledJL with its r); we vary only noise_multiplier (dataclasses.replace), so the
calibration works for every mechanism that has one. epsilon(sigma) is non-increasing, so bisection on log sigma
finds it; we return the upper end of the final bracket, i.e. a sigma whose epsilon is <= target (within 1%).

    facts = check_target("pld", "gdp", method.mechanism(q), steps=3516, target_epsilon=2.0, delta=1e-5)
    # {"calibration_accountant": "gdp", "planned_epsilon": 2.9, "target_epsilon_met": False} + a logged WARNING

A sigma from a non-certified accountant (calibration_accountant=gdp: a CLT approximation that can underestimate)
can miss the target by the certified count the run publishes; check_target says so instead of leaving it to the
first epoch's numbers.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Callable

from runner.epsilon_shown import shown_epsilon, shown_noise
from runner.accountants.base import ACCOUNTANTS
from runner.accountants.mechanisms import Mechanism
from runner.accountants.pld import CompositionTooLarge
from runner.errors import DprunError

SIGMA_MIN, SIGMA_MAX = 0.05, 1000.0
log = logging.getLogger("dprun")


@functools.lru_cache(maxsize=128)  # check_target asks again for the calibrated sigma's epsilon (seconds for jl)
def epsilon_for(accountant_name: str, mechanism: Mechanism, steps: int, delta: float) -> float:
    acc = ACCOUNTANTS.build(accountant_name)
    acc.step(mechanism, count=int(steps))
    return acc.epsilon(delta)


def calibrate_sigma(accountant_name: str, mechanism_for: Callable[[float], Mechanism], sample_rate: float,
                    steps: int, target_epsilon: float, delta: float, rtol: float = 1e-3) -> float:
    template = mechanism_for(sample_rate)
    if not hasattr(template, "noise_multiplier"):
        raise DprunError(f"cannot calibrate sigma for mechanism {template.kind}: it has no noise multiplier")
    if not target_epsilon > 0:
        raise DprunError(f"target_epsilon={target_epsilon} must be > 0")
    if not ACCOUNTANTS.build(accountant_name).supports(template):  # e.g. accountant=none's pld for a JL run
        able = [n for n, cls in ACCOUNTANTS.items() if cls.certified and cls().supports(template)]
        raise DprunError(f"target_epsilon: accountant={accountant_name} cannot calibrate sigma for mechanism "
                         f"{template.kind}; set calibration_accountant={'|'.join(able) or '...'} (an accountant "
                         f"that analyses it)")

    seen: dict[float, float] = {}

    def eps(sigma: float) -> float:
        if sigma not in seen:
            mech = dataclasses.replace(template, noise_multiplier=sigma)
            seen[sigma] = epsilon_for(accountant_name, mech, steps, delta)
        return seen[sigma]

    where = f"accountant={accountant_name}, {steps} steps at q={sample_rate:.4g}, delta={delta:g}"
    lo, hi = 1.0, 1.0
    if eps(hi) > target_epsilon:  # grow sigma until the target is met
        while eps(hi) > target_epsilon:
            if hi >= SIGMA_MAX:  # SIGMA_MAX itself was tried (a target only sigma in (256, 1000] meets is met)
                best = eps(SIGMA_MAX)
                reach = "no finite epsilon" if math.isinf(best) else f"epsilon={shown_epsilon(best)} at best"
                more = (f", or a larger r (JL dimension, now {template.r}: the estimates' heavy tail does not "
                        f"shrink with sigma)" if hasattr(template, "r") else "")
                raise DprunError(f"target_epsilon={target_epsilon} is unreachable with {where}: sigma={SIGMA_MAX:g} "
                                 f"still gives {reach}; raise the target or lower the steps{more}")
            lo, hi = hi, min(hi * 4, SIGMA_MAX)
    else:  # shrink sigma while the target still holds
        while True:
            try:
                if eps(lo) > target_epsilon:
                    break
            except CompositionTooLarge:  # so little noise that its PLD is too large to compose: hi (twice lo)
                return hi  # meets the target
            lo, hi = lo / 2, lo
            if lo < SIGMA_MIN:
                return hi  # the target allows even less noise than SIGMA_MIN: use SIGMA_MIN
    while hi / lo > 1 + rtol:  # invariant: eps(lo) > target >= eps(hi)
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if eps(mid) > target_epsilon else (lo, mid)
    return hi


def check_target(accountant_name: str, calibrator: str, mechanism: Mechanism, steps: int, target_epsilon: float,
                 delta: float) -> dict[str, Any]:
    """After calibration: the certified epsilon the run publishes (`accountant_name`'s certified_epsilon: the PLD one
    for gdp) after all its planned `steps` of `mechanism` (at the calibrated sigma), and whether it meets the target;
    a WARNING naming both numbers when it does not. The dict goes into summary.json."""
    publisher = accountant_name if accountant_name in ACCOUNTANTS else calibrator  # accountant=none publishes none
    if ACCOUNTANTS.get(publisher).certified:
        planned = epsilon_for(publisher, mechanism, int(steps), delta)  # the calibrator's own: already computed
    else:
        acc = ACCOUNTANTS.build(publisher)
        acc.step(mechanism, count=int(steps))
        planned = acc.certified_epsilon(delta)
    met = planned <= target_epsilon
    if not met:
        log.warning("target_epsilon=%g is not met: sigma=%s, calibrated with accountant=%s, gives a certified "
                    "epsilon=%s after the run's %d steps (accountant=%s, the one published); calibrate with a "
                    "certified accountant (calibration_accountant=null) to meet it", target_epsilon,
                    shown_noise(mechanism.noise_multiplier), calibrator, shown_epsilon(planned), steps, publisher)
    return {"calibration_accountant": calibrator, "planned_epsilon": planned, "target_epsilon_met": met}
