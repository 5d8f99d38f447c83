"""nn.Embedding: grad_i W[v] = sum of the output-gradients at the positions of example i whose token is v.

A token repeated in one example contributes ONE row (the sum over its positions), and padding_idx rows get
no gradient, exactly as autograd. Both norm forms are exact:

    direct:  segment-sum g over the distinct (example, token) pairs, then squared row norms   cost ~ B*T*d + sort
    ghost:   sum_{t,s: x_t = x_s != pad} g_t . g_s                                           cost ~ B*T^2*d

    a, g = EmbeddingRule().sequence(emb, ids, grad_out)     # (B, T) int64, (B, T, d)
"""
from __future__ import annotations

import torch
from torch import nn

from runner.errors import DprunError
from runner.norms.base import NormRule, register, trains
from runner.norms.certify import finite_rows, kept, gamma, norm_factor, unit, vector_norms
from runner.norms.outer import summed_vector_sq


def keep_mask(layer: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) True where the token gets a gradient (not padding_idx)."""
    if layer.padding_idx is None:
        return torch.ones_like(ids, dtype=torch.bool)
    return ids != layer.padding_idx


@register(nn.Embedding)
class EmbeddingRule(NormRule):
    params = ("weight",)

    def check(self, layer, path):
        if layer.scale_grad_by_freq:
            raise DprunError(f"{path} (Embedding) has scale_grad_by_freq=True: its gradient depends on the whole "
                             f"batch's token counts, so per-example clipping is not exact; set it to False")

    def sequence(self, layer, inp, grad_out):
        B = inp.shape[0]
        return inp.reshape(B, -1), grad_out.reshape(B, -1, layer.embedding_dim)

    def norm_sq(self, layer, a, g, how, stash=None):
        if not trains(layer.weight):
            return g.new_zeros(a.shape[0])
        B, T = a.shape
        u = unit(g)
        g = g * keep_mask(layer, a).unsqueeze(-1).to(g.dtype)  # (B, T, d): padding positions give nothing
        d = g.shape[-1]
        # (B,) S_i >= sum_t ||g_t|| >= ||G_i|| (the triangle inequality), rounded up
        mass = vector_norms(g, -1).sum(1).mul_(norm_factor(d, u) * (1 + gamma(T + 2, u)))
        if how == "ghost":
            same = (a.unsqueeze(2) == a.unsqueeze(1)).to(g.dtype)  # (B, T, T) same token
            value = same.mul_(torch.bmm(g, g.transpose(1, 2))).sum(2).sum(1)  # depth 2T; may cancel: +- err
            err = gamma(d, u) + u + gamma(2 * T, u)
            mass_sq = mass.square()
            return torch.fmin(value.add_(mass_sq, alpha=err), mass_sq).mul_(1 + 3 * u)
        # Segment sum over the distinct (example, token) keys with fixed shapes only (a sort, not torch.unique): no
        # host sync, and a CUDA graph can capture it. N = B*T positions; segment s = the s-th distinct key.
        V = layer.num_embeddings
        keys = (torch.arange(B, device=a.device).unsqueeze(1) * V + a).reshape(-1)  # (N,) one key per (i, v)
        sorted_keys, order = keys.sort()  # (N,), (N,)
        starts = torch.ones_like(sorted_keys, dtype=torch.bool)
        starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
        segment = starts.cumsum(0) - 1  # (N,) segment of each sorted position
        per_row = g.new_zeros(keys.shape[0], d).index_add_(0, segment, g.reshape(-1, d)[order])  # (N, d); unused: 0
        example = torch.zeros_like(sorted_keys).scatter_(0, segment, sorted_keys // V)  # (N,) segment -> example
        value = g.new_zeros(B).index_add_(0, example, per_row.pow(2).sum(1))  # (B,) ||computed rows||^2
        # each row sums <= T gradients (off by <= gamma_T their norms); the squares and the segments round too
        return summed_vector_sq(value.mul_(1 + gamma(d + T + 4, u)), mass, gamma(T, u), u)

    def clipped_sums(self, layer, a, g, nu, stash=None):
        if not trains(layer.weight):
            return {}
        weighted = finite_rows(g * nu.view(-1, 1, 1), kept(nu))  # (B, T, d); a non-finite record adds nothing
        w = g.new_zeros(layer.weight.shape).index_add_(0, a.reshape(-1), weighted.reshape(-1, g.shape[-1]))
        if layer.padding_idx is not None:
            # zero_ on the row's view, not `w[pad] = 0`: traced, that assignment turns 0 into a CPU tensor constant,
            # which keeps Inductor from capturing a CUDA graph ("skipping cudagraphs due to cpu device")
            w.narrow(0, layer.padding_idx, 1).zero_()
        return {"weight": w}
