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


def _log2_segments(shift, noise_std, lf, lt, key):
    """The staircase in log2 differences, None if no key step: (ldx (m,), ldy (m,), bounds (m + 1,), log_inc (T,)).

    Points p_0..p_m at steps k_1 - 1, ..., k_m - 1, T - 1 (m keys); segment i runs over steps (p_i, p_{i+1}], its
    dV = sum of s_t^2 w_t^2 there (ldx, log2) and its dU = w_k shift_k of key i (ldy). Every quantity is a sum of
    positive terms, formed in log2 with its own scale (np.logaddexp2), never a difference of two cumulative sums:
    with L_F L_T > 1 the weights w_t fall by that factor a step, and float64's V = cumsum(s^2 w^2) lost the later
    increments (review 67: a cost of inf, or off by 0.17-1.04x); a zero L_F or L_T is a weight of 0 (review 68)."""
    keys = np.flatnonzero(key)
    if len(keys) == 0:
        return None
    with np.errstate(divide="ignore"):  # log2(0) = -inf: a zero weight, noise or shift
        lf, lt = np.log2(np.asarray(lf, float)), np.log2(np.asarray(lt, float))
        log_w = lt + np.concatenate([np.cumsum((lf + lt)[::-1])[::-1][1:], [0.0]])  # log2 w_t (unnormalised)
        log_inc = 2 * (log_w + np.log2(np.asarray(noise_std, float)))  # (T,) log2 of s_t^2 w_t^2
        ldy = log_w[keys] + np.log2(np.asarray(shift, float)[keys])  # (m,) log2 of w_k shift_k
    bounds = np.concatenate([keys, [len(log_inc)]])  # segment i: steps bounds[i] .. bounds[i+1] - 1
    ldx = np.array([np.logaddexp2.reduce(log_inc[a:b]) if b > a else -np.inf for a, b in zip(bounds, bounds[1:])])
    return ldx, ldy, bounds, log_inc


def _log2_slope(ldx: np.ndarray, ldy: np.ndarray, a: int, b: int) -> float:
    """log2 of (U_b - U_a) / (V_b - V_a) between points a < b: -inf where no shift, inf where no noise."""
    ly, lx = np.logaddexp2.reduce(ldy[a:b]), np.logaddexp2.reduce(ldx[a:b])
    return -np.inf if ly == -np.inf else (np.inf if lx == -np.inf else float(ly - lx))


def _hull(ldx: np.ndarray, ldy: np.ndarray) -> list[int]:
    """The lower convex hull of the m + 1 points (monotone chain). Point b between a and i is dropped when
    dU_ab dV_bi >= dU_bi dV_ab: the two adjacent ranges' own sums, compared in log2 (never sums from a to i, whose
    rounding hid a short steep range behind a long one: review 68's check against exact fractions)."""
    total = lambda t, a, b: np.logaddexp2.reduce(t[a:b])  # noqa: E731  log2 of a range's sum (-inf: empty or 0)
    hull: list[int] = []
    for i in range(len(ldx) + 1):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if total(ldy, a, b) + total(ldx, b, i) >= total(ldy, b, i) + total(ldx, a, b):
                hull.pop()  # b lies on or above the segment from a to i
            else:
                break
        hull.append(i)
    return hull


def pabi_cost(shift, noise_std, lf, lt, key) -> float:
    """C with eps_block(alpha) = alpha * C under the hidden state; all arguments are (T,) arrays over the steps.
    Never above composition_cost (the hidden state releases less); the log2 arithmetic's ~1e-12 could cross it."""
    staircase = _log2_segments(shift, noise_std, lf, lt, key)
    if staircase is None:
        return 0.0
    ldx, ldy, _, _ = staircase
    hull = _hull(ldx, ldy)
    cost = 0.0
    for a, b in zip(hull, hull[1:]):
        ly, lx = np.logaddexp2.reduce(ldy[a:b]), np.logaddexp2.reduce(ldx[a:b])
        if ly > -np.inf:
            cost += np.inf if lx == -np.inf else 0.5 * np.exp2(2 * ly - lx)  # inf: a shift no noise absorbs
    return float(min(cost, composition_cost(shift, noise_std, key)))


def pabi_step_costs(shift, noise_std, lf, lt, key) -> np.ndarray:
    """The optimal allocation's cost a_t^2 / (2 s_t^2) spent at each step t (sums to pabi_cost). (T,)
    u_t = mu inc_t with mu the slope of its hull segment, so a_t^2 / (2 s_t^2) = mu^2 inc_t / 2."""
    T = len(np.asarray(noise_std))
    staircase = _log2_segments(shift, noise_std, lf, lt, key)
    out = np.zeros(T)
    if staircase is None:
        return out
    ldx, ldy, bounds, log_inc = staircase
    hull = _hull(ldx, ldy)
    for a, b in zip(hull, hull[1:]):
        log_mu = _log2_slope(ldx, ldy, a, b)
        steps = slice(bounds[a], bounds[b])
        if log_mu == np.inf:
            out[bounds[b] - 1] = np.inf  # the segment's shift meets no noise: its cost (and pabi_cost) is inf
        elif log_mu > -np.inf:
            out[steps] = 0.5 * np.exp2(2 * log_mu + log_inc[steps])
    return out


def composition_cost(shift, noise_std, key) -> float:
    """C with eps(alpha) = alpha * C when every intermediate state is released: sum of Gaussian-mechanism RDPs."""
    s, n = np.asarray(shift, float), np.asarray(noise_std, float)
    k = np.asarray(key, bool)
    with np.errstate(divide="ignore"):  # no noise at a key step: inf, as meant
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
