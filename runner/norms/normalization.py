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

from runner.norms.base import NormRule, register, trains


class AffineRule(NormRule):
    """Shared math; subclasses define normalized(layer, x) -> (xhat (B, T, D), view of g as (B, T, D))."""

    params = ("weight", "bias")

    def sequence(self, layer, inp, grad_out):
        return self.normalized(layer, inp), self.as_features(layer, grad_out)

    def norm_sq(self, layer, a, g, how, stash=None):
        total = a.new_zeros(a.shape[0])
        if trains(layer.weight):
            total = total + (g * a).sum(1).pow(2).sum(1)  # (B, D) per-example grad gamma
        if trains(getattr(layer, "bias", None)):
            total = total + g.sum(1).pow(2).sum(1)  # (B, D) per-example grad beta
        return total

    def clipped_sums(self, layer, a, g, nu, stash=None):
        sums: dict[str, torch.Tensor] = {}
        if trains(layer.weight):
            sums["weight"] = torch.einsum("b,btd->d", nu, g * a).reshape(layer.weight.shape)
        if trains(getattr(layer, "bias", None)):
            sums["bias"] = torch.einsum("b,btd->d", nu, g).reshape(layer.bias.shape)
        return sums


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
