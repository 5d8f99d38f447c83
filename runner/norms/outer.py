"""Per-example gradients that are sums of outer products: grad_i W = sum_t g_it a_it^T (Linear, unfolded Conv).

With a (N, T, k) layer inputs and g (N, T, o) output-gradients of N examples over T positions:

    direct:  materialise G_i = g_i^T a_i (N, o, k), then ||G_i||^2          cost ~ N*T*k*o,  memory N*o*k
    ghost:   ||G_i||^2 = sum_{t,s} (a_t . a_s)(g_t . g_s)                    cost ~ N*T^2*(k+o), memory N*T^2
             (from T = 128: the Grams' upper block-triangle only, ghost_norm_sq: ~5/8 of that cost at 4 blocks)

    stash = {}                                   # book-keeping mode: keep G_i for the clipped sum
    norm_sq(a, g, "auto", stash)                 # (N,); T == 1 is ||g||^2 ||a||^2 (Goodfellow's trick)
    clipped_sum(a, g, nu, stash)                 # (o, k): sum_i nu_i G_i from the stash, else one GEMM

"auto" without a stash (two-pass mode) picks the cheaper norm by flop count, T*(k+o) < k*o. With a stash
(book-keeping) direct also serves the clipped sum (sum_i nu_i G_i costs N*o*k), while ghost needs one more
GEMM over the N*T rows; but materialising G_i is a bmm with inner dimension T, memory-bound when T is small,
so ghost still wins when T^2*(k+o) < BK_GHOST*k*o (measured on CPU: an LSTM's h_proj at T=28, 128->512,
ghost+GEMM 20 ms vs direct 54 ms; bu_cnn's conv2, T=25, 256->32, a tie; a transformer FF, T=256, direct).

Memory (issues 12, 31): a kept G_i lives until the clipped sums, in place of the layer's own recorded a and g
(the lean recorder frees those), so it is kept only when it is at most method.keep (default 1.1) times their size
(o*k <= keep*T*(k+o), `keeps`); otherwise the choice is the stash-free one (flops) and the clipped sum is one GEMM
(or the conv weight-gradient kernel). Ghost's
N*T^2 Gram matrices and a direct G_i that is not kept are transients, freed before the next layer.
"""
from __future__ import annotations

import torch

from runner.norms import tensor_cores as tc
from runner.norms.certify import (add_sqnorm_, finite_rows, kept, gamma, norm_factor, summed_vector, underflow_floor,
                                  unit, upper_sqnorm, vector_norms)

BK_GHOST = 16  # book-keeping: ghost when T^2*(k+o) < 16*k*o


def use_ghost(T: int, k: int, o: int, how: str, stash: bool = False) -> bool:
    if how != "auto":
        return how == "ghost"
    if stash:
        return T * T * (k + o) < BK_GHOST * k * o
    return T * (k + o) < k * o  # N*T^2*(k+o) < N*T*k*o


KEEP = 1.1  # method.keep's default: keep G_i up to 1.1x the records it replaces (issue 31; docs/methods.md)


class Stash(dict):
    """A layer's book-keeping stash (what norm_sq keeps for the clipped sum), with the method's keep rule: a ratio
    (method.keep) or a per-step budget (method.keep_mb, runner/norms/keep_budget.py), the layer's key, and whether
    the lean recorder defers the norms of record-keeping layers (method.defer on / all: a conv then keeps its records
    and is deferred, ConvRule.stash_only)."""

    def __init__(self, keep=KEEP, key=None, defers: bool = False):
        super().__init__()
        self.keep, self.key, self.defers = keep, key, defers

    def keeps(self, N: int, T: int, k: int, o: int, itemsize: int) -> bool:
        if isinstance(self.keep, (int, float)):
            return keeps(T, k, o, self.keep)
        return self.keep.admits(self.key, N, T, k, o, itemsize)


def keeps(T: int, k: int, o: int, ratio: float = KEEP) -> bool:
    """Book-keeping keeps the per-example gradient (N*o*k) when it is at most `ratio` (method.keep) times the
    layer's recorded a and g (N*T*(k+o)), which the lean recorder then frees: the clipped sum is nu @ G (N*o*k
    flops) instead of a GEMM over the N*T rows, for at most (ratio - 1) x the records in memory. ratio 0: never."""
    return o * k <= ratio * T * (k + o)


def stash_keeps(stash: dict, N: int, T: int, k: int, o: int, itemsize: int) -> bool:
    """Does book-keeping keep this layer's G_i in `stash`: its Stash's rule (method.keep or method.keep_mb), the
    default ratio for a plain dict."""
    return stash.keeps(N, T, k, o, itemsize) if isinstance(stash, Stash) else keeps(T, k, o)


def sqnorm(t: torch.Tensor) -> torch.Tensor:
    """(N,) squared norm of each t[i], without materialising t**2 (a large temporary for per-example grads)."""
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1).square()


def norm_sq(a: torch.Tensor, g: torch.Tensor, how: str = "auto", stash: dict | None = None,
            key: str = "weight") -> torch.Tensor:
    """(N,) certified upper bounds of ||G_i||^2, G_i = g_i^T a_i (runner/norms/certify.py), whatever the input.
    The rounding factors are Python floats folded into one multiplication (few kernels: GPU steps are launch-bound)."""
    if a.dtype == torch.bfloat16:
        return norm_sq_tensor_cores(a, g, how, stash, key)
    N, T, k = a.shape
    o = g.shape[-1]
    u = unit(a)
    if T == 1:  # rank-one per-example gradient: ||G_i|| = ||g_i|| ||a_i||, each norm raised to its underflow floor
        fk, fo = norm_factor(k, u), norm_factor(o, u)
        norm = floored_norms(vector_norms, a[:, 0], k, fk, u).mul_(floored_norms(vector_norms, g[:, 0], o, fo, u))
        return norm.square_().mul_((fk * fo) ** 2 * (1 + u) ** 4 * (1 + 5 * u))  # (N,)
    if stash is not None and not stash_keeps(stash, N, T, k, o, a.element_size()):
        stash = None  # memory: do not keep G_i for the clipped sum (clipped_sum falls back to one GEMM)
    if use_ghost(T, k, o, how, stash is not None):
        return ghost_norm_sq(a, g, k, o, u)[0]
    return direct_norm_sq(torch.bmm(g.transpose(1, 2), a), a, g, stash, key, u)


def ghost_parts(aa: torch.Tensor, gg: torch.Tensor, k: int, o: int, u_gram: float):
    """Grams aa = a a^T (N, T, T) and gg = g g^T (N, T, T), float32, their entries accumulated with unit roundoff
    u_gram -> (N,) certified ||G_i||^2 (the Grams are overwritten) and (N,) S_i^2 >= (sum_t ||a_t|| ||g_t||)^2."""
    T = aa.shape[-1]
    diag_a, diag_g = aa.diagonal(dim1=1, dim2=2), gg.diagonal(dim1=1, dim2=2)  # (N, T) views
    mass_sq = ghost_mass_sq(diag_a, diag_g, k, o, u_gram)  # read before the Grams are overwritten below
    value = (aa.mul_(gg)).sum(2).sum(1)  # (N,) two reductions of T terms (depth 2T, not T^2); may cancel
    return ghost_bound(value, mass_sq, k, o, u_gram, 2 * T, unit(aa))


def ghost_mass_sq(diag_a: torch.Tensor, diag_g: torch.Tensor, k: int, o: int, u_gram: float) -> torch.Tensor:
    """(N,) S_i^2 >= (sum_t ||a_t|| ||g_t||)^2 from the Grams' computed diagonals (N, T) (each >= 0: a sum of
    squares), rounded up, with A_t = max(||a_t||, delta_k) and G_t likewise (certify.underflow_floor): a diagonal
    entry may lose k tiny to underflow, which the floor turns into one more relative 2u, in S_i and in every Gram
    entry (ghost_bound)."""
    T, u = diag_a.shape[-1], unit(diag_a)
    ga, go = gamma(k, u_gram), gamma(o, u_gram)
    floor_a, floor_g = underflow_floor(k, u, diag_a.dtype) ** 2, underflow_floor(o, u, diag_a.dtype) ** 2
    mass_sq = diag_a.clamp_min(floor_a) * diag_g.clamp_min(floor_g)
    mass_sq = mass_sq.sqrt_().sum(1).square_()  # (N,)
    return mass_sq.mul_((1 + gamma(T + 3, u)) ** 2 * (1 + 2 * u) ** 2 / ((1 - ga) * (1 - go)))


def ghost_bound(value: torch.Tensor, mass_sq: torch.Tensor, k: int, o: int, u_gram: float, depth: int,
                u: float):
    """(N,) certified ||G_i||^2 from value, the computed sum of the T^2 products (a_s . a_t)(g_s . g_t) (each Gram
    entry accumulated with unit roundoff u_gram; every product reached the total through at most `depth` roundings
    of additions, any order), and mass_sq (ghost_mass_sq); and mass_sq itself."""
    ga, go = gamma(k, u_gram) + 2 * u, gamma(o, u_gram) + 2 * u  # each Gram entry: off by <= (gamma + 2u) A_s A_t
    # |value - ||G_i||^2| <= err S_i^2: each Gram entry is off by <= gamma ||a_s|| ||a_t|| (Cauchy-Schwarz),
    # then the products and their sums round; S_i^2 caps it: a value that cancelled away (or overflowed to nan)
    # falls back to the triangle inequality, never to less than the truth (fmin ignores a nan value)
    err = ga + go + ga * go + (u + gamma(depth, u)) * (1 + ga) * (1 + go)
    return torch.fmin(value.add_(mass_sq, alpha=err), mass_sq).mul_(1 + 3 * u), mass_sq


# Grams over at least 2 * GRAM_BLOCK_ROWS positions are formed by row blocks over their upper block-triangle: the
# Grams are symmetric, so sum_{s,t} = the diagonal blocks + 2 x the blocks above them, (nb + 1) / (2 nb) of the
# products of the full Grams for nb blocks (at most GRAM_BLOCKS). Measured on this 2-core CPU (float32, one
# layer's ghost norm, docs/bench.md "Stop 51"): a GPT-2-sized feed-forward layer (768 -> 3072) at T = 512, B = 8:
# 81.5 -> 57.3 ms (4 blocks; its weight-gradient GEMM: 97 ms); at T = 128, B = 32: 23.1 -> 20.2 ms (2 blocks).
# Below 128 positions one bmm per Gram is faster than several.
GRAM_BLOCK_ROWS = 64
GRAM_BLOCKS = 4


def gram_blocks(T: int) -> list[tuple[int, int]]:
    """The row blocks [start, stop) of a Gram over T positions: [(0, T)] below 2 * GRAM_BLOCK_ROWS, else
    min(GRAM_BLOCKS, T // GRAM_BLOCK_ROWS) blocks of (nearly) equal size."""
    nb = min(GRAM_BLOCKS, T // GRAM_BLOCK_ROWS) if T >= 2 * GRAM_BLOCK_ROWS else 1
    edges = [p * T // nb for p in range(nb + 1)]
    return list(zip(edges[:-1], edges[1:]))


def ghost_norm_sq(a: torch.Tensor, g: torch.Tensor, k: int, o: int, u_gram: float, bmm=torch.bmm):
    """(N,) certified ||G_i||^2 and (N,) S_i^2 (ghost_parts) from a (N, T, k), g (N, T, o) by the ghost identity,
    bmm(x, y) forming each Gram block (float32 output, entries accumulated with unit roundoff u_gram). Over many
    positions (gram_blocks) only the Grams' upper block-triangle is formed: block p's rows s:e against columns s:T,
    (N, e - s, T - s) per Gram, a transient (e - s) / T of a full Gram's. Each product sums first along its row
    (<= T - s terms), then D + 2 O per row (the diagonal block's part and the part above it; x2 exact), then over
    the T rows: depth <= 2T + 2, which ghost_bound's summation term takes."""
    T = a.shape[1]
    blocks = gram_blocks(T)
    if len(blocks) == 1:
        return ghost_parts(bmm(a, a.transpose(1, 2)), bmm(g, g.transpose(1, 2)), k, o, u_gram)
    diag_a, diag_g, rows = [], [], []  # per block: (N, e - s) each
    for s, e in blocks:
        aa = bmm(a[:, s:e], a[:, s:].transpose(1, 2))  # (N, e - s, T - s): rows s:e of a a^T, columns s:T
        gg = bmm(g[:, s:e], g[:, s:].transpose(1, 2))
        diag_a.append(aa.diagonal(dim1=1, dim2=2).clone())  # entries (t, t) for t in s:e
        diag_g.append(gg.diagonal(dim1=1, dim2=2).clone())
        products = aa.mul_(gg)
        rows.append(torch.add(products[:, :, :e - s].sum(2), products[:, :, e - s:].sum(2), alpha=2))
        del aa, gg, products  # before the next block's: one block's Grams alive at a time
    mass_sq = ghost_mass_sq(torch.cat(diag_a, 1), torch.cat(diag_g, 1), k, o, u_gram)
    return ghost_bound(torch.cat(rows, 1).sum(1), mass_sq, k, o, u_gram, 2 * T + 2, unit(mass_sq))


def direct_norm_sq(per_example: torch.Tensor, a: torch.Tensor, g: torch.Tensor, stash, key: str, u_gemm: float,
                   split_loss: float = 0.0) -> torch.Tensor:
    """(N,) certified ||G_i||^2 from the computed per-example gradients (N, o, k), each entry off by at most
    gamma_T(u_gemm) sum_t |g_t||a_t|: kept in `stash` (the clipped sum adds these very tensors, their norm is the
    certificate), else for the exact G_i (the computed one + slack), plus `split_loss` S_i (the tensor-core sum)."""
    value = upper_sqnorm(per_example)  # (N,) >= ||computed G_i||^2
    if stash is not None:
        stash[key] = per_example
        return value
    # the clipped sum is one GEMM over the rows, so the certificate is for the exact G_i: the computed one + slack
    N, T, k = a.shape
    o, u = g.shape[-1], unit(per_example)
    row_norms = tc.norms if a.dtype == torch.bfloat16 else vector_norms
    fk, fo = norm_factor(k, u), norm_factor(o, u)
    mass = (floored_norms(row_norms, a, k, fk, u) * floored_norms(row_norms, g, o, fo, u)).sum(1)  # (N,) S_i / f
    f = fk * fo * (1 + u) ** 2 * (1 + gamma(T + 2, u))
    return summed_vector_sq(value, mass.mul_(f), gamma(T, u_gemm) + split_loss, u, split_loss)


def norm_sq_tensor_cores(a: torch.Tensor, g: torch.Tensor, how: str, stash, key: str) -> torch.Tensor:
    """norm_sq for bf16 records on the tensor-core route (runner/norms/tensor_cores.py): Grams and per-example
    gradients as bf16 GEMMs with float32 output, their accumulation taken at U_ACCUMULATE; the clipped sum will be the
    split GEMM (clipped_sum), so each bound also covers its SPLIT_LOSS S_i (SINGLE_LOSS S_i with one GEMM:
    tc.sum_loss()). G_i is never kept: float32, it would be
    twice the bf16 records it replaces."""
    N, T, k = a.shape
    o, u = g.shape[-1], 2.0**-24
    if T == 1:  # rank one: ||G_i|| = ||g_i|| ||a_i||, plus the split sum's loss
        fk, fo = norm_factor(k, u), norm_factor(o, u)
        norm = floored_norms(tc.norms, a[:, 0], k, fk, u).mul_(floored_norms(tc.norms, g[:, 0], o, fo, u))  # (N,)
        return norm.square_().mul_((fk * fo * (1 + tc.sum_loss())) ** 2 * (1 + u) ** 4 * (1 + 5 * u))
    if use_ghost(T, k, o, how):
        upper, mass_sq = ghost_norm_sq(a, g, k, o, tc.U_ACCUMULATE, tc.bmm)
        return summed_vector_sq(upper, mass_sq.sqrt_(), tc.sum_loss(), u, tc.sum_loss())
    return direct_norm_sq(tc.bmm(g.transpose(1, 2), a), a, g, None, key, tc.U_ACCUMULATE, tc.sum_loss())


def summed_vector_sq(value: torch.Tensor, mass: torch.Tensor, slack: float, u: float,
                     split_loss: float = 0.0) -> torch.Tensor:
    """(N,) (sqrt(value) + slack mass)^2, capped by ((1 + split_loss) mass)^2: the square norm of what is summed for
    an example whose computed square norm is <= value (certified), off from it by <= slack mass (slack = gamma_T of
    the per-example product, + the tensor-core sum's split loss), whose summands' norms add up to <= mass."""
    upper = value.sqrt().mul_(1 + 2 * u).add_(mass, alpha=slack)
    return torch.fmin(upper, mass.mul(1 + split_loss)).square_().mul_(1 + 3 * u)


def floored_norms(row_norms, t: torch.Tensor, d: int, factor: float, u: float) -> torch.Tensor:
    """row_norms(t, -1) (or over dim 1 of a 2-D t) raised to underflow_floor(d) / factor: times `factor` (its
    norm_factor) and (1 + u), at least the true norm of each row of d entries, whatever underflow lost."""
    return row_norms(t, -1).clamp_min_(underflow_floor(d, u, t.dtype) / factor)


def clipped_sum(a: torch.Tensor, g: torch.Tensor, nu: torch.Tensor, stash: dict | None = None,
                key: str = "weight") -> torch.Tensor:
    """sum_i nu_i g_i^T a_i, shape (o, k): the weight gradient of the nu-weighted loss, without a backward."""
    keep = kept(nu)  # (N,) an example with a non-finite norm has nu = 0 and must add exactly nothing (no 0 * inf)
    if stash is not None and key in stash:
        per_example = finite_rows(stash.pop(key), keep)  # (N, o, k)
        return torch.mm(nu.unsqueeze(0), per_example.flatten(1)).view(per_example.shape[1:])
    o, k = g.shape[-1], a.shape[-1]
    if a.dtype == torch.bfloat16:  # the tensor-core route: nu g as bf16 operands, split in two (tc.summands)
        parts = tc.summands(finite_rows(g.float() * nu.view(-1, 1, 1), keep).reshape(-1, o))  # (N T, o) each
        rows = finite_rows(a, keep).reshape(-1, k)  # (N T, k) bf16
        total = tc.mm(parts[0].t(), rows)  # (o, k) float32
        for part in parts[1:]:
            total.add_(tc.mm(part.t(), rows))
        return total
    # nu multiplies the smaller side, a copy of (N, T, min(o, k)): the feed-forward's (B, T, 4d) side is the step's
    # largest transient at the end of a bk backward otherwise (14.6 MB of 84.7 on the bench transformer, keep=0)
    if o <= k:
        weighted, rows = finite_rows(g * nu.view(-1, 1, 1), keep), finite_rows(a, keep)  # (N, T, o), (N, T, k)
    else:
        weighted, rows = finite_rows(g, keep), finite_rows(a * nu.view(-1, 1, 1), keep)  # (N, T, o), (N, T, k)
    return weighted.reshape(-1, o).t() @ rows.reshape(-1, k)  # (o, k)


def rank_one_with_bias_sq(a: torch.Tensor, g: torch.Tensor, stash: dict | None = None) -> torch.Tensor:
    """(N,) certified upper bounds of ||G_i||^2 + ||b_i||^2 for a Linear with a bias at one position (T = 1):
    a (N, 1, k), g (N, 1, o) float32/float64. G_i = g_i a_i^T and b_i = g_i, so the sum is ||g_i||^2 (||a_i||^2 + 1)
    (the bias as a constant input 1): two norms and five scalar-per-row operations, three kernels fewer than the
    weight's and the bias's bounds added (a GPU step of a small model is launch-bound). The norms' rounding:
    ||a_i|| <= an_i nf(k), ||g_i|| <= gn_i nf(o) (norm_factor), so the sum is <= gn^2 (an^2 + 1) (nf(k) nf(o))^2;
    the square, add, square, product and the factor's product each round by at most (1 + u) (non-negative values),
    and the float32 factor itself by one more u: (1 + 8u) covers them. The bias's per-example gradient is g_i
    exactly: book-keeping keeps that view for its clipped sum."""
    N, _, k = a.shape
    o, u = g.shape[-1], unit(a)
    rows = g[:, 0]  # (N, o): the per-example bias gradient, no rounding
    if stash is not None:
        stash["bias"] = rows
    # ||g_i|| raised to its underflow floor (it multiplies ||a_i||^2 + 1, which may be ~1e38); ||a_i||^2 may lose
    # k tiny to underflow, which the + 1 turns into a relative k tiny < u: one more u
    fk, fo = norm_factor(k, u), norm_factor(o, u)
    an, gn = vector_norms(a[:, 0], 1), floored_norms(vector_norms, rows, o, fo, u)  # (N,) each
    factor = (fk * fo) ** 2 * (1 + u) ** 2 * (1 + 9 * u)
    return an.square_().add_(1).mul_(gn.square_()).mul_(factor)


def bias_norm_sq(g: torch.Tensor, stash: dict | None = None) -> torch.Tensor:
    """(N,) certified upper bounds of the squared per-example bias gradient sum_t g_t; g (N, T, o). Book-keeping
    keeps the sums (N, o) in `stash`: the clipped sum is then one (1, N) x (N, o) product of the very tensors
    measured (and no second pass over g: issue 31)."""
    N, T, o = g.shape
    sums = g.sum(1)  # (N, o)
    if stash is not None or T == 1:  # what book-keeping adds (or, T = 1, exactly g): its own norm
        if stash is not None:
            stash["bias"] = sums
        return upper_sqnorm(sums)
    mass = vector_norms(g, -1).sum(1).mul_(norm_factor(o, unit(g)) * (1 + gamma(T + 2, unit(g))))
    return summed_vector(sums, mass, T)


def with_bias_norm_sq(weight_sq: torch.Tensor, g: torch.Tensor, stash: dict) -> torch.Tensor:
    """(N,) weight_sq (the weight's certified bound, fresh: updated in place) + bias_norm_sq(g, stash) of
    book-keeping, the bias's per-example sums (N, o) kept in `stash` for its clipped sum and their bound added in one
    kernel (certify.add_sqnorm_)."""
    sums = g.sum(1)  # (N, o)
    stash["bias"] = sums
    return add_sqnorm_(weight_sq, sums)


def bias_clipped_sum(g: torch.Tensor, nu: torch.Tensor, stash: dict | None = None) -> torch.Tensor:
    """(o,) sum_i nu_i sum_t g_it: from the per-example sums the norm step kept (N, o), else one reduction."""
    sums = stash.pop("bias", None) if stash is not None else None
    if sums is None:
        sums = g.sum(1)
    keep = kept(nu)
    return nu.unsqueeze(0).mm(finite_rows(sums, keep)).squeeze(0)
