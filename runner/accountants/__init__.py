"""Privacy accountants, one file each, behind runner.accountants.base.Accountant.

    from runner import accountants
    acc = accountants.build("pld")                  # rdp, pld, gdp, jl, hsa (DP-SBCD)
    acc.step(SubsampledGaussian(0.004, 1.3), count=3516); acc.epsilon(1e-5)
    accountants.calibrate_sigma("pld", method.mechanism, 0.004, 3516, target_epsilon=1.0, delta=1e-5)

Modules are imported explicitly here (not discovered), and tests/test_accountant_contract.py checks that every
name in conf/accountant/ is registered, so a file cannot silently drop out.
"""
from __future__ import annotations

from runner.accountants.base import ACCOUNTANTS, Accountant, UnsupportedMechanism  # noqa: F401
from runner.accountants.mechanisms import (HiddenStateStep, Mechanism, NoPrivacy, SubsampledGaussian,  # noqa: F401
                                         SubsampledJL)
from runner.accountants import gdp, hsa, jl, pld, rdp  # noqa: F401,E402  (each registers its accountant)
from runner.accountants.calibrate import calibrate_sigma, check_target  # noqa: F401,E402
from runner.errors import DprunError  # noqa: E402


NON_ACCOUNTANT_NAMES = ("auto", "none")


def resolve_name(name: str, method) -> str:
    """`auto` -> the method's default accountant (pld for exact DP-SGD, jl for JL, hsa for DP-SBCD)."""
    if name == "auto":
        return method.default_accountant
    if name != "none" and name not in ACCOUNTANTS:
        ACCOUNTANTS.get(name)  # raises the one-line "unknown accountant" error
    return name


def calibration_accountant(run_accountant: str, requested: str | None = None) -> str:
    """The accountant that picks sigma for target_epsilon: the run's own if it is certified, else pld (gdp's CLT can
    underestimate, so calibrating with it would publish a target it does not meet), and pld for accountant=none
    (which publishes no epsilon: the target is still met, by pld's count). `requested` (the calibration_accountant
    knob) overrides this explicitly."""
    if requested not in (None, "", "auto"):
        return resolve_name(str(requested), None)
    if run_accountant == "none":
        return "pld"
    return run_accountant if ACCOUNTANTS.get(run_accountant).certified else "pld"


def build(name: str) -> Accountant | None:
    return None if name == "none" else ACCOUNTANTS.build(name)


def check_for_method(accountant: Accountant, method, sample_rate: float) -> None:
    """Before training (the CLI and make_private alike): the accountant analyses the method's mechanism, else a
    one-line error naming the method's own accountant, and can compute it (`check`: jl at q = 1, pld at a tiny
    sigma)."""
    mechanism = method.mechanism(sample_rate)
    if not accountant.supports(mechanism):
        if accountant.name == method.default_accountant:  # the method's own: not "try" it, say why it cannot
            try:
                accountant.step(mechanism, count=0)  # (records nothing) its own reason, e.g. hsa's normalisation
            except DprunError as e:
                raise DprunError(f"method={method.name}: {e}; no other accountant here analyses this mechanism") \
                    from None
        raise DprunError(f"accountant={accountant.name} does not support method={method.name}'s mechanism "
                         f"{mechanism.kind}; try accountant={method.default_accountant}")
    accountant.check(mechanism)
