"""A record whose gradient is not finite adds nothing, also where the clipped sum is a backward through a graph that
holds the record's values (issue 26: no single record may turn the release into nan).

A clip factor of 0 (runner/methods/base.py clip_factors: a norm that is not finite) keeps a record out of a sum
formed from recorded rows: book-keeping masks its rows (runner/norms/certify.py). Recompute feeds the second forward
a copy of a kept record's row in its place (`filled_rows`, below), and its sum is checked as the next methods' are.
A method whose clipped sum is the backward of sum_i nu_i loss_i through the forward's own graph
(method=jl; reweight's twopass) cannot mask it there: the record's inf/nan activations are in that graph, and
0 * inf = nan reaches every parameter's sum. Nor does a finite norm and loss prove a finite backward where the norm is
not reverse-mode (jl: forward-mode tangents or double-vjp projections): `torch.where(h > 100, 0, sqrt(100 - h))`
takes the selected branch's tangent, while its backward forms 0 * inf = nan in the unselected one; an entropy term
`where(p > 0, p * log p, 0)` does the same where a softmax underflows to 0. Masking that record's loss does not help
(the nan arises in its own row's backward, whatever its grad_output). One such record turned everyone's release into
nan, revealing its presence with certainty, and ended the run.

Such a method says so (Method.backward_holds_records). After each chunk, Method.clipped_sum reads once whether every
record's norm and loss, and every parameter's summed gradient, were finite (the chunk's one read: free on the CPU, a
sync on a GPU; the sum's check is an aminmax per parameter, NaN-propagating and free of overflow). Where not, the
chunk's sum is formed again from the same random state (the same dropout masks and, for jl, the same directions:
drawn once per logical step) with only some records kept, every other record's input row replaced by a copy of a
kept record's row and its loss masked (`formed_with`, `filled_rows`): first the records whose norm and loss were finite; if that sum is not finite either, the records
whose own backward is not finite are found by bisection (a kept set whose sum is not finite is halved, each half
formed again, down to single records: about 2 log2(n) passes per such record) and left out too. Rows are
independent (the first step's check refuses models that mix them), so this is a per-record decision: every other
record adds exactly what it added before. A record left out gets norm nan in the chunk's output, so the epoch counts
it among `nonfinite_records`; the losses and outputs are the first pass's. A sum that stays non-finite without those
records (finite contributions that overflow their sum) is refused in one line (DprunError).

Why a copy of a kept row and not a row of zeros (as before stop 57): the filler's backward, its loss masked, runs
with a zero output-gradient, and is finite wherever the copied record's own backward was (each local derivative
that record met was finite, or its own gradient would not have been; 0 times a finite value is 0). A row of zeros
has no such guarantee: `log(x)` of positive features, a mean over non-padding tokens without clamp(min=1), h / ||h||
without an epsilon are nan there, so jl, twopass and recompute refused such sound models at the first step. A chunk
with no record kept adds exactly zero, with no pass."""
from __future__ import annotations

import dataclasses

import torch

from runner.errors import DprunError
from runner.methods.rng import set_rng_state
from runner.norms import certify


def records_kept(part) -> torch.Tensor:
    """(n,) bool: the chunk's records whose norm and loss are finite (the others had clip factor 0)."""
    return torch.isfinite(part.norms) & torch.isfinite(part.losses)


def losses_kept(loss_fn, keep: torch.Tensor):
    """loss_fn with the losses of records not kept set to 0 (torch.where: no 0 * inf), so they have no gradient."""

    def fn(outputs, y):
        losses = loss_fn(outputs, y)  # (n,)
        return torch.where(keep, losses, torch.zeros((), dtype=losses.dtype, device=losses.device))

    return fn


def sum_finite(params) -> torch.Tensor:
    """0-dim bool: every p.grad finite. aminmax propagates NaN and cannot overflow (a sum of squares could); ~15x
    cheaper than isfinite().all() on the CPU (0.35 against 5.7 ms for the 2.5M weights of model=transformer)."""
    ends = [v for p in params if p.grad is not None and p.grad.numel() for v in torch.aminmax(p.grad)]
    return torch.stack(ends).isfinite().all() if ends else torch.ones((), dtype=torch.bool)


def read(flag: torch.Tensor) -> bool:
    """bool(flag), on the rare path only; a meta tensor (tests/test_no_host_sync.py: shapes, no values) reads True."""
    return flag.device.type == "meta" or bool(flag)


def filled_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x (n, ...) with the row of every record not kept (keep (n,) bool) replaced by a copy of the first kept
    record's row (see the module docstring: its masked backward is finite where that record's own was). Where none is
    kept, the copied row is x[0], itself not kept: its sum is checked like any other (Method.backward_holds_records)
    and formed again as zero where not finite. No read of the device (argmax of the mask: the first True), so it
    also runs inside a compiled graph."""
    first = keep.to(torch.uint8).argmax().view(1)  # (1,): the first kept record, or 0 where none is kept
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, x.index_select(0, first))  # index_select: no read


def formed_with(method, model, loss_fn, x, y, keep: torch.Tensor, state, params) -> bool:
    """The chunk's clipped sum in p.grad formed again from `state` with only the records in `keep` ((n,) bool): the
    others' input rows filled (`filled_rows`) and losses masked. True if that sum is finite. No record kept: the sum
    is zero, formed without a pass."""
    for p in params:
        p.grad = None  # the earlier pass's sum is replaced, not added to
    if not read(keep.any()):
        for p in params:
            p.grad = torch.zeros_like(p)
        return True
    set_rng_state(state, x.device)  # the same dropout masks for every record kept
    method.privatize(model, losses_kept(loss_fn, keep), filled_rows(x, keep), y)
    return read(sum_finite(params))


def not_finite(rows: list[int], finite) -> list[int]:
    """The records among `rows` (whose sum is known not to be finite) whose own backward is not finite, by bisection:
    finite(subset) forms the sum of that subset alone."""
    if len(rows) == 1:
        return rows
    halves = rows[:len(rows) // 2], rows[len(rows) // 2:]
    return [r for half in halves if not finite(half) for r in not_finite(half, finite)]


def without_dropped(method, model, loss_fn, x, y, part, state, params):
    """The chunk's clipped sum in p.grad with every record whose norm, loss or own backward was not finite left out
    (see the module docstring); `part`: the chunk's Privatized from the first pass, `state`: the random state
    (rng.rng_state) before it. Nothing is done, beyond the one read, when every record and the sum were finite."""
    keep = records_kept(part)  # (n,)
    if certify.every_record_kept(keep.all() & sum_finite(params)):
        return part
    if formed_with(method, model, loss_fn, x, y, keep, state, params):
        return part  # only records whose norm or loss was not finite: counted as such from part

    def finite(rows: list[int]) -> bool:
        chosen = torch.zeros_like(keep)
        chosen[rows] = True
        return formed_with(method, model, loss_fn, x, y, chosen, state, params)

    bad = not_finite(keep.nonzero()[:, 0].tolist(), finite)
    keep[bad] = False
    if not formed_with(method, model, loss_fn, x, y, keep, state, params):  # the final sum
        raise refused(method)
    norms = part.norms.clone()
    norms[bad] = float("nan")  # counted among the non-finite records
    return dataclasses.replace(part, norms=norms)


def refused(method) -> DprunError:
    return DprunError(f"method={method.name}'s clipped sum is not finite even without the records whose gradient is "
                      f"not finite: records that are each finite alone overflow their sum, so no record can be left "
                      f"out exactly; use method=nxbp or multiloss (each example's gradient alone)")
