"""The constants DP-SBCD's privacy rests on, per layer, from the algorithm's bounds (derivations: docs/sbcd.md).

With ||x_d|| <= X_d, ||U_d|| <= R_U (clipped) and ||theta_d||_2 <= 1 at the gradient (spectral projection):

  middle layer d < D:  f_i = gamma/2 ||U_i - theta x_i||^2
      per-example gradient  gamma (theta x_i - U_i) x_i^T, norm <= G = gamma X_d (R_U + X_d)
      Hessian in theta      gamma x_i x_i^T (x) I  ->  L = gamma X_d^2,  m = 0
  top layer D:         f_i = CE(theta x_i; y_i)
      gradient (p - e_y) x_i^T, ||p - e_y|| <= sqrt(2)  ->  G = sqrt(2) X_D
      Hessian (diag p - p p^T) (x) x x^T, ||diag p - p p^T|| <= 1/2  ->  L = X_D^2 / 2,  m = 0
  S_g = 2 G (replace-one: ||grad f_i - grad f_i'|| <= 2G);  shift of the gradient map at a key step: eta S_g / b
  L_F = max(|1 - eta m|, |1 - eta L|);  L_T = 1/(1 + eta lam) for l2, 1 for l1 and none.

    c = layer_constants(top=False, gamma=1.0, x_radius=1.0, u_radius=1.0, eta=0.5, reg="l2", lam=0.1)
    c.sensitivity, c.lipschitz_grad, c.lipschitz_prox

The step the accountant is told, computed HERE ONLY (the trained runs, runner/methods/sbcd/method.py, and the
slides' curves, runner/sbcd_curves.py, both call it, so they cannot drift apart):

    consts = network_constants(depth=1, gamma=1.0, x_radius=[1.0, 1.0], u_radius=[1.0], eta=1.5, reg="l2", lam=0.05)
    hidden_state_step(consts, eta=1.5, sigma_k=2.0, b=3000, n=60000, epoch=0, batch=0, batch_size=3000)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from runner.accountants.mechanisms import HiddenStateStep


@dataclass(frozen=True)
class LayerConstants:
    sensitivity: float  # S_g
    smoothness: float  # L
    strong_convexity: float  # m
    lipschitz_grad: float  # L_F
    lipschitz_prox: float  # L_T


FLOAT32_SLACK = 1e-5  # relative: the float32 clip and projection's rounding (layer_constants), with a margin


def layer_constants(*, top: bool, gamma: float, x_radius: float, u_radius: float, eta: float, reg: str,
                    lam: float) -> LayerConstants:
    if top:
        G, L = math.sqrt(2.0) * x_radius, x_radius ** 2 / 2
    else:
        G, L = gamma * x_radius * (u_radius + x_radius), gamma * x_radius ** 2
    m = 0.0
    lf = max(abs(1 - eta * m), abs(1 - eta * L))
    lt = 1.0 / (1.0 + eta * lam) if reg == "l2" else 1.0
    # the float32 step: clip_rows leaves a row at up to its radius (1 + 2.3e-7) and spectral_project a top singular
    # value at up to 1 + 1.85e-6, so an example's gradient reached G (1 + 1.3e-6) (review 32); the sensitivity the
    # noise is scaled to covers it
    return LayerConstants(2 * G * (1 + FLOAT32_SLACK), L, m, lf, lt)


def network_constants(*, depth: int, gamma: float, x_radius: list[float], u_radius: list[float], eta: float, reg: str,
                      lam: float) -> list[LayerConstants]:
    """The constants of layers d = 0..D (x_radius: D + 1 values, u_radius: D values; the top layer has no U)."""
    return [layer_constants(top=d == depth, gamma=gamma, x_radius=x_radius[d],
                            u_radius=u_radius[min(d, depth - 1)] if depth else 0.0, eta=eta, reg=reg, lam=lam)
            for d in range(depth + 1)]


def hidden_state_step(consts: list[LayerConstants], *, eta: float, sigma_k: float, b: int, n: int, epoch: int,
                      batch: int, batch_size: int, normalisation: str = "project") -> HiddenStateStep:
    """One DP-SBCD step as told to the accountant. The gradient sum is divided by the nominal batch size b, so every
    batch has shift eta S_g,d / b and noise std s_d = sigma_k * shift; batch_size (the realised size) gives the key
    example's chance b_j / n of being in batch j."""
    shift = tuple(eta * c.sensitivity / b for c in consts)  # eta S_g,d / b
    return HiddenStateStep(epoch=epoch, batch=batch, num_batches=math.ceil(n / b), batch_size=batch_size, n=n,
                           noise_std=tuple(sigma_k * s for s in shift), shift=shift,
                           lipschitz_grad=tuple(c.lipschitz_grad for c in consts),
                           lipschitz_prox=tuple(c.lipschitz_prox for c in consts), normalisation=normalisation)
