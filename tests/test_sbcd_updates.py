"""DP-SBCD's block updates: closed forms equal numerical minimisers of F; normalisation and prox are exact."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from runner.methods.sbcd import updates as up
from runner.methods.sbcd.bounds import layer_constants


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.mark.parametrize("seed", range(3))
def test_x_middle_closed_form_is_the_minimiser(seed):
    g = torch.Generator().manual_seed(seed)
    u_prev, theta, u = torch.randn(4, 5, generator=g), torch.randn(3, 5, generator=g), torch.randn(4, 3, generator=g)
    x = up.update_x_middle(u_prev, theta, u)
    for i in range(4):
        f = lambda z: np.sum((z - np.maximum(u_prev[i].numpy(), 0)) ** 2) + np.sum((u[i].numpy() - theta.numpy() @ z) ** 2)
        ref = minimize(f, np.zeros(5), method="BFGS", options={"gtol": 1e-10}).x
        np.testing.assert_allclose(x[i].numpy(), ref, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_u_update_is_the_elementwise_minimiser(seed):
    g = torch.Generator().manual_seed(seed)
    a, v = torch.randn(50, generator=g) * 2, torch.randn(50, generator=g) * 2
    u = up.update_u(a, v)
    grid = torch.linspace(-8, 8, 40001)  # brute force over u, spacing 4e-4
    best = up.u_objective(grid[None, :], a[:, None], v[:, None]).min(1).values
    got = up.u_objective(u, a, v)
    assert torch.all(got <= best + 1e-7)
    assert torch.all(got >= best - 1e-6)  # the grid minimum is within 1e-6 of the true one


def test_x_top_gradient_steps_reach_the_minimiser():
    g = torch.Generator().manual_seed(0)
    theta, x0, target = torch.randn(3, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    y = torch.tensor([0, 2])
    x = up.update_x_top(x0, theta, y, target, gamma=1.0, steps=300)
    for i in range(2):
        def f(z):
            logits = theta.numpy() @ z
            return np.log(np.exp(logits).sum()) - logits[y[i]] + 0.5 * np.sum((z - target[i].numpy()) ** 2)
        ref = minimize(f, np.zeros(4), method="BFGS", options={"gtol": 1e-10}).x
        np.testing.assert_allclose(x[i].numpy(), ref, atol=1e-6)


def test_spectral_projection_is_the_exact_frobenius_projection():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(6, 9, generator=g)
    p = up.spectral_project(theta)
    s_in, s_out = torch.linalg.svdvals(theta), torch.linalg.svdvals(p)
    assert s_out[0] <= 1 + 1e-12 and s_in[0] > 1
    torch.testing.assert_close(s_out, s_in.clamp(max=1))
    # nonexpansive (what the accountant needs) on random pairs
    for _ in range(20):
        a, b = torch.randn(6, 9, generator=g) * 3, torch.randn(6, 9, generator=g) * 3
        assert (up.spectral_project(a) - up.spectral_project(b)).norm() <= (a - b).norm() + 1e-12
    small = theta / (2 * s_in[0])
    torch.testing.assert_close(up.spectral_project(small), small)


def test_power_iteration_and_radial_normalisation_bound_the_top_singular_value():
    theta = torch.randn(20, 30, generator=torch.Generator().manual_seed(1)) * 3
    lam, _ = up.power_iteration(theta, iters=200)
    assert lam == pytest.approx(torch.linalg.svdvals(theta)[0].item(), rel=1e-6)
    assert torch.linalg.svdvals(up.radial_normalise(theta, lam))[0] <= 1 + 1e-6


def test_prox_operators_are_exact():
    g = torch.Generator().manual_seed(0)
    v, eta, lam = torch.randn(200, generator=g), 0.7, 0.9
    p2 = up.prox(v, "l2", eta, lam)  # optimality: (p - v)/eta + lam p = 0
    torch.testing.assert_close((p2 - v) / eta + lam * p2, torch.zeros_like(v))
    p1 = up.prox(v, "l1", eta, lam)  # subgradient optimality of 1/(2 eta)||p - v||^2 + lam ||p||_1
    nz = p1 != 0
    torch.testing.assert_close(((p1 - v) / eta + lam * torch.sign(p1))[nz], torch.zeros(int(nz.sum())))
    assert torch.all(v[~nz].abs() <= eta * lam + 1e-12)
    torch.testing.assert_close(up.prox(v, "none", eta, lam), v)


def test_gradients_match_autograd_and_stay_within_the_sensitivity_bound():
    g = torch.Generator().manual_seed(0)
    X, R, gamma = 1.5, 2.0, 0.8
    x = up.clip_rows(torch.randn(7, 5, generator=g) * 3, X)
    u = up.clip_rows(torch.randn(7, 4, generator=g) * 3, R)
    theta = up.spectral_project(torch.randn(4, 5, generator=g) * 3).requires_grad_()
    (gamma / 2 * ((u - x @ theta.T) ** 2).sum() / 10).backward()
    torch.testing.assert_close(up.grad_middle(theta.detach(), x, u, gamma, 10.0), theta.grad)
    c = layer_constants(top=False, gamma=gamma, x_radius=X, u_radius=R, eta=0.1, reg="none", lam=0)
    per_example = [up.grad_middle(theta.detach(), x[i:i + 1], u[i:i + 1], gamma, 1.0).norm() for i in range(7)]
    assert max(per_example) <= c.sensitivity / 2
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    theta_top = torch.randn(4, 5, generator=g, requires_grad=True)
    torch.nn.functional.cross_entropy(x @ theta_top.T, y, reduction="sum").div(10).backward()
    torch.testing.assert_close(up.grad_top(theta_top.detach(), x, y, 10.0), theta_top.grad)
    top = layer_constants(top=True, gamma=gamma, x_radius=X, u_radius=R, eta=0.1, reg="l2", lam=1.0)
    assert max(up.grad_top(theta_top.detach() * 50, x[i:i + 1], y[i:i + 1], 1.0).norm() for i in range(7)) \
        <= top.sensitivity / 2
    assert top.lipschitz_prox == pytest.approx(1 / 1.1) and top.lipschitz_grad == 1.0


def test_a_float32_gradient_stays_within_the_sensitivity_the_noise_is_scaled_to():
    """Review 32: in float32 clip_rows leaves a row up to 2.3e-7 above its radius and spectral_project a top singular
    value up to 1.85e-6 above 1; an input along a projected weight's top direction, at its radius, with the auxiliary
    row opposite, gave a gradient of G (1 + 1.3e-6). The sensitivity S_g = 2 G carries a float32 slack of 1e-5."""
    import math

    from runner.methods.sbcd import updates as up
    from runner.methods.sbcd.bounds import layer_constants

    torch.manual_seed(0)
    worst = 0.0
    for _ in range(60):
        scale = 10 ** torch.empty(1).uniform_(-0.5, 3).item() / 8
        theta = up.spectral_project(torch.randn(32, 64, dtype=torch.float32) * scale)
        top = torch.linalg.svd(theta.double())[2][0]
        for X, RU, gamma in ((1.0, 1.0, 1.0), (0.37, 2.9, 3.3), (1e3, 1e-2, 1.0)):
            x = up.clip_rows((top * 1e4).float()[None], X)
            u = up.clip_rows(-(x @ theta.T) * 1e6, RU)
            half = layer_constants(top=False, gamma=gamma, x_radius=X, u_radius=RU, eta=1.0, reg="none",
                                   lam=0.0).sensitivity / 2
            worst = max(worst, up.grad_middle(theta, x, u, gamma, 1.0).double().norm().item() / half)
    assert 1.0 < worst * (1 + 1e-5) and worst <= 1.0, worst  # reaches the unslacked G, stays within the slacked one
    assert math.isfinite(worst)
