"""The math of the JL accountant: one DP-SGD-JL step as a privacy-loss distribution (PLD).

    from runner.accountants.jl_pld import step_pld, tail_lower_bound
    pld = step_pld(q=256/60000, sigma=1.3, r=10)           # dp_accounting PrivacyLossDistribution (pessimistic)
    pld.self_compose(3516).get_epsilon_for_delta(1e-5)

JL paper, Lemma 4.3 / Theorem 4.1: one unsubsampled step is dominated by the pair
    P = (Z, N(Z/sigma, 1))   vs   Q = (Z, N(0, 1)),      Z = Z_r = 1 / sqrt(chi^2_r / r),
and Poisson subsampling at rate q turns it into (q P + (1-q) Q, Q) [remove] and (Q, q P + (1-q) Q) [add];
g = min{f_p^T, (f_p^T)^-1}** of Theorem 4.1 is the worse of the two directions, which is what dp_accounting's
PrivacyLossDistribution reports (max over remove and add).

Z is observed by both sides, so the hockey-stick divergence of a step is the Z-average of the conditional ones:
    delta_step(eps) = E_Z[ delta_{Z/sigma}(eps) ],
where delta_mu is the subsampled Gaussian with sensitivity mu (closed form below). delta_mu grows with mu (Lemma
4.2), so splitting the range of Z into bins and giving each bin's probability to its UPPER end is pessimistic; the
mass above the last edge is given to Z = infinity (remove: delta = q; add: delta = (1 - e^eps (1-q))_+). Nothing
of the heavy tail P(Z_r > a) ~ a^-r is dropped. The curve delta_step(eps) on the grid eps_i = i * d is turned into
a PLD with dp_accounting's pessimistic Connect-the-Dots discretisation (Doroshenko et al. 2022), which is valid
for any PLD given its delta at the grid points; all losses above the grid's top (`max_loss`) become infinity mass.
"""
from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf, privacy_loss_distribution as pld_lib
from scipy import special, stats

BULK_BINS = 200  # equal-probability bins of Z in its bulk
TAIL_RATIO = 1.005  # above the median, bin edges also grow geometrically: upper end / lower end <= 1.005 ...
FAR_SURVIVAL, FAR_RATIO = 1e-9, 1.02  # ... and <= 1.02 where P(Z > z) < 1e-9 (bins there hold little mass)
SMALLEST_TAIL = 1e-20  # P(Z > last finite edge) need not be smaller than this (it goes to Z = infinity)
ADD_INFINITE = 24.0  # add direction: nodes with mu >= 24 are treated as Z = infinity (exact to 1e-23)
X_TAIL = 12.0  # Phi(-12) ~ 2e-33: beyond x = mu + 12 a node's delta is below NEGLIGIBLE
NEGLIGIBLE = 1e-17  # added to every delta (pessimistic) to cover the per-node cut-offs below


def z_survival(z: np.ndarray, r: int) -> np.ndarray:
    """P(Z_r > z) = P(chi^2_r < r / z^2); z = inf -> 0."""
    z = np.asarray(z, dtype=float)
    with np.errstate(divide="ignore"):
        return stats.chi2.cdf(r / z ** 2, r)


def z_quantile_of_survival(s: np.ndarray, r: int) -> np.ndarray:
    """The z with P(Z_r > z) = s."""
    return np.sqrt(r / stats.chi2.ppf(s, r))


def z_bins(q: float, sigma: float, r: int, max_loss: float) -> tuple[np.ndarray, np.ndarray, float]:
    """Edges e_0 = 0 < e_1 < ... < e_K of Z_r's range and bin probabilities P(e_{k-1} < Z <= e_k).

    Returns (edges[1:], probs, tail) with tail = P(Z > e_K). Above e_K a step's remove-direction loss exceeds
    `max_loss` with probability > 1 - 1e-23 (mu = e_K / sigma solves mu^2/2 - 10 mu + log q = max_loss), so giving
    the tail to Z = infinity loses nothing on the grid; or P(Z > e_K) <= SMALLEST_TAIL already."""
    mu_cap = 10.0 + math.sqrt(100.0 + 2.0 * (max_loss - math.log(q)))
    z_top = min(sigma * mu_cap, float(z_quantile_of_survival(SMALLEST_TAIL, r)))
    bulk = z_quantile_of_survival(1.0 - np.arange(1, BULK_BINS) / BULK_BINS, r)
    z_med = float(z_quantile_of_survival(0.5, r))
    z_far = min(z_top, max(z_med, float(z_quantile_of_survival(FAR_SURVIVAL, r))))
    near = np.exp(np.arange(math.log(z_med), math.log(z_far), math.log(TAIL_RATIO)))
    far = np.exp(np.arange(math.log(z_far), math.log(z_top), math.log(FAR_RATIO)))
    edges = np.unique(np.concatenate([bulk[bulk < z_top], near, far, [z_top]]))
    survival = np.concatenate([[1.0], z_survival(edges, r)])
    probs = np.maximum(0.0, -np.diff(survival))
    return edges, probs, float(survival[-1])


def delta_remove(mu: float, q: float, eps: np.ndarray) -> np.ndarray:
    """Hockey-stick divergence of (q N(mu,1) + (1-q) N(0,1)) vs N(0,1) at eps (eps > log(1-q)).

    The loss log(1 - q + q e^{mu x - mu^2/2}) exceeds eps iff x > x_eps; then
    delta = q Phi(mu - x_eps) - (e^eps - 1 + q) Phi(-x_eps), evaluated in logs to keep tiny values exact."""
    c = np.expm1(eps) + q  # e^eps - 1 + q > 0
    x = (np.log(c / q) + mu * mu / 2.0) / mu
    # Phi(-x) keeps its relative precision down to 1e-308; smaller terms are below NEGLIGIBLE
    return np.maximum(0.0, q * special.ndtr(mu - x) - c * special.ndtr(-x))


def delta_add(mu: float, q: float, eps: np.ndarray) -> np.ndarray:
    """Hockey-stick divergence of N(0,1) vs (q N(mu,1) + (1-q) N(0,1)) at eps (eps < -log(1-q)).

    The loss -log(1 - q + q e^{mu x - mu^2/2}) exceeds eps iff x < x_eps; then
    delta = (1 - e^eps (1-q)) Phi(x_eps) - e^eps q Phi(x_eps - mu)."""
    c = -np.expm1(eps + math.log1p(-q))  # 1 - e^eps (1-q); <= 0: no loss exceeds eps, delta = 0
    x = (np.log(np.maximum(c, 1e-300) / q) - eps + mu * mu / 2.0) / mu
    return np.where(c > 0, np.maximum(0.0, c * special.ndtr(x) - np.exp(eps) * q * special.ndtr(x - mu)), 0.0)


def _remove_loss(mu: float, q: float, x: float) -> float:
    """Remove-direction loss at output x: log(1 - q + q e^{mu x - mu^2/2}) (capped where e^700 would overflow)."""
    return math.log1p(-q + q * math.exp(min(mu * x - mu * mu / 2.0, 700.0)))


def _add_loss(mu: float, q: float, x: float) -> float:
    return -_remove_loss(mu, q, x)


def _remove_curve(mus, weights, tail, q, lo, hi, d) -> np.ndarray:
    eps = np.arange(lo, hi + 1) * d
    out = np.where(eps <= math.log1p(-q), -np.expm1(eps), 0.0)  # below log(1-q): delta = 1 - e^eps for every z
    live = eps > math.log1p(-q)
    first = int(np.argmax(live)) if live.any() else len(eps)
    for mu, w in zip(mus, weights):
        # above the loss at x = mu + X_TAIL this node's delta is < Phi(-X_TAIL) (covered by NEGLIGIBLE)
        top = _remove_loss(mu, q, mu + X_TAIL)
        last = min(len(eps), int(math.floor(top / d)) - lo + 1)
        if last > first:
            out[first:last] += w * delta_remove(mu, q, eps[first:last])
    out[first:] += tail * q  # Z = infinity: the subsampled P is disjoint from Q
    return np.minimum(1.0, out + NEGLIGIBLE)


def _add_curve(mus, weights, tail, q, lo, hi, d) -> np.ndarray:
    eps = np.arange(lo, hi + 1) * d
    live = eps < -math.log1p(-q)
    out = np.zeros_like(eps)
    # mu >= ADD_INFINITE: on losses >= -max_loss (>= -64) this node's delta equals Z = infinity's up to 1e-23
    big = mus >= ADD_INFINITE
    tail = tail + float(weights[big].sum())
    for mu, w in zip(mus[~big], weights[~big]):
        # below the loss at x_c = mu/2 + X_TAIL the node's delta is 1 - e^eps up to
        # Phi(-x_c) + e^loss(x_c) (q Phi(mu - x_c) + Phi(-x_c)) <= 1e-23 (both sides have all mass above it)
        bottom = _add_loss(mu, q, mu / 2.0 + X_TAIL)
        first = min(len(eps), max(0, int(math.ceil(bottom / d)) - lo))
        part = live.copy()
        part[:first] = False
        out[:first] += w * -np.expm1(eps[:first])
        out[part] += w * delta_add(mu, q, eps[part])
    out += tail * np.where(live, -np.expm1(eps + math.log1p(-q)), 0.0)  # Z = infinity
    return np.minimum(1.0, np.maximum(out, 0.0) + NEGLIGIBLE)


def _nodes(q: float, sigma: float, r: int, d: float, max_loss: float):
    """Pessimistic quadrature nodes (mu = upper bin end / sigma), weights, tail, and the remove grid [lo, hi]."""
    edges, probs, tail = z_bins(q, sigma, r, max_loss)
    keep = probs > 0
    mus, weights = edges[keep] / sigma, probs[keep]
    # remove direction: losses in [log(1-q), inf); the grid stops where every node's delta is negligible
    lo = int(math.floor(math.log1p(-q) / d))
    hi = int(math.ceil(min(max_loss, max([_remove_loss(mu, q, mu + X_TAIL) for mu in mus] + [d])) / d))
    return mus, weights, tail, lo, hi


def step_infinity_mass(q: float, sigma: float, r: int, discretization: float = 1e-3,
                       max_loss: float = 64.0) -> float:
    """The remove-direction infinity mass of step_pld(...) (delta at the grid's top), without building the PLD."""
    mus, weights, tail, _, hi = _nodes(q, sigma, r, discretization, max_loss)
    return float(_remove_curve(mus, weights, tail, q, hi, hi, discretization)[0])


def step_pld(q: float, sigma: float, r: int, discretization: float = 1e-3,
             max_loss: float = 64.0) -> pld_lib.PrivacyLossDistribution:
    """Pessimistic PLD of one Poisson-subsampled DP-SGD-JL step (both adjacency directions)."""
    d = discretization
    mus, weights, tail, r_lo, r_hi = _nodes(q, sigma, r, d, max_loss)
    pmf_remove = pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(
        d, r_lo, r_hi, _remove_curve(mus, weights, tail, q, r_lo, r_hi, d))
    # add direction: losses in (-inf, -log(1-q)]; mass below the grid is lumped at its bottom (pessimistic)
    a_hi = int(math.ceil(-math.log1p(-q) / d))
    bottoms = [_add_loss(mu, q, mu / 2.0 + X_TAIL) for mu in mus if mu < ADD_INFINITE]
    a_lo = int(math.floor(max(-max_loss, min(bottoms + [-d])) / d))
    pmf_add = pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(
        d, a_lo, a_hi, _add_curve(mus, weights, tail, q, a_lo, a_hi, d))
    return pld_lib.PrivacyLossDistribution(pmf_remove, pmf_add)


def tail_lower_bound(steps: list[tuple[float, float, int, int]], epsilon: float) -> float:
    """A certified LOWER bound on the composed delta(epsilon), from the heavy tail of Z alone.

    `steps`: (q, sigma, r, count). Test S = {some step's remove-direction loss > b}, b = epsilon + s. Steps are
    independent, so P_upper(S) = 1 - prod (1 - P)^count >= 1 - prod (1 - u)^count and P_lower(S) <= sum count e^-b P
    <= sum count e^-b U, where P = P_upper(loss > b) lies between
    u = max over z0 of P(Z > z0) q Phi(mu0/2 - c/mu0) (mu0 = z0/sigma, c = log((e^b-1+q)/q); Phi(mu/2 - c/mu) grows
    with mu) and U = delta_step(e') / (1 - e^(e' - b)) for a grid point e' <= b - 1 (delta(e') = E[(1 - e^(e'-L))+] >=
    (1 - e^(e'-b)) P; delta_step from the accountant's pessimistic curve, an upper bound). Review 63: the second sum
    took u, a lower bound, where the argument needs an upper one (the bound came out 1-6% too high).
    delta(epsilon) >= P_upper(S) - e^epsilon P_lower(S)."""
    n = sum(c for *_, c in steps)
    s = math.log(max(n, 1)) + 3.0  # e^-s * n = e^-3: the lower side costs 5%
    b = epsilon + s
    log_miss, lower = 0.0, 0.0
    for q, sigma, r, count in steps:
        log_c = b + math.log1p(-(1.0 - q) * math.exp(-b)) - math.log(q)
        z0 = np.geomspace(1e-2, 1e12, 2000)
        mu0 = z0 / sigma
        u = float(np.max(z_survival(z0, r) * q * special.ndtr(mu0 / 2.0 - log_c / mu0)))
        log_miss += count * math.log1p(-u)
        lower += count * math.exp(-s) * tail_upper_bound(q, sigma, r, b)
    return -math.expm1(log_miss) - lower


def tail_upper_bound(q: float, sigma: float, r: int, b: float, discretization: float = 1e-3) -> float:
    """An upper bound on P(remove-direction loss > b) of one step: delta_step(e') / (1 - e^(e' - b)) at the grid
    point e' = floor((b - 1) / d) d, with delta_step the pessimistic curve step_pld is built from (Markov's argument on
    the hockey stick: delta(e') >= (1 - e^(e' - b)) P(loss > b) for e' < b)."""
    mus, weights, tail, _, _ = _nodes(q, sigma, r, discretization, 64.0)
    k = math.floor((b - 1.0) / discretization)
    with np.errstate(over="ignore"):  # 1 - e^e' is evaluated (and not taken) above log(1 - q) too
        delta = float(_remove_curve(mus, weights, tail, q, k, k, discretization)[0])
    return min(1.0, delta / -math.expm1(k * discretization - b))
