"""Independence: the other examples' losses and outputs must not change when one example of the batch changes.

    check_independence(model, loss_fn, x, y, "reweight")     # x, y: a few examples of the first batch (k >= 2)

Per-example clipping bounds an example's influence only if no other example's loss depends on it. Three probes:
example 0 replaced (train mode, the same random state: the same dropout masks), replaced again in eval mode, and
removed (eval mode: dropout off, since the masks would shift). Whatever couples the batch is caught the same way:
batch statistics (x - x.mean(0), F.batch_norm), a softmax or normalisation over the batch dimension, a contrastive
loss. The message names the module whose forward mixes the examples (its input rows agree, its output rows do
not), or the loss. Coupling that only some data shows (a branch on a rare value) cannot be seen on a few examples.

A forward of k - 1 rows may run other kernels than one of k rows (cuBLAS and oneDNN pick their blocking per shape),
so a float32 model's rows can differ by its rounding (1.8e-7 relative on an H100, GPT-2-small shape) with no coupling,
and no float32 tolerance separates that from weak coupling for every depth. So the rows are compared at 1e-7 (float64's
rounding is ~1e-16); a model that is not float64 and differs by at most ROUNDING (1e-3) is probed again on a float64
copy of it and of the probe rows on the CPU before it is refused: coupling shows in both, rounding only in the first.
A larger difference is refused in the model's own dtype, and on the CPU so is any difference with example 0 replaced
(k rows both times: the same kernels compute each other row bitwise alike; review 14). (Until this was found,
a float32 tolerance was documented here but a float64 one was applied: the GPT-2-small stack was refused on an H100.)
The forwards run with gradients on, as the training step's do (review 14: `if torch.is_grad_enabled()` coupling).
"""
from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from runner.errors import DprunError
from runner.methods.rng import rng_state, set_rng_state
from runner.methods.privacy_check.no_randomness import PROFILES, counted_draws, no_randomness
from runner.methods.privacy_check.shapes import first_input

ALONE = "method=nxbp or method=multiloss (each example runs alone)"
log = logging.getLogger("dprun")


RTOL = 1e-7  # the rows are compared in float64; see rows_differ
ROUNDING = 1e-3  # float32 differences at most this (relative) may be rounding: only those are asked again in float64


def rows_differ(a, b, rtol: float = RTOL) -> bool:
    """a, b: the same rows of two forwards; True if they differ by more than 1e-7 relative: beyond float64's
    rounding, not beyond float32's, whose forwards of k and k - 1 rows may round differently (other kernels); a
    float32 or bf16 model that differs is asked again in float64 (confirmed_independent_in_float64). Each row (first
    dimension; a 0-dim tensor is one row) is measured against its own finite entries: one scale for the whole tensor
    let one probe row's 1e30 entry (finite, gradient-free) hide plain centring in every other row (review 14, 4.26 C)."""
    if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape or not a.is_floating_point():
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and not torch.equal(a, b)
    if a.numel() == 0:
        return False
    a, b = (t.detach().double().reshape(len(t) if t.dim() else 1, -1) for t in (a, b))  # (rows, entries per row)
    finite = torch.isfinite(a) & torch.isfinite(b)
    agree = finite | (a == b) | (torch.isnan(a) & torch.isnan(b))  # inf == inf; nan in both (review 13) agrees too
    if not bool(agree.all()):  # an entry finite in one forward only
        return True
    size = torch.where(finite, b.abs(), 0.0)  # (rows, entries): an inf entry would make its row's scale inf
    scale = size.amax(1, keepdim=True).clamp(min=1.0)  # (rows, 1): max(1, max |finite b_row|)
    return bool((torch.where(finite, (a - b).abs(), 0.0) > rtol * (size + scale)).any())


def replaced(t: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """t with row 0 changed: floating rows to -10 t[0] + 1 (an outlier); others to the first row of `pool` that
    differs, else (t[0] + 1) mod (max + 1) (token ids stay valid)."""
    out = t.clone()
    if t.is_floating_point():
        out[0] = -10 * t[0] + 1
        return out
    other = [r for r in pool if not torch.equal(r, t[0])]
    out[0] = other[0] if other else (t[0] + 1) % (int(pool.max()) + 1 if pool.numel() else 1)
    return out


def kept(value):
    """What calls() keeps of a value: a tensor detached (no graph held), nothing else (rows_differ compares tensors)."""
    return value.detach() if torch.is_tensor(value) else None


def calls(model: nn.Module, loss_fn, x, y):
    """One forward: the losses, and (path, module, input, output) of every module call in order (rows first). With
    gradients on, as in training: a model coupling the batch only `if torch.is_grad_enabled()` passed forwards under
    no_grad (review 14, 7.7 C); all that is kept is detached, so each forward's graph is freed."""
    seen = []

    def hook(path):
        def record(module, args, kwargs, out):
            seen.append((path, module, kept(first_input(args, kwargs)), kept(out)))
        return record

    handles = [m.register_forward_hook(hook(p or "<model>"), with_kwargs=True) for p, m in model.named_modules()]
    try:
        with torch.enable_grad():
            losses = kept(loss_fn(model(x), y))
    finally:
        for h in handles:
            h.remove()
    return losses, seen


def mixer(a: list, b: list, k: int, rtol: float = RTOL) -> str:
    """The first module (in completion order) whose input rows 1.. agree in two forwards but whose output rows do
    not: the one whose own forward mixes the examples; '' if none (the loss does)."""
    for (path, module, ia, oa), (_, _, ib, ob) in zip(a, b):
        batched = torch.is_tensor(oa) and oa.dim() > 0 and oa.shape[0] == k
        if batched and not rows_differ(ia[1:] if torch.is_tensor(ia) and ia.dim() else ia,
                                       ib[1:] if torch.is_tensor(ib) and ib.dim() else ib, rtol) \
                and rows_differ(oa[1:], ob[1:], rtol):
            return f"{path} ({type(module).__name__})"
    return ""


def refuse(where: str, how: str, method: str) -> None:
    what = f"the forward of {where}" if where else "the model or loss_fn"
    raise DprunError(f"the examples' losses depend on the other examples of the batch: {how}, the other examples' "
                     f"losses or outputs change ({what} mixes the batch: batch statistics, a batch-dim softmax or "
                     f"normalisation, a contrastive loss), so method={method}'s per-example clipping bounds nothing; "
                     f"use {ALONE}, or make each example's loss depend on that example alone")


def check_independence(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, method: str,
                       removals: list[int] | None = None) -> None:
    modes = {m: m.training for m in model.modules()}
    try:
        probe(model, loss_fn, x, y, method, removals=removals)
    except DprunError:
        if not (below_float64(model) and within_rounding(model, loss_fn, x, y, method, removals)
                and confirmed_independent_in_float64(model, loss_fn, x, y, method, removals)):
            raise
        log.info("privacy check: the probe's forwards of the same rows differed beyond 1e-7 (rounding of other "
                 "kernels for another batch size); a float64 copy on the CPU found no coupling")
    finally:
        for m, training in modes.items():
            m.training = training


def within_rounding(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, method: str,
                    removals: list[int] | None = None) -> bool:
    """The same probe, on the model as it is, at ROUNDING: True if its rows moved by at most 1e-3 relative, what
    float32 kernels can round; coupling in the model's own dtype beyond that is refused there (a model whose coupling
    only its float32 path has, `if x.dtype == torch.float32: x = x - x.mean(0)`, cannot hide behind the float64 copy).
    Only the removed probe (k - 1 rows: other kernels, other blocking) gets ROUNDING on the CPU: the replaced probes
    keep the batch's shape, so the same kernels compute each other row bitwise alike unless the rows are coupled, and
    they stay at RTOL there (review 14: `x + 1e-5 * x.sum(0)` on the float32 path alone, inside the 1e-3 band, was
    cleared by the float64 copy, 5.3 C). On CUDA the replaced probes keep ROUNDING and the float64 route: same-shape
    forwards there are not shown to be bitwise alike (atomics, per-call algorithm choice), not checked on a GPU."""
    try:
        probe(model, loss_fn, x, y, method, ROUNDING, replaced_rtol=RTOL if x.device.type == "cpu" else ROUNDING,
              removals=removals)
    except DprunError:
        return False
    return True


def below_float64(model: nn.Module) -> bool:
    """The model computes in float32 (or lower): its forwards' rounding can exceed the rows' 1e-7 comparison."""
    return any(t.is_floating_point() and t.dtype != torch.float64
               for t in [*model.parameters(), *model.buffers()])


def confirmed_independent_in_float64(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, method: str,
                                     removals: list[int] | None = None) -> bool:
    """The probe again on a float64 CPU copy of the model and rows: True if it finds no coupling there (what the
    first probe showed was rounding); False if it does, or if the model or loss cannot run on the CPU in float64."""
    try:
        cpu = copy.deepcopy(model).to("cpu", torch.float64)
        xs = x.to("cpu", torch.float64) if x.is_floating_point() else x.cpu()
        ys = y.to("cpu", torch.float64) if y.is_floating_point() else y.cpu()
        probe(cpu, loss_fn, xs, ys, method, removals=removals)
    except DprunError:
        return False
    except Exception:  # a CUDA-only module or loss: keep the refusal CUDA gave
        return False
    return True


def check_independence_autocast(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, method: str,
                                context) -> None:
    """The replaced probes again inside `context` (the method's autocast, precision=bf16), at RTOL: the training
    step's forward runs there, and a model that couples the batch only under autocast (`if
    torch.is_autocast_enabled(x.device.type): x = x - x.mean(0)`) was not seen by the probes outside it (review 14).
    The same batch shape both times, so the same bf16 kernels compute every other row bitwise alike on the CPU; the
    removed probe (other kernels for k - 1 rows, rounding at bf16's 4e-3) is not repeated. CUDA: not run (same-shape
    forwards there are not shown to be bitwise alike)."""
    if x.device.type != "cpu":
        return
    modes = {m: m.training for m in model.modules()}
    try:
        with context:
            probe(model, loss_fn, x, y, method, removed=False)
    finally:
        for m, training in modes.items():
            m.training = training


def probe(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, method: str, rtol: float = RTOL,
          replaced_rtol: float | None = None, removed: bool = True, removals: list[int] | None = None) -> None:
    """Example 0 replaced (train mode, then eval mode; compared at replaced_rtol, default rtol), then (`removed`)
    removed (eval mode, then train mode with every draw fixed; compared at rtol): every probed example in turn, or the
    rows `removals` (the padded probe's prefixes of a whole batch: review 57, B^2 forwards)."""
    k = len(y)
    same = rtol if replaced_rtol is None else replaced_rtol  # the replaced probes: the same batch shape
    x2, y2 = replaced(x, x), replaced(y, y)
    for train in (True, False):
        model.train(train)
        base, found, same_draws = replaced_probe(model, loss_fn, x, y, x2, y2, same)
        if found is not None and not same_draws:  # (eval mode too: F.rrelu(training=True), review 59)
            # the two forwards consumed torch's generator differently: one that draws a value only for some entries
            # (RReLU's CPU kernel, for its non-positive ones) shifts every later row's draws when row 0 changes
            # (review 57: nn.RReLU refused). Compared again with every draw fixed. Not where both drew alike: the
            # rows then differ by the data (review 58: a mix taken on this draw was cleared by the fixed draws)
            for end in PROFILES:
                with no_randomness(end, forwards=2) as mode:
                    _, fixed, _ = replaced_probe(model, loss_fn, x, y, x2, y2, same)
                if mode.unfixed:
                    break  # the difference stands: a draw the check cannot fix
                found = fixed
                if fixed is not None or not mode.varied:
                    break
        if found is not None:
            refuse(found, f"with the first probed example replaced ({'train' if train else 'eval'} mode)", method)
    if not removed:
        return
    # each probed example removed in turn (review 55: a batch trimmed to its longest text moved the others only when
    # that text left, and it was not the first), in eval mode, then in train mode with every random draw fixed
    # (no_randomness: review 53's model reading its batch's size in train mode only passed the eval-mode removal,
    # 5.34 C, and review 55's passed a train-mode one skipped for its F.dropout, 7.6 C)
    rows = list(range(k)) if removals is None else [i for i in removals if 0 <= i < k]
    keep = lambda i: torch.cat([torch.arange(i), torch.arange(i + 1, k)])  # noqa: E731  (rows but i)
    for i in rows:
        fewer, _ = calls(model, loss_fn, x[keep(i)], y[keep(i)])  # eval mode
        if rows_differ(base[keep(i)], fewer, rtol) and not drawn_alike(model, loss_fn, x, y, keep(i), rtol):
            refuse("", f"with probed example {i} removed", method)
    model.train(True)
    for end in PROFILES:  # every draw at its centre; then its range's ends and deciles where the forward draws such
        # values (a branch on a draw is taken at one of them)
        if not removed_in_train_mode(model, loss_fn, x, y, rows, keep, rtol, method, end):
            return


def drawn_alike(model: nn.Module, loss_fn, x, y, rows: torch.Tensor, rtol: float) -> bool:
    """An eval-mode forward that draws random values (F.rrelu(training=True), noise outside `self.training`: review
    59) removed a row and changed the others: do they agree with every draw fixed (no_randomness at its centre)? Then
    the draws made the difference, not the data."""
    with counted_draws() as seen:
        calls(model, loss_fn, x[rows], y[rows])
    if not seen.draws:
        return False
    with no_randomness(forwards=2) as mode:
        base = calls(model, loss_fn, x, y)[0]
        fewer = calls(model, loss_fn, x[rows], y[rows])[0]
    return not mode.unfixed and not rows_differ(base[rows], fewer, rtol)


def replaced_probe(model: nn.Module, loss_fn, x, y, x2, y2, rtol: float):
    """Two forwards from the same random state (the same dropout masks, Python's and numpy's draws too), the second
    with example 0 replaced -> (the first's losses, None if rows 1.. agree, else the module mixing them: '' for the
    loss; whether both forwards left torch's generators in the same state, i.e. drew alike)."""
    k = len(y)
    state = rng_state(x.device, host=True)
    base, base_calls = calls(model, loss_fn, x, y)
    after = rng_state(x.device)
    set_rng_state(state, x.device)
    other, other_calls = calls(model, loss_fn, x2, y2)
    again = rng_state(x.device)
    same_draws = torch.equal(after[0], again[0]) and (after[1] is None or torch.equal(after[1], again[1]))
    outputs = (base_calls[-1][3], other_calls[-1][3]) if base_calls else (None, None)
    if rows_differ(base[1:], other[1:], rtol) or (torch.is_tensor(outputs[0]) and outputs[0].shape[:1] == (k,)
                                                  and rows_differ(outputs[0][1:], outputs[1][1:], rtol)):
        return base, mixer(base_calls, other_calls, k, rtol), same_draws
    return base, None, same_draws


def removed_in_train_mode(model: nn.Module, loss_fn, x, y, rows: list[int], keep, rtol: float, method: str,
                          end: str) -> bool:
    """Each of `rows` removed in train mode with every random draw fixed (no_randomness(end)) and Python's and numpy's
    states replayed before each forward; refuses where the other rows change, or where two forwards of the same rows
    differ (randomness the check can neither fix nor replay: review 57's Python coin skipped this probe, and a model
    reading its batch's size behind it passed, 7.31 C). -> whether another end could show more: the forward drew
    values that move with `end` (a branch on a draw, `if torch.rand(()) < 0.1: mix the batch`, is taken at one end
    only)."""
    state = rng_state(x.device, host=True)

    def forward(xs, ys):
        set_rng_state(state, x.device)
        return calls(model, loss_fn, xs, ys)[0]

    with no_randomness(end, forwards=len(rows) + 2) as mode:
        base = forward(x, y)
        again = forward(x, y)
        if mode.unfixed:  # a torch random operator the mode does not fix: refused, not skipped (review 56: torch.
            # poisson or cauchy_ noise hid a size-reading model, as F.dropout had before no_randomness)
            raise DprunError(f"the model's train-mode forward draws random values the privacy check cannot fix "
                             f"({', '.join(dict.fromkeys(mode.unfixed))}), so whether an example's loss depends on "
                             f"the other examples cannot be checked; use method=nxbp or method=multiloss (each "
                             f"example alone), or draw the randomness with dropout or torch.rand/randn")
        if rows_differ(base, again, rtol):  # the float64 copy (check_independence) clears a GPU kernel's rounding
            raise DprunError("the model's train-mode forward gives other values for the same rows with every torch "
                             "draw fixed and torch's, Python's and numpy's random states replayed (randomness from "
                             "elsewhere, or nondeterministic kernels), so whether an example's loss depends on the "
                             "other examples cannot be checked; use method=nxbp or method=multiloss (each example "
                             "alone), or draw the randomness with torch, Python's random or numpy's global generator")
        for i in rows:
            fewer = forward(x[keep(i)], y[keep(i)])
            if rows_differ(base[keep(i)], fewer, rtol):
                at = "" if end == "centre" else f", every draw at its {end}" + (" end" if end in ("low", "high")
                                                                                  else " quantile")
                refuse("", f"with probed example {i} removed (train mode{at})", method)
        return mode.varied > 0
