"""The one validation of a private run, on its first step (Method.clipped_sum calls it; CLI, API, compiled and
chunked steps alike), on a few examples of the first batch (PROBE with finite inputs and losses, extreme keys first)
and a few training records (probe_rows.py);
nothing it does is released or kept.

    check_first_step(method, model, loss_fn, x, y)     # DprunError (one line) naming what clipping cannot bound

In order: the loss is exactly (B,); the examples are independent (methods that run the batch in one forward);
every hooked call is batch-first and no parameter reaches the loss outside its module's calls (per-layer methods);
jl's estimates and clipped sum equal those of each example's gradient computed alone (a backward that mixes the
examples); nothing was written into a parameter or buffer; the method's norms and clipped sum equal one backward per example
(reweight; Opacus's ghost norms may only over-estimate), or, for Opacus's grad samples (no oracle: they may differ
from the true gradient where Opacus's rule is inexact, still per example), each row's norm is unchanged when another
example changes; its norms are (B,); each of these on the probe rows as drawn and reversed (a forward that sorts the
batch by its data); again nothing written. Runs once per (model,
loss function): a step given another loss function is checked again. It reads values back (host syncs on a GPU),
once; the steps after it read none (tests/test_no_host_sync.py). The random state, the gradients, the
modules' train/eval flags and every parameter and buffer are restored, so the step that follows is the step the
run would have taken without the check (tests/test_privacy_validator.py).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import types

import torch

from runner.errors import DprunError
from runner.methods.base import trainable
from runner.methods.rng import rng_state, set_rng_state
from runner.methods.privacy_check.independence import check_independence, check_independence_autocast
from runner.methods.privacy_check.modules import dropout_off
from runner.methods.privacy_check.measured import (alone_grads, batch_row, check_against_oracle, check_inside_calls,
                                                   check_jl_release, check_own_rows, per_example_grads, tolerance)
from runner.methods.privacy_check.probe_rows import spread_first
from runner.methods.privacy_check.row_order import check_row_order
from runner.methods.privacy_check.shapes import BLACK_BOX, check_batch_first, check_losses
from runner.methods.privacy_check.state import check_unwritten, restore, snapshot

PROBE = 4  # examples of the first batch the check runs on (the cost: a few forwards and backwards of these)
TWIN_LABELS = 16  # labels of the batch tried for the probe's twin (with_twin), the first whose twin is finite kept
MOST_EXTREME = 12  # more of them where more rows hold a key's extreme (probe_rows.py)
ALONE = ("nxbp", "multiloss")  # each example's forward runs alone: no coupling, no batch dimension to get wrong
PER_LAYER = ("reweight", "opacus")  # norms from each module's recorded calls

log = logging.getLogger("dprun")


def oracle_rule(method) -> str | None:
    """How the method's norms must compare with one backward per example: "bound" (never below it: reweight's norms
    are certified upper bounds, runner/norms/certify.py, which sit far above the exact norm on an example whose
    per-position gradients cancel, and the Opacus peer's ghost mode may over-estimate, e.g. an Embedding's
    padding_idx row); in both the released sum must then be sum_i factor_i grad_i with the method's own factors.
    None: each clipped term is the very tensor whose norm was taken (nxbp, multiloss, Opacus's hooks/functorch grad
    samples) or the norm is an estimate (jl)."""
    if method.name == "reweight" or (method.name == "opacus" and getattr(method, "mode", None) == "ghost"):
        return "bound"
    return None


@contextlib.contextmanager
def untouched(method, model: torch.nn.Module, device: torch.device):
    """Whatever the check's passes change, put back: RNG, .grad, train/eval flags, Opacus's hooks on."""
    state, modes = rng_state(device, host=True), {m: m.training for m in model.modules()}
    grads = {p: p.grad for p in model.parameters()}
    hooks = getattr(method, "hooks", None)  # the Opacus peer: its own hooks stay out of the check's forwards
    try:
        yield hooks
    finally:
        set_rng_state(state, device)
        for m, training in modes.items():
            m.training = training
        for p, g in grads.items():
            p.grad = g
        if hooks is not None:
            hooks.enable_hooks()


def probe(method, model, loss_fn, x: torch.Tensor, y: torch.Tensor):
    """PROBE examples of the batch whose losses and gradients are finite, those with extreme keys first (probe_rows.py:
    a forward that sorts by a key the rows tie on shows nothing), then the training records with extreme keys that
    assemble() left on the method (`probe_records`), and each row's name for the messages (its row in the batch, or
    "training record i"). A record whose loss or gradient is not finite adds nothing to the release
    (runner/methods/dropped.py, runner/norms/certify.py); compared with one backward per example it would fail every
    check, so one such record among the first four made the validator refuse any model. A record with a nan input
    that the model imputes (finite loss and gradient) is trained on, so it is probed (review 14: a model mixing the
    batch among such records only was accepted, bk 7 C, twopass 51 C). Looks at up to 4 x PROBE rows of the batch:
    one forward without gradients (two where an input is not finite), random state restored (the caller restores
    the modules' flags)."""
    spread, extreme = spread_first(x, y)
    probe_rows = max(PROBE, min(extreme, MOST_EXTREME))  # every row with an extreme key, up to MOST_EXTREME
    order = torch.tensor(spread[:probe_rows + 3 * PROBE], dtype=torch.long, device=x.device)  # (pool,)
    xp, yp, names = x[order], y[order], order.tolist()
    from runner.methods.privacy_check.probe_rows import like_batch
    extra = getattr(method, "probe_records", None)
    added = like_batch(extra[0], x, "the training records with extreme keys") if extra is not None else None
    if added is not None:
        xp = torch.cat([xp, added])
        yp = torch.cat([yp, extra[1].to(y.device, y.dtype)])
        names = names + list(extra[2])
    pool = len(yp)
    state = rng_state(x.device, host=True)
    with torch.no_grad(), method.autocast(xp):
        losses = loss_fn(model(xp), yp)  # (pool,) the rows as they are
    set_rng_state(state, x.device)
    ok = torch.isfinite(losses) if losses.shape == (pool,) else torch.ones(pool, dtype=torch.bool, device=x.device)
    if losses.shape == (pool,) and xp.is_floating_point():
        inputs = torch.isfinite(xp.reshape(pool, -1)).all(1)  # (pool,)
        if not bool(inputs.all()):  # a nan row that a coupled model spreads to every row: the rows with finite inputs
            with torch.no_grad(), method.autocast(xp):  # are looked at alone (with zeros in its place) too
                alone = loss_fn(model(torch.where(inputs.view(-1, *([1] * (xp.dim() - 1))), xp,
                                                  torch.zeros((), dtype=xp.dtype, device=x.device))), yp)
            set_rng_state(state, x.device)
            ok = ok | (inputs & torch.isfinite(alone))
    ok_loss = ok
    if losses.shape == ok.shape:  # else check_losses refuses the loss's shape
        finite = finite_gradients(method, model, loss_fn, xp, yp, ok)
        b = len(order)  # batch rows are skipped so only while 2 or more are left: a coupled model that is nan alone
        # had every row skipped, and no batch was ever checked (review 8: 1.15-1.21 C released); then all are probed
        ok = finite if int(finite[:b].sum()) >= min(2, int(ok[:b].sum())) else torch.cat([ok[:b], finite[b:]])
    set_rng_state(state, x.device)
    batch_rows = ok[:len(order)].nonzero()[:probe_rows, 0]  # (k,) of the batch
    records = len(order) + ok[len(order):].nonzero()[:, 0]  # the training records, when finite
    rows = torch.cat([batch_rows, records]) if len(batch_rows) else batch_rows  # no finite example: the next batch
    skipped = (~ok & ok_loss).nonzero()[:PROBE, 0]  # rows (batch, records) skipped for their gradient alone
    return xp[rows], yp[rows], [names[r] for r in rows.tolist()], (xp[skipped], yp[skipped])


def with_twin(method, model, loss_fn, xs: torch.Tensor, ys: torch.Tensor, names: list, batch_labels: torch.Tensor):
    """The probe with one more row: a copy of its first example with another example's label, where one differs and
    the copy's loss and gradient alone are finite (the probe's own filters: review 12, a label masked for that input
    gave the twin a nan gradient, which refused sound models, or an inf loss, which blinded the independence check).
    A forward that reorders identical rows (identical inputs at every layer, so row_order.py's forwards see nothing)
    gave per-layer methods each twin's output-gradient under the other's row (review 11: 1.41 C per example, 2.79 C
    leave-one-out); compared with one backward per example, the twins' norms tell them apart. A model that couples
    identical rows is seen by the independence check the same way."""
    if len(ys) < 2:
        return xs, ys, names
    labels = batch_labels.to(ys.device, ys.dtype)
    other = (labels.reshape(len(labels), -1) != ys[:1].reshape(1, -1)).any(1).nonzero()[:, 0].tolist()
    distinct = {}
    for j in other:  # each other label of the whole batch once, in batch order (review 13: the first 4 rows' labels
        distinct.setdefault(tuple(labels[j].reshape(-1).tolist()), j)  # were all masked for example 0: no twin)
    state = rng_state(xs.device, host=True)
    try:
        for j in list(distinct.values())[:TWIN_LABELS]:
            tx, ty = torch.cat([xs, xs[:1]]), torch.cat([ys, labels[j:j + 1]])
            with torch.no_grad(), method.autocast(tx):
                losses = loss_fn(model(tx), ty)
            set_rng_state(state, xs.device)
            if losses.shape != ty.shape[:1] or not bool(torch.isfinite(losses[-1])):
                continue
            last = torch.zeros(len(ty), dtype=torch.bool, device=xs.device)
            last[-1] = True
            if bool(finite_gradients(method, model, loss_fn, tx, ty, last)[-1]):
                twin = f"a copy of {batch_row(0, names)} with the label of {batch_row(j, None)}"
                return tx, ty, list(names) + [twin]
    except (ValueError, RuntimeError):  # a model or loss that cannot take this row: no twin
        pass
    finally:
        set_rng_state(state, xs.device)
    return xs, ys, names


def check_beside_skipped(method, model, loss_fn, x, y, x_skip, y_skip, index, hooks) -> None:
    """The probe rows in a batch that also holds the rows skipped for a gradient that is not finite alone (their
    inputs and losses are finite), before them and after them: each probe row's norm from the method must not be
    below, or other than finite, its gradient's computed alone. A reorder keyed on what only those rows have (a rare
    flag on records that are nan alone) showed on no probed row (review 8: bk 1.63-1.92 C, recompute 1.86-2.45 C)."""
    dropout_off(model)  # (the alone gradients are batches of one), train mode otherwise (Opacus records only then)
    want = alone_grads(model, loss_fn, x, y).norm(dim=1)  # (k,)
    k = len(y)
    for xb, yb, rows in ((torch.cat([x_skip, x]), torch.cat([y_skip, y]), slice(len(y_skip), None)),
                         (torch.cat([x, x_skip]), torch.cat([y, y_skip]), slice(0, k))):
        if hooks is not None:
            hooks.enable_hooks()
        got = method.privatize(model, loss_fn, xb, yb).norms
        quiet(hooks)
        if got is None:
            return
        got = got.detach().double()[rows]
        rtol = 5e-2 if method.precision == "bf16" else tolerance(x if x.is_floating_point() else got.float())
        bad = ~torch.isfinite(got) | (got < want * (1 - rtol) - rtol * float(want.max()))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise DprunError(f"method={method.name}'s per-example gradient norm of {batch_row(i, index)} is "
                             f"{float(got[i]):.6g} in a batch beside examples whose gradient alone is not finite, but "
                             f"{float(want[i]):.6g} alone: a module's rows are not their examples' (the batch in "
                             f"another order), so its norms do not bound what each example releases; use {BLACK_BOX}")


def finite_gradients(method, model, loss_fn, x: torch.Tensor, y: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """ok ((n,) bool) less the rows whose gradient, computed alone, is not finite although their loss is (a
    `torch.where` whose unselected branch is nan: 0 * inf in its backward). The step leaves such a record out
    (runner/methods/dropped.py); probed, it failed every comparison, so one such training record refused the run.
    One backward of the rows together; each row alone only when that is not finite."""
    params = trainable(model)

    def finite(rows: list[int]) -> bool:
        index = torch.tensor(rows, dtype=torch.long, device=x.device)
        try:
            with method.autocast(x):
                loss = loss_fn(model(x[index]), y[index]).sum()
            grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else ()
        except (ValueError, RuntimeError):  # a model that cannot run a batch of one: probed, the checks name it
            return True
        return all(bool(torch.isfinite(g).all()) for g in grads if g is not None)

    rows = ok.nonzero()[:, 0].tolist()
    if not params or not rows or finite(rows):
        return ok
    return ok & torch.tensor([finite([r]) if bool(ok[r]) else False for r in range(len(ok))], device=ok.device)


def orders(xs: torch.Tensor, ys: torch.Tensor, rows: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """The probe rows as drawn, and reversed (with each row's index in the batch, for the messages): a forward that
    reorders the batch by its data (sorting by length before packing, then restoring the order) is the identity on
    rows already in its order, never on them reversed too (unless their keys tie), so a per-layer method's rows are
    checked against their examples under a reordering."""
    return [(xs, ys, list(rows))] + ([(xs.flip(0), ys.flip(0), list(rows)[::-1])] if len(ys) >= 2 else [])


def quiet(hooks):
    if hooks is not None:
        hooks.disable_hooks()


def one_row(probe) -> None:
    """A probe on one example; a model that cannot run a batch of one at all (a batch statistic) is left to the
    other checks."""
    try:
        probe()
    except (ValueError, RuntimeError):
        pass


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a variable assigned after the function was made)
        return None


PLAIN = (int, float, complex, str, bool, bytes, type(None))


def state_key(value, depth: int = 2):
    """What of `value` a loss could read: a number or string by value, a tensor by identity and version (written in
    place: a new version), a container's items and an object's attributes down to `depth` levels, anything else by
    identity."""
    if isinstance(value, PLAIN):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if depth > 0 and isinstance(value, (list, tuple)):
        return (type(value), *(state_key(v, depth - 1) for v in value[:32]))
    if depth > 0 and isinstance(value, dict):
        return (type(value), *((k, state_key(v, depth - 1)) for k, v in list(value.items())[:64]))
    if depth > 0 and hasattr(value, "__dict__") and not isinstance(value, (type, types.FunctionType, types.ModuleType)):
        return ("object", type(value), id(value), state_key(vars(value), depth - 1))
    return ("id", type(value), id(value))


def loss_key(loss_fn) -> tuple:
    """What makes a loss function the same one: its code and the state it closes over, defaults to or is bound to,
    so a lambda re-made each step is not checked again, but make_loss(5.0) after make_loss(0.0) is (`l + mix *
    l.mean()`: mix = 0 passed the check, mix = 5 then moved one example's release by 1.6 C in reweight twopass,
    4.3 C in jl), and so is a loss object, bound method, captured dict or tensor whose state changed since (1.3 C
    and 2.8 C). What the code reads from globals is not seen."""
    if isinstance(loss_fn, types.MethodType):
        return (getattr(loss_fn.__func__, "__code__", loss_fn.__func__), state_key(loss_fn.__self__))
    code = getattr(loss_fn, "__code__", None)
    if code is None:  # a callable object (an nn.Module loss, a functools.partial)
        return (state_key(loss_fn),)
    captured = [_contents(c) for c in (loss_fn.__closure__ or ())] + list(loss_fn.__defaults__ or ())
    return (code, *(state_key(v) for v in captured))


TORCH_DIR = os.path.dirname(torch.__file__)


def torchs_own(cls) -> bool:
    """An autograd.Function class whose backward is torch's own code: the backward a plain function whose code lives
    in torch's installed files (a class's `__module__` can be set to anything: review 17), and not one of the classes
    torch generates to run a user's backward (`torch.library.custom_op` with `register_autograd`, torch._library:
    review 18). A backward without code of its own (a functools.partial, a callable object) is not trusted (review 18)."""
    fn = getattr(cls, "backward", None)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return (code is not None and os.path.abspath(code.co_filename).startswith(TORCH_DIR + os.sep)
            and not cls.__module__.startswith("torch._library"))


def user_functions(losses: torch.Tensor) -> list[str]:
    """The torch.autograd.Function classes whose backward is not torch's own code (torchs_own) that the graph which
    produced `losses` runs (its nodes' `_forward_cls`), by name; torch's own (checkpointing, compiled graphs) are
    derivatives of its operators, linear in the incoming gradient."""
    found, seen, stack = set(), set(), [losses.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        cls = getattr(node, "_forward_cls", None)
        if cls is not None and not torchs_own(cls):
            found.add(f"{cls.__module__}.{cls.__qualname__}")
        stack.extend(n for n, _ in node.next_functions)
    return sorted(found)


@contextlib.contextmanager
def tensor_hooks_seen(found: list[str]):
    """Tensor.register_hook called inside the block (a forward registering a hook on an activation) appends the
    hook's name to `found`; dprun's own recorders (runner.*) are not counted."""
    real = torch.Tensor.register_hook

    def spy(tensor, hook):
        fn = getattr(hook, "func", hook)
        if not getattr(fn, "__module__", "").startswith("runner."):
            found.append(f"a tensor hook ({getattr(fn, '__qualname__', type(fn).__name__)})")
        return real(tensor, hook)

    torch.Tensor.register_hook = spy
    try:
        yield found
    finally:
        torch.Tensor.register_hook = real


def gradient_hooks(model) -> list[str]:
    """Hooks that change gradients outside the graph's operators: module backward hooks (each module's, and the
    global ones) and the trainable parameters' own hooks."""
    from torch.nn.modules import module as modules

    found = [f"a backward hook of {path or 'the model'}" for path, m in model.named_modules()
             if m._backward_hooks or m._backward_pre_hooks]
    if modules._global_backward_hooks or modules._global_backward_pre_hooks:
        found.append("a global module backward hook")
    found += [f"a hook on parameter {n}" for n, p in model.named_parameters()
              if p.requires_grad and (p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))]
    return found


def check_no_user_function(method, model, loss_fn, x: torch.Tensor, y: torch.Tensor) -> None:
    """A method that releases the backward of sum_i nu_i loss_i (jl) releases sum_i nu_i grad_i only where every
    backward is linear in its incoming gradient, which torch's operators are and a user's autograd.Function, tensor
    hook or module backward hook need not be. A Function lifting output-gradients only in a band of norms between the
    factors the oracle comparison tries (measured.py SMALL_FACTORS) released 66-74 C (reweight twopass and recompute,
    which released such a backward until review 25) and 65-72 C (jl) (review 16), and the same lift as a tensor hook,
    a module backward hook or a Function claiming to be torch's, 65-66 C (review 17); no finite set of factors closes
    that, so such a model is refused. reweight, in every mode, sums the recorded output-gradients of the unweighted
    loss (factor 1 everywhere a hook runs) and stays exact. A hook registered on a graph node
    (grad_fn.register_hook) is not seen."""
    if method.name != "jl":
        return
    names = gradient_hooks(model)
    with torch.enable_grad(), method.autocast(x), tensor_hooks_seen(names):
        losses = loss_fn(model(x), y)
    names += user_functions(losses) if torch.is_tensor(losses) and losses.grad_fn is not None else []
    if names:
        raise DprunError(f"method={method.name} releases the backward of sum_i nu_i loss_i, which is sum_i nu_i "
                         f"grad_i only where every backward is linear in its incoming gradient, and the model's "
                         f"backward runs code of its own that need not be ({', '.join(dict.fromkeys(names))}: a custom "
                         f"torch.autograd.Function or a gradient hook); use method=reweight (it sums the recorded "
                         f"gradients of the unweighted loss), or method=nxbp or multiloss (each example alone)")


def padded_prefixes(n: int, sizes) -> list[int]:
    """Row counts m of the batch's prefixes that compile='s padding pads (m < the largest size) with other numbers of
    copies of row 0 (P - m + 1): the whole batch where it is padded, and prefixes a chunk of `physical_batch_size`
    rows or fewer holds (review 53: with chunks the whole batch is not padded, and a chunk's last rows are), at
    counts spread over the largest gap (1, 2, 4, ... copies and the most), distinct, each >= 2."""
    sizes = sorted((int(sizes),) if isinstance(sizes, int) else (int(s) for s in sizes))
    top = min(n, sizes[-1])
    counts = {top if top < sizes[-1] else sizes[-1] - 1}
    gap = max(b - a for a, b in zip([0, *sizes], sizes))
    counts |= {sizes[-1] - c for c in (3, 8, gap)}
    counts |= {m - 1 for m in counts}  # both parities of the copies' count (review 53: a parity read at >= 5 copies)
    return sorted(m for m in counts if 2 <= m <= n and m < sizes[-1])


# the rows the padded probe removes from a prefix of m rows: any removal changes the padding's count of copies (what
# such a model reads); row 0 also changes which row is copied. Not every row: a prefix of the whole batch is B rows,
# and removing each cost B^2 forwards (review 57: 528 s for the transformer at B = 256); the unpadded probe removes
# every probed example
PADDED_REMOVALS = lambda m: sorted({0, 1, m - 1})  # noqa: E731


def check_padded_independence(method, model, loss_fn, x: torch.Tensor, y: torch.Tensor, name: str) -> None:
    """compile= pads each chunk to a bucket with copies of its first row (runner/methods/padding.py): the
    independence probe again through that padding, on prefixes padded with several numbers of copies, as the step
    runs them (in the method's autocast too), so removing an example changes the padding as in training. A model
    whose rows read the padding (how many copies of row 0 it holds, hence the batch's size) moved example 0's own
    gradient with the others' presence (review 51: 1.7-2.0 C; review 53: 1.9-2.3 C with chunks, at 5-8 copies, under
    bf16's autocast). Which sizes trigger a model is the model's choice: one reading only counts no prefix shows
    passes (docs/privacy.md, "What it cannot see")."""
    sizes = getattr(method, "padding_sizes", None)  # compile=: the step runs each chunk padded
    if not sizes:
        return
    from runner.methods.padding import PaddedRows

    padded = PaddedRows(model, sizes)
    for m in padded_prefixes(len(y), sizes):
        check_independence(padded, loss_fn, x[:m], y[:m], name, PADDED_REMOVALS(m))
        if method.precision == "bf16" and x.device.type == "cpu":  # the step's forward runs under autocast: the
            # removal probed there too; on the CPU only, where rows of other batch shapes round alike (review 55; a
            # CUDA bf16 kernel's rows at another padded size differ by ~4e-3, beyond what the probe forgives)
            with method.autocast(x):
                check_independence(padded, loss_fn, x[:m], y[:m], name, PADDED_REMOVALS(m))


def check_first_step(method, model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> None:
    key = (id(model), loss_key(loss_fn))
    if getattr(method, "_privacy_checked", None) == key or len(y) == 0 or x.device.type == "meta":
        return  # checked; nothing to check; shapes without values (tests/test_no_host_sync.py): nothing to compare
    name = method.name
    before = snapshot(model)
    k = 0
    started = time.perf_counter()
    try:
        with untouched(method, model, x.device) as hooks:
            quiet(hooks)
            xs, ys, rows_in_batch, skipped = probe(method, model, loss_fn, x, y)
            xs, ys, rows_in_batch = with_twin(method, model, loss_fn, xs, ys, rows_in_batch, y)
            k = len(ys)
            if k == 0:
                return  # no finite example in this batch: the next one is checked
            with torch.no_grad():
                check_losses(loss_fn(model(xs), ys), k)
            check_no_user_function(method, model, loss_fn, xs, ys)
            if name not in ALONE and not method.updates_model and k >= 2:
                check_independence(model, loss_fn, xs, ys, name)
                check_padded_independence(method, model, loss_fn, x, y, name)
                if method.precision == "bf16":  # the step's forward runs under autocast: coupled only there?
                    check_independence_autocast(model, loss_fn, xs, ys, name, method.autocast(xs))
            if name in PER_LAYER:
                check_batch_first(model, xs, name)
                one_row(lambda: check_batch_first(model, xs[:1], name))  # no non-batch dimension equals both sizes
                check_inside_calls(model, loss_fn, xs, ys, name)
                check_row_order(method, model, x)  # the whole batch, and records of the features its rows tie on
            if name == "jl":  # black box: its estimates and its batch backward against each example alone
                check_jl_release(method, model, loss_fn, xs, ys, rows_in_batch)
            check_unwritten(model, before, name)
            rule = oracle_rule(method)
            probes = orders(xs, ys, rows_in_batch)
            probes = probes if name in PER_LAYER else probes[:1]  # the rows' order matters to per-layer norms
            for px, py, index in probes:
                quiet(hooks)
                state = rng_state(x.device, host=True)
                with method.autocast(px):
                    rows = per_example_grads(model, loss_fn, px, py) if rule else None
                set_rng_state(state, x.device)  # the method's forward draws the oracle's dropout masks
                if hooks is not None:
                    hooks.enable_hooks()
                check_against_oracle(method, model, loss_fn, px, py, rows, rule, index)
                if rule is None and name in PER_LAYER:  # the peer's grad samples: no oracle, so their rows' owners
                    check_own_rows(method, model, loss_fn, px, py, index)
            if name in PER_LAYER and len(skipped[1]):
                quiet(hooks)
                check_beside_skipped(method, model, loss_fn, xs, ys, *skipped, rows_in_batch, hooks)
            check_unwritten(model, before, name)
    finally:
        restore(before)
    # its own cost, once per run (review 60: ~125 s for the Transformer at B = 256 under load, unrecorded before)
    log.info("privacy check (first step, %d probe rows of a batch of %d): %.1f s", k, len(y),
             time.perf_counter() - started)
    if k >= 2:  # a batch of one cannot show coupling: the next batch is checked too
        method._privacy_checked = key
