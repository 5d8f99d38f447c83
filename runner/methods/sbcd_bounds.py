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
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerConstants:
    sensitivity: float  # S_g
    smoothness: float  # L
    strong_convexity: float  # m
    lipschitz_grad: float  # L_F
    lipschitz_prox: float  # L_T


def layer_constants(*, top: bool, gamma: float, x_radius: float, u_radius: float, eta: float, reg: str,
                    lam: float) -> LayerConstants:
    if top:
        G, L = math.sqrt(2.0) * x_radius, x_radius ** 2 / 2
    else:
        G, L = gamma * x_radius * (u_radius + x_radius), gamma * x_radius ** 2
    m = 0.0
    lf = max(abs(1 - eta * m), abs(1 - eta * L))
    lt = 1.0 / (1.0 + eta * lam) if reg == "l2" else 1.0
    return LayerConstants(2 * G, L, m, lf, lt)
