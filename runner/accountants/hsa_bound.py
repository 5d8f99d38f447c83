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

from fractions import Fraction

import numpy as np
from scipy.special import logsumexp

ALPHAS = 1.0 + np.logspace(-3, 4, 2000)  # Renyi orders searched when converting to (eps, delta)


def shift_weights(lf: np.ndarray, lt: np.ndarray) -> np.ndarray:
    """w_t = L_T,t * prod_{tau>t} (L_F,tau * L_T,tau), divided by its maximum (the cost is scale-free). (T,)"""
    log_c = np.log(lf) + np.log(lt)
    later = np.concatenate([np.cumsum(log_c[::-1])[::-1][1:], [0.0]])  # sum_{tau>t} log c_tau
    log_w = np.log(lt) + later
    return np.exp(log_w - log_w.max())


def lower_hull(x, y) -> np.ndarray:
    """Indices of the lower convex hull of points sorted by x (monotone chain), first and last included; exact where
    x and y are Python ints."""
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


class Dyadic:
    """Nonnegative values m 2^e (m an int) brought to one exponent as Python ints, so their sums and differences are
    exact (review 67: with L_F L_T > 1 the weights w_t fall by that factor a step, and float64's V = cumsum(s^2 w^2)
    lost the later increments: a cost of inf, or off by up to 6x, beside the composition's)."""

    def __init__(self, log2_values: np.ndarray, factors: np.ndarray):
        """values factors_t * 2^log2_values_t (T,) each: the power split into an integer exponent and a mantissa."""
        whole = np.floor(log2_values).astype(np.int64)
        parts = [float(f) * float(np.exp2(lv - e)) for f, lv, e in zip(factors, log2_values, whole)]
        ratios = [v.as_integer_ratio() for v in parts]  # exact: (numerator, 2^k)
        exps = [int(e) - (d.bit_length() - 1) for (_, d), e in zip(ratios, whole)]
        self.exponent = min(exps)  # value_t = ints[t] * 2^exponent
        self.ints = [n << (x - self.exponent) for (n, _), x in zip(ratios, exps)]


def _hull_knots(shift, noise_std, lf, lt, key):
    """(V (T,) ints, increments (T,) ints, knot V ints, knot U ints, 2U-scale minus V-scale exponent) of the optimal
    shift allocation, exact for the float64 inputs; None if no key step. V values are scaled by 2^ev, U by 2^eu."""
    keys = np.flatnonzero(key)
    if len(keys) == 0:
        return None
    lf, lt = np.asarray(lf, float), np.asarray(lt, float)
    log_c = np.log2(lf) + np.log2(lt)
    later = np.concatenate([np.cumsum(log_c[::-1])[::-1][1:], [0.0]])  # log2 prod_{tau>t} L_F L_T
    log_w = np.log2(lt) + later  # log2 w_t (shift_weights, unscaled: exact ints need no normalising)
    inc = Dyadic(2 * log_w, np.asarray(noise_std, float) ** 2)  # dV per step: s_t^2 w_t^2
    gain = Dyadic(log_w[keys], np.asarray(shift, float)[keys])  # dU at each key step: w_t shift_t
    V = list(np.cumsum(np.array(inc.ints, dtype=object)))  # V(t), exact
    P = list(np.cumsum(np.array(gain.ints, dtype=object)))  # P just after each key step
    before = lambda t: V[t - 1] if t > 0 else 0  # V(t-1)
    # start (V(k_1 - 1), 0); the constraint before key i+1 binds at (V(k_{i+1} - 1), P_i); end (V(T-1), P_m)
    xs = [before(keys[0])] + [before(k) for k in keys[1:]] + [V[-1]]
    ys = [0] + P[:-1] + [P[-1]]
    h = lower_hull(xs, ys)
    return V, inc.ints, [xs[i] for i in h], [ys[i] for i in h], 2 * gain.exponent - inc.exponent


def _scaled(numerator: int, denominator: int, exponent: int) -> float:
    """numerator / denominator * 2^exponent as a float (0 for a zero numerator; big ints, no overflow on the way)."""
    if not numerator:
        return 0.0
    try:
        return float(Fraction(numerator, denominator) * Fraction(2) ** exponent)
    except OverflowError:  # above float64's range
        return float("inf")


def pabi_cost(shift, noise_std, lf, lt, key) -> float:
    """C with eps_block(alpha) = alpha * C under the hidden state; all arguments are (T,) arrays over the steps."""
    knots = _hull_knots(shift, noise_std, lf, lt, key)
    if knots is None:
        return 0.0
    _, _, hx, hy, exponent = knots
    total = Fraction(0)
    for (x0, x1), (y0, y1) in zip(zip(hx, hx[1:]), zip(hy, hy[1:])):
        if y1 > y0:
            if x1 <= x0:
                return float("inf")  # a shift that no noise can absorb (zero noise after the key step)
            total += Fraction((y1 - y0) ** 2, x1 - x0)
    return 0.5 * _scaled(total.numerator, total.denominator, exponent)


def pabi_step_costs(shift, noise_std, lf, lt, key) -> np.ndarray:
    """The optimal allocation's cost a_t^2 / (2 s_t^2) spent at each step t (sums to pabi_cost). (T,)"""
    knots = _hull_knots(shift, noise_std, lf, lt, key)
    T = len(np.asarray(noise_std))
    if knots is None:
        return np.zeros(T)
    V, inc, hx, hy, exponent = knots
    out = np.zeros(T)
    s = 0  # step t lies in segment s when V(t) in (hx[s], hx[s+1]]; u_t = mu inc_t, a_t^2 / (2 s_t^2) = mu^2 inc_t / 2
    for t in range(T):
        while s < len(hx) - 1 and V[t] > hx[s + 1]:
            s += 1
        if s >= len(hx) - 1 or V[t] <= hx[0]:
            continue
        dU, dV = hy[s + 1] - hy[s], hx[s + 1] - hx[s]
        if dV > 0:
            out[t] = 0.5 * _scaled(dU * dU * inc[t], dV * dV, exponent)
    return out


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
