"""Masked padding: a chunk of any size as a chunk of one fixed physical size, so that one compiled graph (or one
captured CUDA graph) serves every chunk of every Poisson batch.

    xp, yp, mask = pad_batch(x, y, physical=320)          # (P, ...), (P,), mask (P,) 1 for real rows, 0 for padding
    privatize = padded(method.privatize, physical=320)     # privatize(model, loss_fn, x, y) on the padded chunk
    out = padded_step(method, model, loss_fn, x, y, optimizer, physical=320, sample_rate=q, expected_batch_size=B)

The loss of row i is multiplied by mask_i, so a padded row has zero loss, and hence zero output-gradient, zero
per-example gradient, zero per-example norm (reweight's rules, jl's projections <grad loss_i, v> = 0) and zero
clipped contribution nu_i * 0. The clipped SUM over the physical chunk is the clipped sum over its real rows, so the
noise (sigma*C on the sum) and the division by the EXPECTED batch size (runner/methods/noise.py) are unchanged: the
step releases exactly what the unpadded step releases (tests/test_padding.py checks it against nxBP). Every method
sums (non-private too: it divides the summed gradient by the real batch size in its update), so the weights are
the mask itself. Padded rows repeat the first real row (finite losses: 0 * loss stays 0). A chunk larger than
`physical` is not truncated: it runs at its own size (a new graph). Dropout draws masks for the padded rows too,
so with dropout the random stream (not the distribution) differs.

Methods that call loss_fn once on the whole chunk support it (Method.compiles: nonprivate, reweight, jl; nxbp and
multiloss call it on slices of the chunk); others run unpadded.
"""
from __future__ import annotations

import torch

from runner.methods.base import Privatized, StepOutput


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


def masked_loss(loss_fn, mask: torch.Tensor):
    """loss_fn whose per-example losses are multiplied by the mask (P,): zero for padded rows."""

    def fn(outputs, y):
        losses = loss_fn(outputs, y)
        return losses * mask.to(losses.dtype)

    return fn


def padded(privatize, physical: int):
    """privatize(model, loss_fn, x, y) run on the chunk padded to `physical` rows with masked losses; the result
    sliced back to the real rows."""

    def run(model, loss_fn, x, y) -> Privatized:
        n = len(y)
        xp, yp, mask = pad_batch(x, y, physical)
        out = privatize(model, masked_loss(loss_fn, mask), xp, yp)
        if len(mask) == n:
            return out
        return Privatized(out.losses[:n], out.outputs[:n] if out.outputs is not None else None,
                          out.norms[:n] if out.norms is not None else None)

    return run


def padded_step(method, model, loss_fn, x, y, optimizer, *, physical: int, **step_kwargs) -> StepOutput:
    """method.step with every chunk padded to `physical` rows (masked losses)."""
    return method.step(model, loss_fn, x, y, optimizer, privatize=padded(method.privatize, physical), **step_kwargs)
