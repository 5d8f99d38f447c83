"""DP-SBCD's block updates on the lifted objective (the math; method.py runs them in order).

    F = R(theta_D x_D; y) + gamma/2 * sum_{d<D} ( ||x_{d+1} - relu(U_d)||^2 + ||U_d - theta_d x_d||^2 )

Per example (rows of a batch): x_d (B, n_d), U_d (B, n_{d+1}); theta_d (n_{d+1}, n_d).

    x = update_x_middle(u_prev, theta, u)           # argmin_x_d F, 1 <= d <= D-1 (closed form)
    u = update_u(x @ theta.T, x_next)               # argmin_U_d F, elementwise (ReLU)
    theta = spectral_project(theta)                 # singular values clipped at 1
    theta = prox(theta - eta * grad + noise, "l2", eta, lam)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def clip_rows(t: torch.Tensor, radius: float) -> torch.Tensor:
    """Each row scaled to norm <= radius (the projection onto the ball). (B, n) -> (B, n). A row whose norm is not
    finite (a record of inf or nan values) becomes 0, inside the ball: scaled by radius / inf = 0 it would be
    0 * inf = nan, and one record would turn every weight into nan (tests/test_sbcd_train.py)."""
    norms = t.norm(dim=1, keepdim=True)  # (B, 1)
    clipped = t * (radius / norms.clamp(min=1e-12)).clamp(max=1.0)
    return torch.where(torch.isfinite(norms), clipped, torch.zeros((), dtype=t.dtype, device=t.device))


def update_x_middle(u_prev: torch.Tensor, theta: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """argmin_x ||x - relu(u_prev)||^2 + ||u - theta x||^2 = (I + theta^T theta)^{-1} (relu(u_prev) + theta^T u).
    u_prev (B, n_d), theta (n_{d+1}, n_d), u (B, n_{d+1}) -> (B, n_d)."""
    A = torch.eye(theta.shape[1], dtype=theta.dtype, device=theta.device) + theta.T @ theta  # (n_d, n_d), SPD
    rhs = torch.relu(u_prev) + u @ theta  # (B, n_d): rows relu(U_{d-1}) + theta^T U_d
    return torch.linalg.solve(A, rhs.T).T


def update_x_top(x: torch.Tensor, theta: torch.Tensor, y: torch.Tensor, target: torch.Tensor, gamma: float,
                 steps: int) -> torch.Tensor:
    """Gradient steps on CE(theta x; y) + gamma/2 ||x - target||^2 per example (no closed form with cross-entropy).
    Step 1/(gamma + ||theta||_2^2 / 2): the inverse smoothness (softmax Hessian <= I/2). x, target (B, n_D)."""
    step = 1.0 / (gamma + torch.linalg.matrix_norm(theta, ord=2).item() ** 2 / 2)
    onehot = F.one_hot(y, theta.shape[0]).to(x.dtype)  # (B, classes)
    for _ in range(steps):
        p = torch.softmax(x @ theta.T, dim=1)  # (B, classes)
        x = x - step * ((p - onehot) @ theta + gamma * (x - target))
    return x


def u_objective(u: torch.Tensor, a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(v - relu(u))^2 + (u - a)^2, elementwise: the U_d part of F / (gamma/2)."""
    return (v - torch.relu(u)) ** 2 + (u - a) ** 2


def update_u(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """argmin_u (v - relu(u))^2 + (u - a)^2 elementwise, a = theta_d x_d, v = x_{d+1}: on u >= 0 the minimiser is
    max((a + v)/2, 0), on u <= 0 it is min(a, 0); keep the candidate with the smaller objective. (B, n) -> (B, n)"""
    pos = ((a + v) / 2).clamp(min=0)
    neg = a.clamp(max=0)
    return torch.where(u_objective(pos, a, v) <= u_objective(neg, a, v), pos, neg)


def power_iteration(theta: torch.Tensor, v: torch.Tensor | None = None, iters: int = 20):
    """Estimate of ||theta||_2 (a lower bound: ||theta v|| for a unit v) and the right singular vector estimate."""
    if v is None:
        v = torch.ones(theta.shape[1], dtype=theta.dtype, device=theta.device)
    for _ in range(iters):
        v = theta.T @ (theta @ v)
        v = v / v.norm().clamp(min=1e-12)
    return (theta @ v).norm().item(), v


def radial_normalise(theta: torch.Tensor, lam: float) -> torch.Tensor:
    """The slides' normalisation theta * min(1, 1/Lambda) with Lambda from power iteration."""
    return theta * min(1.0, 1.0 / max(lam, 1e-12))


def spectral_project(theta: torch.Tensor) -> torch.Tensor:
    """Frobenius projection onto {||theta||_2 <= 1}: singular values clipped at 1. 1-Lipschitz (a projection onto a
    convex set), which the hidden-state accountant needs; equals radial_normalise when rank is 1 or norm <= 1."""
    U, S, Vh = torch.linalg.svd(theta, full_matrices=False)
    if S[0] <= 1:
        return theta
    return (U * S.clamp(max=1.0)) @ Vh


def prox(theta: torch.Tensor, kind: str, eta: float, lam: float) -> torch.Tensor:
    """Prox_{eta r}: none -> identity; l2 (r = lam/2 ||.||^2) -> theta / (1 + eta lam), (1 + eta lam)^{-1}-Lipschitz;
    l1 (r = lam ||.||_1) -> soft-thresholding at eta lam, 1-Lipschitz."""
    if kind == "none" or lam == 0:
        return theta
    if kind == "l2":
        return theta / (1 + eta * lam)
    if kind == "l1":
        return torch.sign(theta) * (theta.abs() - eta * lam).clamp(min=0)
    raise ValueError(f"unknown regulariser {kind!r}")


def grad_middle(theta: torch.Tensor, x: torch.Tensor, u: torch.Tensor, gamma: float, denom: float) -> torch.Tensor:
    """Sum over the batch of grad_theta gamma/2 ||u - theta x||^2 = gamma (theta x - u) x^T, divided by the nominal
    batch size `denom` (not the realised one, so the sensitivity eta S_g / b is the same for every batch).
    -> (n_{d+1}, n_d)"""
    return gamma * (x @ theta.T - u).T @ x / denom


def grad_top(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, denom: float) -> torch.Tensor:
    """Sum over the batch of grad_theta CE(theta x; y) = (softmax(theta x) - e_y) x^T, / `denom`. -> (classes, n_D)"""
    p = torch.softmax(x @ theta.T, dim=1)
    return (p - F.one_hot(y, theta.shape[0]).to(x.dtype)).T @ x / denom
