"""The contract every registered accountant passes: no steps -> 0, unsupported -> raises, monotone in steps."""
from pathlib import Path

import pytest

from runner import accountants
from runner.accountants import (ACCOUNTANTS, HiddenStateStep, NoPrivacy, SubsampledGaussian, SubsampledJL,
                                UnsupportedMechanism)

CONF = Path(__file__).resolve().parents[1] / "conf" / "accountant"


def examples() -> list:
    """One small step of every mechanism kind an accountant may support (cheap to account)."""
    return [SubsampledGaussian(sample_rate=0.01, noise_multiplier=2.0),
            SubsampledJL(sample_rate=0.01, noise_multiplier=2.0, r=200),
            HiddenStateStep(epoch=0, batch=0, num_batches=4, batch_size=16, n=64, noise_std=(1.0,), shift=(0.1,),
                            lipschitz_grad=(0.9,), lipschitz_prox=(1.0,))]


def test_every_config_name_is_registered():
    conf = {p.stem for p in CONF.glob("*.yaml")} - set(accountants.NON_ACCOUNTANT_NAMES)
    assert conf == set(ACCOUNTANTS.names())


@pytest.mark.parametrize("name", ACCOUNTANTS.names())
def test_contract(name):
    acc = ACCOUNTANTS.build(name)
    assert acc.epsilon(1e-5) == 0.0  # no steps
    with pytest.raises(UnsupportedMechanism):
        acc.step(NoPrivacy())
    supported = [m for m in examples() if acc.supports(m)]
    assert supported, f"add an example mechanism for accountant {name!r} to tests/test_accountant_contract.py"
    for m in examples():
        if not acc.supports(m):
            with pytest.raises(UnsupportedMechanism):
                acc.step(m)
    assert acc.steps == 0  # a refused step is not recorded
    previous = 0.0
    for _ in range(3):  # 1, 3, 9 steps
        acc.step(supported[0], count=max(1, 2 * acc.steps))
        eps = acc.epsilon(1e-5)
        assert eps >= previous - 1e-9 and eps > 0
        previous = eps


def test_unknown_name_and_bad_delta_are_one_line_errors():
    from runner.errors import DprunError
    with pytest.raises(DprunError, match="did you mean 'pld'"):
        accountants.build("pdl")
    acc = accountants.build("pld")
    acc.step(SubsampledGaussian(0.01, 1.0))
    with pytest.raises(DprunError, match="delta must be in"):
        acc.epsilon(0.0)


NOISELESS = (SubsampledGaussian(sample_rate=0.01, noise_multiplier=0.0),
             SubsampledJL(sample_rate=0.01, noise_multiplier=0.0, r=4))
WITH_SIGMA = [n for n in ACCOUNTANTS.names() if any(ACCOUNTANTS.build(n).supports(m) for m in NOISELESS)]


def test_the_noise_multiplier_accountants_are_most_of_them():
    assert {"pld", "rdp", "gdp", "jl"} <= set(WITH_SIGMA)


@pytest.mark.parametrize("name", WITH_SIGMA)
def test_a_noiseless_step_is_inf_and_says_why(name):
    """sigma = 0 releases the clipped sum exactly: every accountant answers inf, and the line a run ends with
    (why_infinite, summary.json's epsilon_note) names sigma=0, not the accountant's numerics."""
    acc = ACCOUNTANTS.build(name)
    acc.step(next(m for m in NOISELESS if acc.supports(m)), count=3)
    assert acc.epsilon(1e-5) == float("inf")
    assert acc.why_infinite(1e-5).startswith("epsilon is inf: sigma=0 adds no noise")
