"""jl: GroupNorm, InstanceNorm and LayerNorm formed again from centred primitives, so its estimates and release agree.

jl estimates each example's norm from forward-mode tangents (or the derivative of the backward) and releases the
backward of sum_i nu_i loss_i; its accountant assumes the estimates are projections of exactly what is released.
torch's CPU GroupNorm and LayerNorm backwards form the input-gradient as a dy + b x + c (and GroupNorm's dgamma as
(sum g x - mean sum g) rstd), with x the raw input: on a group whose mean is large next to its spread (a crafted image of constant 1e4 pixels under a
conv), both cancel, their error ~u (mean / spread)^2 of the result. The forward-mode tangent is formed from the
centred values and stays accurate, so the two parted: a conv under a GroupNorm released 1e5 C under jl forward mode,
5.2 C already at a constant pixel value of 10, and dgamma alone 15.7 C (11 C under double_vjp; review 25 and its
follow-up, runner/bench/adversarial.py `conv_groupnorm_large_mean_image`, `groupnorm8_64x64_large_mean`). A LayerNorm
over positions (nn.LayerNorm([H, W]) on a conv's output) did the same: 1.6e6 C (review 28).

Here a forward hook replaces each such layer's output by the same function written in primitives:
(x - mean) * rsqrt(var + eps) * weight + bias, the mean and variance over the group. Every derivative of it, reverse,
forward or double, is then taken through the centred values x - mean, whose rounding is ~u relative. The layer's own
kernel still runs (its output is dropped, and with it its graph): a second pass over the layer's input, which jl pays
on these layers (a transformer's LayerNorms too). RMSNorm subtracts no mean: left to its kernel. A normalisation
kernel still in the step's graph (a functional call outside these modules) is refused (jl.py check_graph).

    centre_spatial_norms(model)    # jl's prepare: idempotent
"""
from __future__ import annotations

import torch
from torch import nn

HOOKED = "_dprun_centred_norm"  # a module already given the hook (prepare may run again)
CENTRED = (nn.GroupNorm, nn.modules.instancenorm._InstanceNorm, nn.LayerNorm)


def centred_group_norm(x: torch.Tensor, groups: int, weight, bias, eps: float) -> torch.Tensor:
    """group_norm(x, groups, weight, bias, eps) from primitives: x (B, C, *spatial), each of `groups` groups of C /
    groups channels normalised over its channels and positions."""
    grouped = x.reshape(x.shape[0], groups, -1)  # (B, G, C/G * positions)
    centred = grouped - grouped.mean(-1, keepdim=True)
    normalised = (centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)).reshape(x.shape)
    per_channel = (1, -1) + (1,) * (x.dim() - 2)  # weight, bias (C,) over (B, C, *spatial)
    if weight is not None:
        normalised = normalised * weight.view(per_channel)
    if bias is not None:
        normalised = normalised + bias.view(per_channel)
    return normalised


def centred_layer_norm(x: torch.Tensor, shape: tuple, weight, bias, eps: float) -> torch.Tensor:
    """layer_norm(x, shape, weight, bias, eps) from primitives: normalised over the last len(shape) dimensions."""
    dims = tuple(range(-len(shape), 0))
    centred = x - x.mean(dims, keepdim=True)
    normalised = centred * torch.rsqrt(centred.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        normalised = normalised * weight
    if bias is not None:
        normalised = normalised + bias
    return normalised


def _centred(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    x = args[0] if args else None
    if isinstance(module, nn.LayerNorm) and torch.is_tensor(x):
        return centred_layer_norm(x, tuple(module.normalized_shape), module.weight, module.bias, module.eps)
    if not torch.is_tensor(x) or x.dim() < 3:  # an unbatched InstanceNorm input: the kernel's own output
        return None
    if isinstance(module, nn.GroupNorm):
        return centred_group_norm(x, module.num_groups, module.weight, module.bias, module.eps)
    if module.training or not module.track_running_stats:  # instance statistics (a tracked one is refused elsewhere)
        return centred_group_norm(x, x.shape[1], module.weight, module.bias, module.eps)
    return None


def centre_spatial_norms(model: nn.Module) -> None:
    """Give every GroupNorm, InstanceNorm and LayerNorm of `model` the centred output (once per module)."""
    for module in model.modules():
        if isinstance(module, CENTRED) and not getattr(module, HOOKED, False):
            module.register_forward_hook(_centred)
            setattr(module, HOOKED, True)
