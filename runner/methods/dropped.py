"""A record whose norm or loss is not finite adds nothing, also where the clipped sum is a backward through a graph
that holds the record's values (issue 26: no single record may turn the release into nan).

A clip factor of 0 (runner/methods/base.py clip_factors: a norm that is not finite) keeps a record out of a sum
formed from recorded rows: book-keeping masks its rows (runner/norms/certify.py), recompute feeds it to the second
forward as zeros. A method whose clipped sum is the backward of sum_i nu_i loss_i through the forward's own graph
(method=jl; reweight's twopass) cannot mask it there: the record's inf/nan activations are in that graph, and
0 * inf = nan reaches every parameter's sum. One record (finite inputs whose activations overflow, inputs that are
inf or nan) then turns everyone's release into nan, revealing its presence with certainty, and ends the run.

Such a method says so (Method.backward_holds_records). After each chunk, Method.clipped_sum asks once whether every
record's norm and loss were finite (the chunk's one read: free on the CPU, a sync on a GPU) and, where one was not,
forms the chunk's sum again from the same random state with those records' inputs zeroed and their losses masked
(`without_dropped`): they add exactly nothing, every other example exactly what it added before (the same dropout
masks and, for jl, the same directions: drawn once per logical step). The chunk's losses, outputs and norms are the
first pass's, so the log still shows the record's non-finite norm."""
from __future__ import annotations

import torch

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


def without_dropped(method, model, loss_fn, x, y, part, state, params):
    """The chunk's clipped sum in p.grad with every record that was not finite left out (see the module docstring);
    `part`: the chunk's Privatized from the first pass, `state`: the random state (rng.rng_state) before it. Nothing
    is done, beyond the one read, when every record was finite."""
    keep = records_kept(part)  # (n,)
    if certify.every_record_kept(keep):
        return part
    set_rng_state(state, x.device)  # the same dropout masks for every other record
    for p in params:
        p.grad = None  # the first pass's (nan) sum is replaced, not added to
    method.privatize(model, losses_kept(loss_fn, keep), certify.finite_rows(x, keep), y)
    return part
