"""The math of the hidden-state accountant (runner/accountants/hsa.py): privacy amplification by iteration.

One block (a layer's weights theta_d) follows the noisy iteration, step t = 0..T-1,
    theta_{t+1} = T_t( F_t(theta_t) + Z_t ),   Z_t ~ N(0, s_t^2 I),
F_t (the gradient map, L_F-Lipschitz) and T_t (the prox, L_T-Lipschitz). On neighbouring datasets the maps differ
only at the key steps, where the key example is in the batch, by at most shift_t = eta * S_g / b. The shifted Renyi
divergence recursion (Feldman et al. 2018; Altschuler & Talwar 2022) gives, for shifts a_t >= 0 spent on the noise,
    eps_block(alpha) = alpha * sum_t a_t^2 / (2 s_t^2),
    feasible iff  U(t) := sum_{tau<=t} w_tau a_tau  <=  P(t) := sum_{tau<=t} w_tau shift_tau key_tau  for all t,
                  with equality at t = T-1,     w_t = L_T,t * prod_{tau>t} L_F,tau L_T,tau.
The cheapest feasible a is the taut string: the lower convex hull of the staircase P in the coordinate
V(t) = sum_{tau<=t} s_tau^2 w_tau^2, and its cost is  1/2 * sum_{hull segments} dU^2 / dV  (derivation: docs/sbcd.md).

    C = pabi_cost(shift, noise_std, lf, lt, key)     # eps_block(alpha) = alpha * C
    eps = rdp_to_dp(mixture_rdp(C_j, p_j, ALPHAS), ALPHAS, 1e-5)
"""
from __future__ import annotations

import numpy as np
from scipy.special import logsumexp

ALPHAS = 1.0 + np.logspace(-3, 4, 2000)  # Renyi orders searched when converting to (eps, delta)


def shift_weights(lf: np.ndarray, lt: np.ndarray) -> np.ndarray:
    """w_t = L_T,t * prod_{tau>t} (L_F,tau * L_T,tau), divided by its maximum (the cost is scale-free). (T,)"""
    log_c = np.log(lf) + np.log(lt)
    later = np.concatenate([np.cumsum(log_c[::-1])[::-1][1:], [0.0]])  # sum_{tau>t} log c_tau
    log_w = np.log(lt) + later
    return np.exp(log_w - log_w.max())


def lower_hull(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Indices of the lower convex hull of points sorted by x (monotone chain), first and last included."""
    hull: list[int] = []
    for i in range(len(x)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b if it lies on or above the segment a -> i
            if (y[b] - y[a]) * (x[i] - x[a]) >= (y[i] - y[a]) * (x[b] - x[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return np.array(hull, dtype=int)


def _hull_knots(shift, noise_std, lf, lt, key):
    """(V (T,), knot V values, knot U values) of the optimal shift allocation; None if no key step."""
    w = shift_weights(np.asarray(lf, float), np.asarray(lt, float))
    inc = np.asarray(noise_std, float) ** 2 * w ** 2  # dV per step
    V = np.cumsum(inc)  # V(t)
    keys = np.flatnonzero(key)
    if len(keys) == 0:
        return None
    P = np.cumsum(w[keys] * np.asarray(shift, float)[keys])  # P just after each key step
    before = lambda t: V[t - 1] if t > 0 else 0.0  # V(t-1)
    # start (V(k_1 - 1), 0); the constraint before key i+1 binds at (V(k_{i+1} - 1), P_i); end (V(T-1), P_m)
    xs = np.array([before(keys[0])] + [before(k) for k in keys[1:]] + [V[-1]])
    ys = np.concatenate([[0.0], P[:-1], [P[-1]]])
    h = lower_hull(xs, ys)
    return V, inc, xs[h], ys[h]


def pabi_cost(shift, noise_std, lf, lt, key) -> float:
    """C with eps_block(alpha) = alpha * C under the hidden state; all arguments are (T,) arrays over the steps."""
    knots = _hull_knots(shift, noise_std, lf, lt, key)
    if knots is None:
        return 0.0
    _, _, hx, hy = knots
    dU, dV = np.diff(hy), np.diff(hx)
    ok = dU > 0
    if np.any(ok & (dV <= 0)):
        return float("inf")  # a shift that no noise can absorb (zero noise after the key step)
    return float(0.5 * np.sum(dU[ok] ** 2 / dV[ok]))


def pabi_step_costs(shift, noise_std, lf, lt, key) -> np.ndarray:
    """The optimal allocation's cost a_t^2 / (2 s_t^2) spent at each step t (sums to pabi_cost). (T,)"""
    knots = _hull_knots(shift, noise_std, lf, lt, key)
    T = len(np.asarray(noise_std))
    if knots is None:
        return np.zeros(T)
    V, inc, hx, hy = knots
    slopes = np.diff(hy) / np.maximum(np.diff(hx), 1e-300)  # mu per hull segment
    seg = np.searchsorted(hx, V, side="left") - 1  # step t lies in segment seg[t] when V(t) in (hx[s], hx[s+1]]
    mu = np.where((seg >= 0) & (seg < len(slopes)), slopes[np.clip(seg, 0, len(slopes) - 1)], 0.0)
    return 0.5 * mu ** 2 * inc  # u_t = mu * inc_t, a_t = u_t / w_t  ->  a_t^2 / (2 s_t^2) = mu^2 * inc_t / 2


def composition_cost(shift, noise_std, key) -> float:
    """C with eps(alpha) = alpha * C when every intermediate state is released: sum of Gaussian-mechanism RDPs."""
    s, n = np.asarray(shift, float), np.asarray(noise_std, float)
    k = np.asarray(key, bool)
    return float(np.sum(s[k] ** 2 / (2 * n[k] ** 2)))


def mixture_rdp(costs: np.ndarray, probs: np.ndarray, alphas: np.ndarray = ALPHAS) -> np.ndarray:
    """eps(alpha) = 1/(alpha-1) log sum_j p_j exp((alpha-1) * alpha * C_j): the key lands in batch j w.p. p_j."""
    c = np.asarray(costs, float)[None, :]
    a = np.asarray(alphas, float)[:, None]
    with np.errstate(divide="ignore"):
        logp = np.log(np.asarray(probs, float))[None, :]
    return logsumexp(logp + (a - 1) * a * c, axis=1) / (a[:, 0] - 1)


def rdp_to_dp(rdp: np.ndarray, alphas: np.ndarray, delta: float) -> float:
    """min over alpha of eps(alpha) + log(1 - 1/alpha) - (log delta + log alpha)/(alpha - 1)
    (Canonne, Kamath & Steinke 2020, Prop. 12; never larger than the slides' eps(alpha) + log(1/delta)/(alpha-1))."""
    a = np.asarray(alphas, float)
    eps = rdp + np.log1p(-1.0 / a) - (np.log(delta) + np.log(a)) / (a - 1)
    return float(max(0.0, np.nanmin(eps)))
