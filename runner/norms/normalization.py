"""LayerNorm, GroupNorm, RMSNorm (L&K 5.5): y = gamma * xhat + beta, elementwise per feature.

Per example, grad gamma = sum_t g_t * xhat_t and grad beta = sum_t g_t over the positions t that share the
affine parameters (sequence positions for LayerNorm, spatial positions for GroupNorm), so the rule only needs
xhat (recomputed from the recorded input without the affine part) and the output-gradient, both (B, T, D).
BatchNorm is rejected elsewhere (runner/norms/coverage.py): its examples are not independent.

    a, g = NormalizationRule().sequence(ln, x, grad_out)   # xhat (B, T, D), g (B, T, D)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runner.norms.base import NormRule, register, total, trains
from runner.norms.certify import finite_rows, gamma, kept, norm_factor, summed_vector, unit, upper_sqnorm, vector_norms


class AffineRule(NormRule):
    """Shared math; subclasses define normalized(layer, x) -> (xhat (B, T, D), view of g as (B, T, D))."""

    params = ("weight", "bias")

    def sequence(self, layer, inp, grad_out):
        return self.normalized(layer, inp), self.as_features(layer, grad_out)

    def norm_sq(self, layer, a, g, how, stash=None):
        if stash is not None and trains(layer.weight) and trains(getattr(layer, "bias", None)):
            return both_sums(a, g, stash)
        parts = []
        if trains(layer.weight):  # per-example grad gamma: sum_t g_t * xhat_t (B, D)
            parts.append(per_example_sum(g * a, stash, "weight"))
        if trains(getattr(layer, "bias", None)):  # per-example grad beta: sum_t g_t (B, D)
            parts.append(per_example_sum(g, stash, "bias"))
        return total(parts, a)

    def clipped_sums(self, layer, a, g, nu, stash=None):
        sums: dict[str, torch.Tensor] = {}
        both = stash.pop("both", None) if stash else None
        if both is not None:  # (B, 2D): gamma's then beta's per-example sums, as both_sums measured them
            flat = nu.unsqueeze(0).mm(finite_rows(both, kept(nu))).view(-1)  # (2D,): one product for the two
            D = flat.shape[0] // 2
            return {"weight": flat[:D].view(layer.weight.shape), "bias": flat[D:].view(layer.bias.shape)}
        for name, summand in (("weight", lambda: g * a), ("bias", lambda: g)):  # (B, T, D) per-position gradients
            param = getattr(layer, name, None)
            if trains(param):
                stashed = stash.pop(name, None) if stash else None
                per_example = stashed if stashed is not None else summand().sum(1)  # (B, D)
                sums[name] = nu.unsqueeze(0).mm(finite_rows(per_example, kept(nu))).view(param.shape)
        return sums

    def stash_only(self, layer, stash):
        """norm_sq kept every per-example sum (book-keeping): the clipped sums are products of those alone."""
        return all(n in stash for n in ("weight", "bias") if trains(getattr(layer, n, None)))

    def clipped_sums_calls(self, layer, calls, nu, stash=None):
        """Book-keeping kept every per-example sum: no (xhat, g) rebuilt from the calls (issue 31)."""
        wanted = [n for n in ("weight", "bias") if trains(getattr(layer, n, None))]
        if stash is not None and all(n in stash for n in wanted):
            return self.clipped_sums(layer, None, None, nu, stash)
        return super().clipped_sums_calls(layer, calls, nu, stash)


def both_sums(a: torch.Tensor, g: torch.Tensor, stash: dict) -> torch.Tensor:
    """Book-keeping, gamma and beta both trained: their per-example sums side by side in one (B, 2D) tensor, kept in
    `stash` ("both"; "weight" and "bias" its halves), and the (B,) certified squared norm of each row: the two
    parameters' squared norms in one norm (upper_sqnorm over 2D entries, certified as for D), and the clipped sums
    in one product (clipped_sums): four kernels fewer per layer than two per_example_sum (ResNet-18 has 20 GroupNorms
    and its GPU step is launch-bound)."""
    D = g.shape[-1]
    # gamma's sum_t g_t * xhat_t, then beta's sum_t g_t: (B, 2D). A cat of the two (B, D) sums, not sums written
    # into halves of one buffer (out= on a strided view breaks torch.compile's graph)
    both = torch.cat([(g * a).sum(1), g.sum(1)], 1)
    stash.update(both=both, weight=both[:, :D], bias=both[:, D:])
    return upper_sqnorm(both)


def per_example_sum(w: torch.Tensor, stash: dict | None, key: str) -> torch.Tensor:
    """(B,) certified squared norms of the per-example sums v_i = sum_t w_it, w (B, T, D). Book-keeping keeps v (B, D)
    in `stash`: the clipped sum is then one (1, B) x (B, D) product of the very vectors measured (and no second pass
    over (B, T, D): issue 31); otherwise the clipped sum is another reduction of w, so the bound covers the exact v."""
    sums = w.sum(1)  # (B, D)
    if stash is not None:
        stash[key] = sums
        return upper_sqnorm(sums)
    T, u = w.shape[1], unit(w)
    mass = vector_norms(w, -1).sum(1).mul_(norm_factor(w.shape[-1], u) * (1 + gamma(T + 2, u)))
    return summed_vector(sums, mass, T)


@register(nn.LayerNorm)
class LayerNormRule(AffineRule):
    def normalized(self, layer, x):
        xhat = F.layer_norm(x, layer.normalized_shape, None, None, layer.eps)
        return self.as_features(layer, xhat)

    def as_features(self, layer, t):  # (B, ..., *normalized_shape) -> (B, T, D)
        return t.reshape(t.shape[0], -1, math.prod(layer.normalized_shape))


@register(nn.RMSNorm)
class RMSNormRule(LayerNormRule):
    params = ("weight",)

    def normalized(self, layer, x):
        return self.as_features(layer, F.rms_norm(x, layer.normalized_shape, None, layer.eps))


@register(nn.GroupNorm)
class GroupNormRule(AffineRule):
    def normalized(self, layer, x):
        return self.as_features(layer, F.group_norm(x, layer.num_groups, None, None, layer.eps))

    def as_features(self, layer, t):  # (B, C, *spatial) -> (B, S, C): spatial positions share gamma, beta
        return t.reshape(t.shape[0], layer.num_channels, -1).transpose(1, 2)
