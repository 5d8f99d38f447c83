"""Masked padding: a Poisson batch of any size as a batch of one fixed physical size, so that one compiled graph
(or one captured CUDA graph) serves every step.

    xp, yp, mask = pad_batch(x, y, physical=320)          # (P, ...), (P,), mask (P,) 1 for real rows, 0 for padding
    out = padded_step(method, model, loss_fn, x, y, optimizer, physical=320, sample_rate=q, expected_batch_size=B)

The loss of row i is multiplied by mask_i, so a padded row has zero loss, and hence zero output-gradient, zero
per-example gradient, zero per-example norm (reweight's rules, jl's projections <grad loss_i, v> = 0) and zero
clipped contribution nu_i * 0. The clipped SUM over the physical batch is the clipped sum over the real rows, so the
noise (sigma*C on the sum) and the division by the EXPECTED batch size (runner/methods/noise.py) are unchanged: the
step releases exactly what the unpadded step releases (tests/test_padding.py checks it against nxBP).
Non-private takes a MEAN; its weights are mask * P / n (n = mask.sum(), a tensor: no host synchronisation), so its
gradient is the mean over the real rows. Padded rows repeat the first real row (finite losses: 0 * loss stays 0;
zeros for an empty batch). A batch larger than `physical` is not truncated: it runs at its own size (a new graph).
Dropout draws masks for the padded rows too, so with dropout the random stream (not the distribution) differs.

Methods that call loss_fn once on the whole batch support it (Method.compiles: nonprivate, reweight, jl; nxbp and
multiloss call it on slices of the batch); others run unpadded.
"""
from __future__ import annotations

import torch

from runner.methods.base import StepOutput


def pad_batch(x: torch.Tensor, y: torch.Tensor, physical: int):
    """(x, y) of n <= physical rows -> (xp, yp, mask) of max(n, physical) rows; mask (P,) bool, True for real rows."""
    n = len(y)
    P = max(int(physical), n)
    mask = torch.arange(P, device=y.device) < n
    if P == n:
        return x, y, mask
    if n == 0:
        return (x.new_zeros((P, *x.shape[1:])), y.new_zeros((P, *y.shape[1:])), mask)
    fill = lambda t: torch.cat([t, t[:1].expand(P - n, *t.shape[1:])])  # noqa: E731
    return fill(x), fill(y), mask


def loss_weights(mask: torch.Tensor, private: bool, dtype: torch.dtype) -> torch.Tensor:
    """(P,) per-row loss weights: the mask for a summing (private) method; mask * P / n for a mean (non-private)."""
    w = mask.to(dtype)
    if private:
        return w
    return w * (len(mask) / w.sum().clamp_min(1.0))


def masked_loss(loss_fn, weights: torch.Tensor):
    """loss_fn whose per-example losses are multiplied by `weights` (P,)."""

    def fn(outputs, y):
        return loss_fn(outputs, y) * weights.to(outputs.dtype)

    return fn


def padded_step(method, model, loss_fn, x, y, optimizer, *, physical: int, **step_kwargs) -> StepOutput:
    """method.step on the batch padded to `physical` rows with masked losses; the output sliced back to the real
    rows (losses unweighted)."""
    n = len(y)
    xp, yp, mask = pad_batch(x, y, physical)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    w = loss_weights(mask, method.private, dtype)
    out = method.step(model, masked_loss(loss_fn, w), xp, yp, optimizer, **step_kwargs)
    if len(mask) != n:
        out.losses = out.losses[:n] / w[:n].to(out.losses.dtype)
        out.outputs = out.outputs[:n] if out.outputs is not None else None
        out.norms = out.norms[:n] if out.norms is not None else None
    return out
