"""Per-example gradients that are sums of outer products: grad_i W = sum_t g_it a_it^T (Linear, unfolded Conv).

With a (N, T, k) layer inputs and g (N, T, o) output-gradients of N examples over T positions:

    direct:  materialise G_i = g_i^T a_i (N, o, k), then ||G_i||^2          cost ~ N*T*k*o,  memory N*o*k
    ghost:   ||G_i||^2 = sum_{t,s} (a_t . a_s)(g_t . g_s)                    cost ~ N*T^2*(k+o), memory N*T^2

    stash = {}                                   # book-keeping mode: keep G_i for the clipped sum
    norm_sq(a, g, "auto", stash)                 # (N,); T == 1 is ||g||^2 ||a||^2 (Goodfellow's trick)
    clipped_sum(a, g, nu, stash)                 # (o, k): sum_i nu_i G_i from the stash, else one GEMM

"auto" without a stash (two-pass mode) picks the cheaper norm by flop count, T*(k+o) < k*o. With a stash
(book-keeping) direct also serves the clipped sum (sum_i nu_i G_i costs N*o*k), while ghost needs one more
GEMM over the N*T rows; but materialising G_i is a bmm with inner dimension T, memory-bound when T is small,
so ghost still wins when T^2*(k+o) < BK_GHOST*k*o (measured on CPU: an LSTM's h_proj at T=28, 128->512,
ghost+GEMM 20 ms vs direct 54 ms; bu_cnn's conv2, T=25, 256->32, a tie; a transformer FF, T=256, direct).

Memory (issue 12): a kept G_i lives until the clipped sums, next to every other layer's records, so it is kept
only when it is no larger than the layer's own recorded a and g (o*k <= T*(k+o), `keeps`); otherwise the choice
is the stash-free one (flops) and the clipped sum is one GEMM (or the conv weight-gradient kernel). Ghost's
N*T^2 Gram matrices and a direct G_i that is not kept are transients, freed before the next layer.
"""
from __future__ import annotations

import torch

BK_GHOST = 16  # book-keeping: ghost when T^2*(k+o) < 16*k*o


def use_ghost(T: int, k: int, o: int, how: str, stash: bool = False) -> bool:
    if how != "auto":
        return how == "ghost"
    if stash:
        return T * T * (k + o) < BK_GHOST * k * o
    return T * (k + o) < k * o  # N*T^2*(k+o) < N*T*k*o


def keeps(T: int, k: int, o: int) -> bool:
    """Book-keeping may keep the per-example gradient (N*o*k) only when it is no larger than a and g (N*T*(k+o))."""
    return o * k <= T * (k + o)


def sqnorm(t: torch.Tensor) -> torch.Tensor:
    """(N,) squared norm of each t[i], without materialising t**2 (a large temporary for per-example grads)."""
    return torch.linalg.vector_norm(t.reshape(t.shape[0], -1), dim=1).square()


def norm_sq(a: torch.Tensor, g: torch.Tensor, how: str = "auto", stash: dict | None = None,
            key: str = "weight") -> torch.Tensor:
    N, T, k = a.shape
    o = g.shape[-1]
    if T == 1:  # (N,): rank-one per-example gradient
        return sqnorm(g) * sqnorm(a)
    if stash is not None and not keeps(T, k, o):
        stash = None  # memory: do not keep G_i for the clipped sum (clipped_sum falls back to one GEMM)
    if use_ghost(T, k, o, how, stash is not None):
        aa = torch.bmm(a, a.transpose(1, 2))  # (N, T, T)
        gg = torch.bmm(g, g.transpose(1, 2))  # (N, T, T)
        return (aa * gg).sum((1, 2))
    per_example = torch.bmm(g.transpose(1, 2), a)  # (N, o, k)
    if stash is not None:
        stash[key] = per_example
    return sqnorm(per_example)


def clipped_sum(a: torch.Tensor, g: torch.Tensor, nu: torch.Tensor, stash: dict | None = None,
                key: str = "weight") -> torch.Tensor:
    """sum_i nu_i g_i^T a_i, shape (o, k): the weight gradient of the nu-weighted loss, without a backward."""
    if stash is not None and key in stash:
        per_example = stash.pop(key)  # (N, o, k)
        return torch.mm(nu.unsqueeze(0), per_example.flatten(1)).view(per_example.shape[1:])
    o, k = g.shape[-1], a.shape[-1]
    weighted = g * nu.view(-1, 1, 1)  # (N, T, o)
    return weighted.reshape(-1, o).t() @ a.reshape(-1, k)  # (o, k)


def bias_norm_sq(g: torch.Tensor) -> torch.Tensor:
    """(N,) squared norm of the per-example bias gradient sum_t g_t; g (N, T, o)."""
    return g.sum(1).pow(2).sum(1)


def bias_clipped_sum(g: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
    """(o,) sum_i nu_i sum_t g_it."""
    return torch.einsum("b,bto->o", nu, g)
