"""rdp / pld / gdp: pinned values and independent cross-checks (Opacus RDP, Microsoft prv-accountant)."""
import math

import pytest

from runner.accountants import ACCOUNTANTS, SubsampledGaussian
from runner.accountants.gdp import gdp_delta, gdp_epsilon

Q, SIGMA, STEPS = 256 / 60000, 1.3, round(15 * 60000 / 256)  # the JL paper's MNIST setting: 3516 steps


def eps(name, q=Q, sigma=SIGMA, steps=STEPS, delta=1e-5):
    acc = ACCOUNTANTS.build(name)
    acc.step(SubsampledGaussian(q, sigma), count=steps)
    return acc.epsilon(delta)


def test_pinned_values_dp_accounting_0_6():
    assert eps("pld") == pytest.approx(0.865, abs=6e-4)
    assert eps("rdp") == pytest.approx(0.955, abs=6e-4)


def test_batched_history_equals_step_by_step():
    a, b = ACCOUNTANTS.build("rdp"), ACCOUNTANTS.build("rdp")
    a.step(SubsampledGaussian(0.02, 1.1), count=50)
    for _ in range(50):
        b.step(SubsampledGaussian(0.02, 1.1))
    assert a.epsilon(1e-5) == b.epsilon(1e-5)


def test_rdp_matches_opacus():
    RDPAccountant = pytest.importorskip("opacus.accountants", reason="pip install 'dprun[peers]'").RDPAccountant
    ref = RDPAccountant()
    ref.history = [(SIGMA, Q, STEPS)]
    assert eps("rdp") == pytest.approx(ref.get_epsilon(1e-5), rel=0.01)


def test_pld_inside_prv_accountant_bounds():
    from prv_accountant import PRVAccountant, PoissonSubsampledGaussianMechanism
    prv = PRVAccountant(prvs=PoissonSubsampledGaussianMechanism(sampling_probability=Q, noise_multiplier=SIGMA),
                        max_self_compositions=STEPS, eps_error=0.01, delta_error=1e-9)
    low, _, up = prv.compute_epsilon(delta=1e-5, num_self_compositions=STEPS)
    assert low - 0.01 <= eps("pld") <= up + 0.01


def test_mixed_steps_compose():
    acc = ACCOUNTANTS.build("pld")
    acc.step(SubsampledGaussian(0.01, 1.0), count=100)
    acc.step(SubsampledGaussian(0.01, 2.0), count=100)
    assert eps("pld", 0.01, 2.0, 200) < acc.epsilon(1e-5) < eps("pld", 0.01, 1.0, 200)


def test_gdp_formula_and_approximation():
    mu = Q * math.sqrt(STEPS * math.expm1(1 / SIGMA ** 2))
    e = gdp_epsilon(mu, 1e-5)
    assert gdp_delta(e, mu) == pytest.approx(1e-5, rel=1e-6)
    assert eps("gdp") == pytest.approx(e)
    assert ACCOUNTANTS.get("gdp").approximate and not ACCOUNTANTS.get("pld").approximate
    assert eps("gdp") == pytest.approx(eps("pld"), rel=0.1)  # the CLT is close here, and below the exact value


def test_pld_with_cached_one_step_plds_equals_dp_accountings_own_accountant():
    """runner/accountants/pld.py composes the events itself around cached one-step PLDs: the very same epsilon as
    dp-accounting's PLDAccountant fed the same events (bit for bit), also for mixed and unsampled steps, and a
    second run of the same mechanism reuses the cache."""
    from dp_accounting.pld import pld_privacy_accountant

    from runner.accountants.pld import gaussian_events, one_step_pld

    histories = [{SubsampledGaussian(256 / 60000, 1.1): 2340},
                 {SubsampledGaussian(0.01, 0.8): 100, SubsampledGaussian(0.02, 1.5): 50},
                 {SubsampledGaussian(0.0, 1.0): 3, SubsampledGaussian(0.1, 2.0): 7}]
    for history in histories:
        ours = ACCOUNTANTS.build("pld")
        for mechanism, count in history.items():
            ours.step(mechanism, count=count)
        reference = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
        for event in gaussian_events(history):
            reference.compose(event)
        for delta in (1e-5, 1e-3):
            assert ours.epsilon(delta) == reference.get_epsilon(delta)
    hits = one_step_pld.cache_info().hits
    again = ACCOUNTANTS.build("pld")
    again.step(SubsampledGaussian(256 / 60000, 1.1), count=10)
    again.epsilon(1e-5)
    assert one_step_pld.cache_info().hits == hits + 1


def test_privacy_notes_name_the_neighbouring_relation_where_it_differs_and_a_diverged_status():
    """hsa's epsilon (DP-SBCD) is for one record replaced, the others' for one added or removed: the same column, two
    privacy units (stop 55's review); every run's notes say a `diverged` status depends on the data."""
    from runner.accountants import ACCOUNTANTS
    from runner.accountants.published import privacy_notes

    hsa = privacy_notes(ACCOUNTANTS.build("hsa"), "fixed")
    pld = privacy_notes(ACCOUNTANTS.build("pld"), "poisson")
    assert any(n.startswith("neighbouring datasets: accountant=hsa's epsilon (DP-SBCD) is for one record replaced")
               for n in hsa)
    assert not any(n.startswith("neighbouring datasets") for n in pld)
    assert any("`diverged` status" in n for n in pld)
