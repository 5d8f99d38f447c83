"""Masked padding: a chunk of any size as a chunk of one of a few fixed physical sizes, so that one compiled graph
(or one captured CUDA graph) per size serves every chunk of every Poisson batch.

    xp, yp, mask = pad_batch(x, y, physical=320)          # (P, ...), (P,), mask (P,) 1 for real rows, 0 for padding
    privatize = padded(method.privatize, physical=320)     # privatize(model, loss_fn, x, y) on the padded chunk
    privatize = padded(method.privatize, physical=(240, 256, 320))   # the smallest of these sizes that holds it
    out = padded_step(method, model, loss_fn, x, y, optimizer, physical=320, sample_rate=q, expected_batch_size=B)

The loss of row i is multiplied by mask_i, so a padded row has zero loss, and hence zero output-gradient, zero
per-example gradient, zero per-example norm (reweight's rules, jl's projections <grad loss_i, v> = 0) and zero
clipped contribution nu_i * 0. The clipped SUM over the physical chunk is the clipped sum over its real rows, so the
noise (sigma*C on the sum) and the division by the EXPECTED batch size (runner/methods/noise.py) are unchanged: the
step releases exactly what the unpadded step releases (tests/test_padding.py checks it against nxBP). Every method
sums (non-private too: it divides the summed gradient by the real batch size in its update), so the weights are
the mask itself. Padded rows repeat the first real row (finite losses: 0 * loss stays 0). A chunk larger than
every size is not truncated: it runs at its own size (a new graph). Dropout draws masks for the padded rows too,
so with dropout the random stream (not the distribution) differs. The padding runs eager, outside what compile=
compiles (`masked`): the compiled graph's inputs have the padded size, so a new chunk size needs no new graph.

Methods that call loss_fn once on the whole chunk support it (Method.compiles: nonprivate, reweight, jl; nxbp and
multiloss call it on slices of the chunk); others run unpadded.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from runner.errors import DprunError
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


def bucket(n: int, sizes: int | Sequence[int]) -> int:
    """The smallest of `sizes` that holds n rows; n itself when none does (not truncated: a new graph)."""
    sizes = (sizes,) if isinstance(sizes, int) else sizes
    return min((int(s) for s in sizes if s >= n), default=n)


def masked(privatize):
    """privatize on an already padded chunk, (model, loss_fn, xp, yp, mask): the padded rows' losses masked to zero.
    What compile= compiles: its inputs have the padded size (P rows), so one graph serves every chunk of size P."""

    def run(model, loss_fn, xp, yp, mask) -> Privatized:
        return privatize(model, masked_loss(loss_fn, mask), xp, yp)

    return run


def padded(privatize, physical: int | Sequence[int], core=None):
    """privatize(model, loss_fn, x, y) run on the chunk padded to `physical` rows (one size, or several: the smallest
    that holds the chunk) with masked losses; the result sliced back to the real rows. `core(model, loss_fn, xp, yp,
    mask)` runs the padded chunk (default masked(privatize); compile= passes it compiled); the padding runs eager."""
    core = core or masked(privatize)

    def run(model, loss_fn, x, y) -> Privatized:
        n = len(y)
        xp, yp, mask = pad_batch(x, y, bucket(n, physical))
        out = core(model, loss_fn, xp, yp, mask)
        if len(mask) == n:
            return out
        check_fillers(model, out.norms, n, getattr(getattr(privatize, "__self__", None), "clip", None))
        return Privatized(out.losses[:n], out.outputs[:n] if out.outputs is not None else None,
                          out.norms[:n] if out.norms is not None else None, out.consistent)

    return run


FILLER_SHARE = 1e-9  # of C: what a padded row's certified norm may be (a zero gradient's underflow floor, ~1e-30)


def check_fillers(model, norms: torch.Tensor | None, n: int, clip: float | None) -> None:
    """The padded rows' per-example gradients (norms (P - n,)) must be 0: their loss is 0, so only a model that
    carries one row's loss into another row's activations gives them a gradient. The first-step check never sees the
    padding (it runs unpadded, with one twin of row 0), and a model coupling identical rows (3 or more) carried row
    0's loss into each of its copies, each clipped to C on its own: 4.79 C for one example at P = 16 (review 50).
    Refused in one line before the noise, the chunk's sums dropped. A zero gradient's certified norm is the
    certificate's underflow floor (runner/norms/certify.py; ~1e-146 in float64, ~1e-30 in float32), so a padded row
    passes at most FILLER_SHARE C: (P - n) 1e-9 C in all where a coupling that small is real. A padded row that is
    not finite where row 0 is not finite either is its copy's (dropped with it, runner/methods/dropped.py). One read
    of (P - n,) values per padded chunk."""
    if norms is None or len(norms) <= n or n == 0:
        return
    fillers = norms[n:].detach()
    limit = FILLER_SHARE * (clip if clip is not None else 1.0)
    coupled = (torch.isfinite(fillers) & (fillers > limit)).any()
    if bool(torch.isfinite(norms[0])):
        coupled = coupled | ~torch.isfinite(fillers).all()
    if bool(coupled):
        for p in model.parameters():
            p.grad = None  # the chunk's sums (and any before it) are not released by a caught error
        raise DprunError("a padded row (a copy of the chunk's first example, loss multiplied by 0) got a non-zero "
                         "per-example gradient: the model carries one row's loss into other rows' activations, so "
                         "each of them is clipped on its own and the example counts several times; make each "
                         "example's output depend on its own row alone, or run compile=off")


class PaddedRows(torch.nn.Module):
    """model(x) as a padded step computes it for x's rows: x padded to its bucket with copies of its first row, the
    output sliced back. The first-step independence check runs through it (privacy_check/first_step.py): a model
    whose rows react to how many copies of row 0 the padding adds (P - n + 1, which tells it n) changed example 0's
    own gradient when any other example left the batch, with no gradient on the padded rows (review 51: 1.7-1.9 C
    under reweight, 1.8-2.0 C under jl at P = 16); removing an example through this wrapper moves the other rows."""

    def __init__(self, model: torch.nn.Module, sizes: int | Sequence[int]):
        super().__init__()
        self.model, self.sizes = model, sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(x)
        xp, _, _ = pad_batch(x, torch.zeros(n, dtype=torch.long, device=x.device), bucket(n, self.sizes))
        return self.model(xp)[:n]


def padded_step(method, model, loss_fn, x, y, optimizer, *, physical: int | Sequence[int], **step_kwargs) -> StepOutput:
    """method.step with every chunk padded to `physical` rows, or to the smallest of several sizes (masked losses)."""
    method.padding_sizes = physical  # the first-step check probes the rows through this padding (PaddedRows)
    return method.step(model, loss_fn, x, y, optimizer, privatize=padded(method.privatize, physical), **step_kwargs)
