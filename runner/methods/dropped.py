"""A record whose gradient is not finite adds nothing, also where the clipped sum is a backward through a graph that
holds the record's values (issue 26: no single record may turn the release into nan).

A clip factor of 0 (runner/methods/base.py clip_factors: a norm that is not finite) keeps a record out of a sum
formed from recorded rows: book-keeping masks its rows (runner/norms/certify.py). A method whose clipped sum is the
backward of sum_i nu_i loss_i through a forward's graph (method=jl; reweight's twopass, and recompute's second
forward) cannot mask it there: the record's inf/nan activations are in that graph, and 0 * inf = nan reaches every
parameter's sum. Nor does a finite norm and loss prove a finite backward where the norm is not reverse-mode (jl:
forward-mode tangents or double-vjp projections): `torch.where(h > 100, 0, sqrt(100 - h))` takes the selected
branch's tangent, while its backward forms 0 * inf = nan in the unselected one; an entropy term
`where(p > 0, p * log p, 0)` does the same where a softmax underflows to 0. Masking that record's loss does not help
(the nan arises in its own row's backward, whatever its grad_output). One such record turned everyone's release into
nan, revealing its presence with certainty, and ended the run.

Such a method says so (Method.backward_holds_records). After each chunk, Method.clipped_sum reads once whether every
record's norm and loss, and every parameter's summed gradient, were finite, and whether the release agrees with the
norms (Privatized.consistent: jl's projections of the release, twopass/recompute's second pass within their first's
norms; reviews 29 and 30) (the chunk's one read: free on the CPU, a
sync on a GPU; the sum's check is an aminmax per parameter, NaN-propagating and free of overflow). Where not, the
chunk's sum is formed again, from the same random state, on the kept records' rows alone (`formed_with`: the chunk
without the others, as a run without them would form it): first the records whose norm and loss were finite; if
that sum is not finite either, the records whose own backward is not finite are found by bisection (a kept set
whose sum is not finite is halved, each half formed again, down to single records: about 2 log2(n) passes per such
record) and left out too. A record left out gets norm nan in the chunk's output, so the epoch counts it among
`nonfinite_records`; the losses and outputs are the first pass's. A chunk with no record kept adds exactly zero,
with no pass. A sum that stays non-finite without those records (finite contributions that overflow their sum) is
refused in one line (DprunError).

Why the kept rows alone, and no row in the left-out records' places (review 9): until stop 56 a row of zeros stood
there (its loss masked), and models whose backward is nan at a zero row (log(x), h / ||h|| without an epsilon) had
to be refused at the first step; a copy of a kept record's row (tried at stop 57) made an exact duplicate of that
record, and a model that treats identical rows differently (out_i = h_i + the h_j of its duplicates) released 2 C
for it, a custom backward that is nonzero at a zero output-gradient leaked the copied record's data (62 C), and a
duplicate-counting nan dropped the whole chunk or refused the run after a release. The kept rows alone are exactly
the chunk a run without the left-out records would see (one chunk and no randomness: the same release, bit for bit;
with dropout, the kept rows' masks are drawn afresh for the smaller chunk: each record's clipped gradient is bounded
by C under whatever masks it gets, and the masks do not depend on the data)."""
from __future__ import annotations

import dataclasses

import torch

from runner.errors import DprunError
from runner.methods.rng import set_rng_state
from runner.norms import certify


def records_kept(method, part) -> torch.Tensor:
    """(n,) bool: the chunk's records whose loss is finite and whose clip factor is positive (0 where the norm is not
    finite, or where C / norm underflows): a record of factor 0 stays out of the backward altogether, since a custom
    backward need not map a zero output-gradient to zero."""
    return (method.clip_factors(part.norms.detach()) > 0) & torch.isfinite(part.losses)


def sum_finite(params) -> torch.Tensor:
    """0-dim bool: every p.grad finite. aminmax propagates NaN and cannot overflow (a sum of squares could); ~15x
    cheaper than isfinite().all() on the CPU (0.35 against 5.7 ms for the 2.5M weights of model=transformer)."""
    ends = [v for p in params if p.grad is not None and p.grad.numel() for v in torch.aminmax(p.grad)]
    return torch.stack(ends).isfinite().all() if ends else torch.ones((), dtype=torch.bool)


def read(flag: torch.Tensor) -> bool:
    """bool(flag), on the rare path only; a meta tensor (tests/test_no_host_sync.py: shapes, no values) reads True."""
    return flag.device.type == "meta" or bool(flag)


def kept_rows(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """t (n, ...) -> (k, ...): the rows of the records kept (keep (n,) bool). A meta tensor (shapes, no values:
    tests/test_no_host_sync.py) keeps every row."""
    if t.device.type == "meta":
        return t
    return t.index_select(0, keep.nonzero()[:, 0].to(t.device))


def agrees(part, device) -> torch.Tensor:
    """0-dim bool on `device`: the chunk's release agrees with what its norms measured (Privatized.consistent; True
    where the method does not say)."""
    if part is None or part.consistent is None:
        return torch.ones((), dtype=torch.bool, device=device)
    return part.consistent.to(device)


def formed_with(method, model, loss_fn, x, y, keep: torch.Tensor, state, params) -> bool:
    """The chunk's clipped sum in p.grad formed again from `state` on the rows of the records in `keep` ((n,) bool)
    alone. True if that sum is finite and agrees with its norms (jl: Privatized.consistent). No record kept: the sum
    is zero, formed without a pass."""
    for p in params:
        p.grad = None  # the earlier pass's sum is replaced, not added to
    if not read(keep.any()):
        for p in params:
            p.grad = torch.zeros_like(p)
        return True
    set_rng_state(state, x.device)  # jl: the same directions; dropout: masks from the same state
    part = method.privatize(model, loss_fn, kept_rows(x, keep), kept_rows(y, keep))
    for p in params:
        if p.grad is None:  # a parameter the kept rows' graph did not reach
            p.grad = torch.zeros_like(p)
    finite = sum_finite(params)
    return read(finite & agrees(part, finite.device))


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
    keep = records_kept(method, part)  # (n,)
    if certify.every_record_kept(keep.all() & sum_finite(params) & agrees(part, keep.device)):
        return part
    if not formed_with(method, model, loss_fn, x, y, keep, state, params):
        keep = keep & ~bisected(method, model, loss_fn, x, y, keep, state, params)
        if not formed_with(method, model, loss_fn, x, y, keep, state, params):  # the final sum
            raise refused(method)
    nan = torch.full((), float("nan"), dtype=part.norms.dtype, device=part.norms.device)
    return dataclasses.replace(part, norms=torch.where(keep, part.norms, nan))  # left out: counted as non-finite


def bisected(method, model, loss_fn, x, y, keep, state, params) -> torch.Tensor:
    """(n,) bool: the records among `keep` whose own backward is not finite (not_finite's bisection)."""

    def finite(rows: list[int]) -> bool:
        chosen = torch.zeros_like(keep)
        chosen[rows] = True
        return formed_with(method, model, loss_fn, x, y, chosen, state, params)

    bad = torch.zeros_like(keep)
    bad[not_finite(keep.nonzero()[:, 0].tolist(), finite)] = True
    return bad


def refused(method) -> DprunError:
    return DprunError(f"method={method.name}'s clipped sum is not finite, or does not agree with the norms that set "
                      f"its clip factors, even without the records for which alone it is not or does not: records that "
                      f"are each right alone are not together (their sum overflows, the model couples them, or its "
                      f"forward or backward changes between passes), so no record can be left out exactly; use "
                      f"method=reweight method.mode=bk, or method=nxbp or multiloss (each example's gradient alone)")
