"""The hidden-state accountant: the PABI bound is the optimum of its shift allocation, and behaves as the slides say."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from scipy.optimize import minimize

from runner.accountants import ACCOUNTANTS, SubsampledGaussian, UnsupportedMechanism
from runner.accountants.hsa import HiddenStateAccountant
from runner.accountants.hsa_bound import composition_cost, pabi_cost, pabi_step_costs, shift_weights
from runner.sbcd_curves import CurveSetup, run_steps


def brute_force_cost(shift, s, lf, lt, key):
    """min sum a_t^2/(2 s_t^2) over a >= 0 with z_{t+1} = L_T (L_F z_t + shift_t key_t - a_t) >= 0, z_0 = z_T = 0."""
    T = len(s)

    def z(a):
        out, zt = [], 0.0
        for t in range(T):
            zt = lt[t] * (lf[t] * zt + shift[t] * key[t] - a[t])
            out.append(zt)
        return np.array(out)

    cons = [{"type": "ineq", "fun": lambda a: z(a)[:-1]}, {"type": "eq", "fun": lambda a: z(a)[-1]}]
    res = minimize(lambda a: np.sum(a ** 2 / (2 * s ** 2)), shift * key, method="SLSQP", bounds=[(0, None)] * T,
                   constraints=cons, options={"ftol": 1e-14, "maxiter": 500})
    assert res.success
    return res.fun


@pytest.mark.parametrize("seed", range(4))
def test_hull_cost_is_the_optimal_shift_allocation(seed):
    rng = np.random.default_rng(seed)
    T = 9
    shift, s = rng.uniform(0.5, 2, T), rng.uniform(0.5, 2, T)
    lf, lt = rng.uniform(0.7, 1.0, T), rng.uniform(0.7, 1.0, T)
    key = rng.random(T) < 0.4
    key[rng.integers(T)] = True
    assert pabi_cost(shift, s, lf, lt, key) == pytest.approx(brute_force_cost(shift, s, lf, lt, key), rel=1e-5)
    assert pabi_step_costs(shift, s, lf, lt, key).sum() == pytest.approx(pabi_cost(shift, s, lf, lt, key), rel=1e-9)


def test_single_key_closed_forms():
    T, c, sh, s = 6, 0.8, 1.3, 0.9
    ones = np.ones(T)
    last = np.eye(T, dtype=bool)[-1]
    # key at the last step: the Gaussian mechanism, as in composition
    assert pabi_cost(sh * ones, s * ones, c * ones, ones, last) == pytest.approx(sh ** 2 / (2 * s ** 2))
    first = np.eye(T, dtype=bool)[0]  # key first, m = T-1 later steps: c^{2m} (1-c^2) / (1-c^{2(m+1)})
    expect = sh ** 2 / (2 * s ** 2) * c ** (2 * (T - 1)) * (1 - c ** 2) / (1 - c ** (2 * T))
    assert pabi_cost(sh * ones, s * ones, c * ones, ones, first) == pytest.approx(expect)
    assert shift_weights(c * ones, ones)[-1] == 1.0


def eps(setup, epochs=None, kind="hidden"):
    acc = HiddenStateAccountant()
    for m in run_steps(setup, epochs):
        acc.step(m)
    return acc.epsilon(setup.delta) if kind == "hidden" else acc.epsilon_composition(setup.delta)


SMALL = CurveSetup(n=1000, batch_size=100, epochs=40, sigma=2.0, reg_lambda=0.1)


def test_epsilon_grows_with_appearances_and_falls_with_noise():
    no_decay = replace(SMALL, reg="none")  # L_F L_T = 1: no contraction, every appearance adds
    e = [eps(no_decay, k) for k in (1, 2, 4, 8)]
    assert all(a < b for a, b in zip(e, e[1:]))
    assert eps(replace(SMALL, sigma=4.0)) < eps(SMALL) < eps(replace(SMALL, sigma=1.0))


def test_epsilon_converges_with_contraction_while_composition_grows_linearly():
    assert SMALL.eta * SMALL.reg_lambda > 0  # L_T = 1/(1 + eta lambda) < 1
    h20, h40 = eps(SMALL, 20), eps(SMALL, 40)
    assert h40 == pytest.approx(h20, rel=1e-6)
    acc = HiddenStateAccountant()
    for m in run_steps(SMALL, 10):
        acc.step(m)
    c10 = acc.costs("composition")[0]
    for m in run_steps(SMALL)[len(acc.sequence):len(acc.sequence) * 2]:
        acc.step(m)
    np.testing.assert_allclose(acc.costs("composition")[0], 2 * c10)  # RDP linear in the epochs
    assert eps(SMALL, 40, "composition") > 3 * eps(SMALL, 40)


@pytest.mark.parametrize("setup", [SMALL, replace(SMALL, reg="none"), replace(SMALL, schedule="adaptive")])
def test_hidden_state_never_exceeds_composition(setup):
    for k in (1, 3):
        acc = HiddenStateAccountant()
        for m in run_steps(setup, k):
            acc.step(m)
        assert np.all(acc.costs("hidden")[0] <= acc.costs("composition")[0] + 1e-12)
        assert acc.epsilon(1e-5) <= acc.epsilon_composition(1e-5) + 1e-9
    one = run_steps(setup, 1)
    seq = np.array([m.noise_std for m in one])[:, 0]
    sh, ones = np.array([m.shift for m in one])[:, 0], np.ones(len(one))
    last = np.array([m.batch for m in one]) == one[-1].batch  # key in the last batch: nothing left to hide it
    assert pabi_cost(sh, seq, ones, ones, last) == pytest.approx(composition_cost(sh, seq, last))
    first = np.array([m.batch for m in one]) == 0  # key first, no contraction: 1/(m+1) of it (m later steps)
    assert pabi_cost(sh, seq, ones, ones, first) == pytest.approx(composition_cost(sh, seq, first) / len(one))


def test_accountant_contract_and_refusals():
    acc = ACCOUNTANTS.build("hsa")
    assert acc.epsilon(1e-5) == 0.0 and acc.epsilon_composition(1e-5) == 0.0
    with pytest.raises(UnsupportedMechanism):
        acc.step(SubsampledGaussian(sample_rate=0.01, noise_multiplier=1.0))
    step = run_steps(SMALL, 1)[0]
    with pytest.raises(UnsupportedMechanism, match="normalisation=project"):
        acc.step(replace(step, normalisation="radial"))
    assert not acc.supports(replace(step, normalisation="radial"))
    acc.step(step)
    assert 0 < acc.epsilon(1e-5) < float("inf")
    assert not acc.certified and acc.certified_epsilon(1e-5) == acc.epsilon_composition(1e-5)


def test_a_method_its_own_accountant_cannot_analyse_says_why_not_try_it():
    """method=sbcd method.normalisation=radial said "accountant=hsa does not support ...; try accountant=hsa" (the
    accountant already chosen); it now gives hsa's reason."""
    from runner.accountants import check_for_method
    from runner.errors import DprunError
    from runner.methods import METHODS

    method = METHODS.build("sbcd", cfg={"normalisation": "radial"})
    method.mechanism = lambda q: replace(run_steps(SMALL, 1)[0], normalisation="radial")  # as prepare would make
    with pytest.raises(DprunError, match=r"^method=sbcd: accountant 'hsa' needs method.normalisation=project") as e:
        check_for_method(ACCOUNTANTS.build("hsa"), method, 0.1)
    assert "try accountant" not in str(e.value)
