"""Certified clipping: per-example norms that provably bound what is summed, whatever the input (issue 26).

A clip factor nu_i = C / N_i bounds example i's contribution only if N_i >= the norm of what is actually summed
for it: the exact per-example gradient G_i of the tensors fed to the clipped sum (the recorded inputs and
output-gradients, or a kept per-example gradient). Floating point can break that: the ghost norm
sum_{s,t} (a_s.a_t)(g_s.g_t) cancels catastrophically on near-constant inputs (a float32 value of 0 for a gradient
of norm 1), and a direct norm is taken of a per-example gradient rounded differently from what the clipped sum adds.
So every rule's norm_sq returns, per example, a certified upper bound of ||G_i||^2, whatever the input, and the
clip factor uses N_i = sqrt((sum over L layers) (1 + gamma_L)) (1 + 4u) >= ||G_i||. docs/privacy.md ("Certified clipping") derives
each bound and names what is not covered (the rounding of the final reductions over examples, chunks and ranks,
and the noise draw's own floating-point weakness).

The rounding model (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3): a dot product or sum of n
terms computed in ANY order, with or without FMA, has |error| <= gamma_n * sum |terms|, gamma_n = n u / (1 - n u),
u the unit roundoff (2^-24 float32, 2^-53 float64). The bounds are worst case, not statistical: an adversary
choosing the input cannot beat them. TF32 (10-bit mantissa) matmuls and convolutions on CUDA would void them, so
the norm and clipped-sum computations run with TF32 off (`exact_float32`). Cauchy-Schwarz turns every entry bound
into one per example: |a_s.a_t| <= ||a_s|| ||a_t||, so the cancellation error of a ghost norm is at most
(gamma_k + gamma_o + ...) S_i^2 with S_i = sum_t ||a_t|| ||g_t||, which also bounds ||G_i|| itself (the triangle
inequality): a ghost value that cancelled away is replaced by at most S_i, never by something smaller than the truth.
The model holds for normal numbers; where a norm multiplies another tensor's, it is first raised to an underflow floor
(underflow_floor), so that squares lost below float32's smallest normal cannot shrink the bound (stop 35).

    upper_sq = sum(rule.norm_sq(layer, a, g, how, stash) for each layer)   # (B,) >= ||G_i||^2
    norms = certified_norms(upper_sq)                                       # (B,) N_i; inf/nan where not finite
    nu = clip_factors(norms, C)         # runner/methods/base.py: 0 where N_i is not finite, and finite_rows()
                                        # zeroes that record's rows in every clipped sum (no 0 * inf)
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
import warnings

import torch

from runner.fp32_mode import tf32_enabled, tf32_paused


def unit(t: torch.Tensor) -> float:
    """Unit roundoff of t's floating dtype: 2^-24 (float32), 2^-53 (float64)."""
    return torch.finfo(t.dtype).eps / 2


def gamma(n: int, u: float) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of an n-term sum or dot product, any order."""
    nu = n * u
    return nu / (1.0 - nu) if nu < 0.5 else float("inf")


_NOTHING = contextlib.nullcontext()


def exact_float32(device: torch.device):
    """TF32 off for the norms and clipped sums (CUDA): the bounds assume float32's 24-bit products. The CPU's oneDNN
    float32 mode is set once per step (runner/precision.py matmul_precision), so here a shared no-op (entered once per
    layer and step: a generator context there cost ~5 us each); so too on CUDA where TF32 is already off, and in
    a compiled step, which the step's own context covers (compile= with precision=tf32 is refused)."""
    if device.type != "cuda" or torch.compiler.is_compiling() or not tf32_enabled():
        return _NOTHING  # compiled: a graph keeps aten ops only, not this switch (runner/methods/compiled.py)
    return tf32_paused()


def upper_sqnorm(t: torch.Tensor) -> torch.Tensor:
    """(N,) upper bounds of ||t[i]||^2 for t (N, ...): a two-level norm (rows, then the rows' norms), so the sum of
    m squares is reduced in depth ~ 2 sqrt(m) and the certified factor (1 + gamma) stays ~1e-5, not gamma_m."""
    n = t.shape[0]
    flat = t.reshape(n, -1)
    m = flat.shape[1]
    if m <= 1024:  # one level: gamma_{m+3} <= 6e-5 already (and one kernel fewer)
        return torch.linalg.vector_norm(flat, dim=1).square_().mul_(1 + gamma(m + 3, unit(t)))
    width = max(1, int(m ** 0.5))
    while m % width:  # a divisor near sqrt(m): rows of equal length (m prime: one level)
        width -= 1
    rows = torch.linalg.vector_norm(flat.view(n, m // width, width), dim=2)  # (N, m / width)
    return torch.linalg.vector_norm(rows, dim=1).square().mul_(1 + gamma(width + m // width + 6, unit(t)))


def add_sqnorm_(acc: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """acc (N,) + upper bounds of ||t[i]||^2, in place (a layer's weight bound plus its bias's, book-keeping's kept
    sums): for rows of at most 1024 entries upper_sqnorm's one-level bound in ONE addcmul, the norm squared, times its
    factor and added with the same three roundings as square_, mul_ and add (two kernels fewer a layer: a GPU step of
    a small model is launch-bound); longer rows through upper_sqnorm."""
    n = t.shape[0]
    flat = t.reshape(n, -1)
    m = flat.shape[1]
    if m > 1024 or acc.dtype != t.dtype:
        return acc.add_(upper_sqnorm(t))
    norms = torch.linalg.vector_norm(flat, dim=1)  # (N,)
    return acc.addcmul_(norms, norms, value=1 + gamma(m + 3, unit(t)))


def vector_norms(t: torch.Tensor, dim) -> torch.Tensor:
    """torch.linalg.vector_norm(t, dim=dim). On the CPU, for a t that is not contiguous (a conv's output-gradient
    seen as (B, L, G, o): a view of (B, C_out, L), its feature dim strided by L), as the root of a sum of squares:
    the CPU norm kernel reduces a strided dim ~30x slower. Both are d squares, a d-term sum and a root, rounded alike
    (norm_factor); both overflow to inf for squares past float32's range."""
    if (t.device.type == "cpu" and not t.is_contiguous()) or _one_entry(t, dim):
        return t.square().sum(dim).sqrt_()
    return torch.linalg.vector_norm(t, dim=dim)


def _one_entry(t: torch.Tensor, dim) -> bool:
    """Rows of one entry: torch's norm returns |t| there (no square, so no overflow), and a record above ~1e19 would
    keep a finite norm; its square overflows like any longer row's, so its example is dropped (nu = 0) wherever the
    clipped sum multiplies the rows (not where a kept G_i is summed), which the clipped sums' rounding bound needs
    (review 64: the rows that multiply weighted entries stay below 2^64)."""
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    return all(t.shape[d] == 1 for d in dims)


def underflow_floor(d: int, u: float, dtype: torch.dtype = torch.float32) -> float:
    """delta_d: the floor a computed norm of d entries is raised to before it multiplies a norm of another tensor.

    A square or a product that lands below the dtype's smallest normal (finfo.tiny: 2^-126 in float32 and bf16)
    loses up to `tiny`, absolutely (rounded to a subnormal, or flushed to zero where denormals are off), which no
    relative gamma covers: rows of 1e-23 have computed norm 0. Alone such a loss is below 1e-19 sqrt(d) and the clip
    factor's + 1e-6 absorbs it, but a norm bound that multiplies it by another tensor's norm (a rank-one
    ||a|| ||g||, a mass sum_t ||a_t|| ||g_t||, a ghost Gram entry times the other Gram's) can be off by far more:
    a ~ 1e17 with g ~ 1e-23 certified 0.3 x the true norm (stop 35). With c the computed norm (already times its
    norm_factor), true^2 <= c^2 + d tiny, so true <= max(c, delta) (1 + u) for delta^2 = d tiny / u: raising each
    such norm to delta costs one (1 + u) and changes nothing for rows above ~1e-14 sqrt(d) (float32)."""
    return math.sqrt(d * torch.finfo(dtype).tiny / u)


def norm_factor(d: int, u: float) -> float:
    """vector_norm of d entries, rounded: the true norm is at most the computed one times this (d squares, a root).
    A row whose squares overflow float32 (|t| > ~1e19) comes out inf: its example is then dropped (nu = 0)."""
    return 1 + gamma(d + 2, u)


def summed_vector(parts: torch.Tensor, masses: torch.Tensor, terms: int) -> torch.Tensor:
    """(N,) upper bounds of ||v_i||^2 for per-example gradients v_i = sum_s w_is (a bias: w_s = g_s) formed in
    floating point: parts (N, d) the computed sums, masses (N,) >= sum_s ||w_is||, `terms` summands per example:
    ||v_i|| <= ||computed_i|| (1 + gamma_d) + gamma_terms mass_i (the sum may cancel; the mass cannot), and
    ||v_i|| <= mass_i (the triangle inequality)."""
    u = unit(parts)
    f = norm_factor(parts.shape[-1], u)
    upper = torch.linalg.vector_norm(parts, dim=-1).add_(masses, alpha=gamma(terms, u) / f)  # (N,) x f
    return torch.fmin(upper, masses.div(f)).square_().mul_(f * f * (1 + 3 * u))


def summed_bounds(parts: torch.Tensor) -> torch.Tensor:
    """(N,) upper bounds of each row's sum of n non-negative upper bounds, parts (N, n) (a grouped conv's per-group
    squared norms), whatever order the reduction takes: the computed sum is at least the exact one times
    1 - gamma_{n-1} (each term through at most n - 1 roundings), and the float32 factor and the product round twice
    more, so the sum is scaled by 1 + gamma_{n+2} (docs/privacy.md). Without it a sum of 64 group bounds added in the
    worst order could land 63u under the exact one, more than the layers' own margins cover."""
    n = parts.shape[1]
    return parts.sum(1).mul_(1 + gamma(n + 2, unit(parts)))


def certified_norms(upper_sq: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """(B,) N_i >= ||G_i|| from the layers' summed upper bounds (B,): `terms` layers' values added in floating point
    (non-negative terms: the computed sum is >= the exact one times 1 - gamma_{terms-1}), then the root, each rounded
    up; inf or nan where not finite (clip_factors then gives 0: the example contributes nothing)."""
    u = unit(upper_sq)
    return upper_sq.clamp_min(0).sqrt_().mul_((1 + 4 * u) * (1 + gamma(max(terms, 1), u)) ** 0.5)


# the clipped sums of the step being formed: (nu, keep = nu > 0, every example kept) (clipped_sums_of)
_STEP: contextvars.ContextVar = contextvars.ContextVar("dprun_clipped_sums", default=None)


@contextlib.contextmanager
def clipped_sums_of(nu: torch.Tensor, keep: torch.Tensor, all_kept: bool):
    """Around one pass of a step's clipped sums, nu (B,) its clip factors and keep = nu > 0 (formed once: kept(nu)).
    all_kept True: finite_rows masks nothing, no record is copied (each layer's records went through a where per
    tensor before: ~60 small kernels a step on the IMDB transformer, most of the certified step's cost over the
    uncertified one on a GPU, issue 26); False: the rows of the examples not kept are masked out. Book-keeping forms
    its sums with True, then asks every_record_kept(keep) once, and forms them again with False only if an example was
    dropped (runner/methods/reweight.py book_keeping). Inside a compiled graph nothing is set (dynamo cannot trace a
    ContextVar: a graph break per call) and the rows are masked."""
    if torch.compiler.is_compiling():
        yield
        return
    token = _STEP.set((nu, keep, all_kept))
    try:
        yield
    finally:
        _STEP.reset(token)


def read_started(keep: torch.Tensor):
    """CUDA, eager: keep.all() (B,) -> () copied to pinned host memory behind an event, before the clipped sums are
    launched, so that every_record_kept then waits for the kernels before it (the backward's, the norms') and not for
    the sums': the GPU works through them while the host goes on (noise, update, the next forward). Asked after the
    sums with a plain read, the host waited for their last kernel and the GPU then idled until its next launch.
    None elsewhere (the CPU reads the value itself; a compiled step asks nothing); DPRUN_EVENT_READ=0: None on CUDA
    too, the plain read."""
    if keep.device.type != "cuda" or torch.compiler.is_compiling() or os.environ.get("DPRUN_EVENT_READ") == "0":
        return None
    host = torch.empty((), dtype=torch.bool, pin_memory=True)
    host.copy_(keep.all(), non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(keep.device))
    return host, done


def every_record_kept(keep: torch.Tensor, started=None) -> bool:
    """bool(keep.all()): the one value an eager private step reads back from the device, by design (issue 12's rule
    is none; a compiled step masks instead of asking). started: read_started(keep)'s (host value, event), the value
    already on its way: a wait for that event only. An event wait raises no sync-debug warning, so one is raised
    here under torch.cuda.set_sync_debug_mode (bench-syncs counts every wait of a step)."""
    if started is None:
        return bool(keep.all())
    host, done = started
    if torch.cuda.get_sync_debug_mode():
        warnings.warn("dprun: the step's one read (an event wait, runner/norms/certify.py every_record_kept)")
    done.synchronize()
    return bool(host)


def kept(nu: torch.Tensor) -> torch.Tensor:
    """nu > 0 (B,) bool: the examples whose records are summed (a non-finite norm gives nu = 0); formed once a step
    inside clipped_sums_of."""
    step = None if torch.compiler.is_compiling() else _STEP.get()
    return step[1] if step is not None and step[0] is nu else nu > 0


def finite_rows(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """t (N, ...) with the rows of examples not kept (keep (N,) bool: a non-finite norm) set to 0, so that a NaN or
    inf of one record cannot reach the sum through 0 * inf (it contributes nothing). t itself when every row is kept
    (the common case: no copy of t): known for the step inside clipped_sums_of, else asked here on the CPU (no device
    sync); not inside a compiled graph, where that branch on the data would break the graph."""
    if torch.compiler.is_compiling():
        return torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))
    step = _STEP.get()
    if (step is not None and step[2] and keep is step[1]) or (t.device.type == "cpu" and bool(keep.all())):
        return t
    return torch.where(keep.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype, device=t.device))
