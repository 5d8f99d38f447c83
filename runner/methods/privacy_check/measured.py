"""What is released is what was measured: per-layer norms cover every path from a parameter to the loss.

    check_inside_calls(model, loss_fn, x, y, "reweight")    # no covered parameter reaches the loss outside its module
    check_against_oracle(method, model, loss_fn, x, y)      # the method's norms and clipped sum = per-example autograd
    check_own_rows(method, model, loss_fn, x, y)            # row i of the norms moves with example i only (no oracle)

Per-layer methods (reweight, the Opacus peer) measure a parameter's per-example gradient from its module's calls
only. A parameter used elsewhere too (F.linear(x, fc.weight * mask)) has a gradient those norms never saw:
twopass/recompute released it unclipped (10 x C), book-keeping silently dropped it. check_inside_calls finds it
by giving every module call its own copy of the module's parameters: any gradient left on the original reaches
the loss outside the calls. check_against_oracle then compares, on a few examples, the method's own norms and
clipped sum with one autograd backward per example (independent of any rule), under the same random state.
Opacus's grad samples (hooks, functorch) have no oracle (where its rule is inexact, e.g. an Embedding's padding row,
they are not the true gradient, yet each is one example's, so the clip bounds it); check_own_rows asks the weaker
thing that still carries the bound: row i of the norms belongs to example i. A module fed the batch in another order
(rows reversed or sorted, then restored) makes row i mix example i's gradient in some layers with another example's
in others, each piece clipped by the wrong factor: up to sqrt(2) C for one reordered layer.
"""
from __future__ import annotations

import torch
from torch import nn

from runner.errors import DprunError
from runner.methods.rng import rng_state, set_rng_state
from runner.methods.base import trainable
from runner.methods.privacy_check.modules import dropout_off
from runner.methods.privacy_check.shapes import BLACK_BOX, check_losses, check_norms, covered



def tolerance(t: torch.Tensor) -> float:
    """Relative tolerance of a method's norms against one backward per example, for t's dtype and device (kernels
    may block differently per batch size; on CUDA, cuDNN's TF32 convolutions may pick another algorithm). A norm
    that bounds nothing is off by far more (a batch-coupled or hidden parameter: O(1))."""
    if t.dtype == torch.float64:
        return 1e-7
    return 1e-2 if t.is_cuda else 3e-4

def check_inside_calls(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, method: str) -> None:
    owned = {}  # id(module) -> (path, {name: original parameter})
    for path, m in covered(model):
        owned[id(m)] = (path, {n: p for n, p in m.named_parameters(recurse=False) if p.requires_grad})

    def swap_in(module, args):  # this call sees fresh leaves, copies of its parameters
        for n, p in owned[id(module)][1].items():
            module._parameters[n] = p.detach().requires_grad_()

    def swap_out(module, args, out):  # the original again, for any use outside the call
        for n, p in owned[id(module)][1].items():
            module._parameters[n] = p

    handles = []
    for _, m in covered(model):
        handles += [m.register_forward_pre_hook(swap_in), m.register_forward_hook(swap_out)]
    try:
        losses = loss_fn(model(x), y)  # (B,)
    finally:
        for h in handles:
            h.remove()
        for _, m in covered(model):
            swap_out(m, None, None)
    if not losses.requires_grad:  # no trainable parameter reaches the loss
        return
    originals = [(f"{path}.{n}" if path != "<model>" else n, p) for path, ps in owned.values() for n, p in ps.items()]
    grads = torch.autograd.grad(losses.sum(), [p for _, p in originals], allow_unused=True)
    for (name, _), g in zip(originals, grads):
        # any path, even one whose gradient is 0 on this batch: `mask(x) * F.linear(x, fc.weight)` is 0 for the
        # first batch's rows and 1.82 C for a crafted row later (reweight twopass/recompute)
        if g is not None:
            raise DprunError(f"parameter {name} reaches the loss outside its module's call (e.g. F.linear(x, "
                             f"fc.weight * mask)): method={method} measures each example's gradient from the "
                             f"module's calls only, so that part would be released unclipped or dropped; call the "
                             f"module instead, or use {BLACK_BOX}")


def per_example_grads(model, loss_fn, x, y):
    """One backward per example through the batch's graph: [[grad of each trainable p for example i] per i]."""
    params = trainable(model)
    losses = loss_fn(model(x), y)  # (B,)
    check_losses(losses, len(y))
    rows = []
    for i in range(len(y)):
        gs = torch.autograd.grad(losses[i], params, retain_graph=i < len(y) - 1, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, gs)])
    return rows


def check_against_oracle(method, model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, rows,
                         rule: str | None = "equal", index: list[int] | None = None) -> None:
    """method.privatize on x (a few examples) against `rows`, one backward per example (per_example_grads, drawn
    from the same random state): the norms equal them (rule "equal") or are at least them ("bound"), and the
    released sum is sum_i factor_i grad_i. rows None: only the shapes of the method's losses and norms."""
    params = trainable(model)
    names = {id(p): n for n, p in model.named_parameters()}
    for p in params:
        p.grad = None
    state = rng_state(x.device, host=True)  # the caller's: the oracle's dropout masks
    out = method.privatize(model, loss_fn, x, y)
    check_losses(out.losses, len(y))
    check_norms(out.norms, len(y), method.name)
    if rows is None or out.norms is None:
        return
    want = torch.stack([torch.sqrt(sum(g.double().pow(2).sum() for g in r)) for r in rows])  # (k,)
    rtol = 5e-2 if method.precision == "bf16" else tolerance(x if x.is_floating_point() else want.float())
    got = out.norms.detach().double()
    # a record whose gradient is not finite is dropped by design (clip factor 0, runner/norms/certify.py): compare the rest
    kept = torch.isfinite(want) & torch.isfinite(got)
    atol = rtol * float(want[kept].max()) if bool(kept.any()) else 0.0
    low = kept & (got < want - atol - rtol * want)  # an under-estimate: the released gradient could exceed C
    if bool(low.any()) or (rule == "equal" and not torch.allclose(got[kept], want[kept], rtol=rtol, atol=atol)):
        i = int(low.nonzero()[0]) if bool(low.any()) else int((got - want).abs().argmax())
        raise DprunError(f"method={method.name}'s per-example gradient norm of {batch_row(i, index)} is"
                         f" {float(got[i]):.6g}, but one backward for that example alone gives {float(want[i]):.6g}: "
                         f"its norms do not bound what it releases for this model; use {BLACK_BOX}")
    check_release(method, params, names, out.norms.detach(), rows, kept, got, want, rtol)
    if method.name != "reweight" or not bool((kept & (got > 0)).any()):
        return
    # a second line: a release linear in nu (reweight sums recorded output-gradients of the unweighted loss in every
    # mode; twopass and recompute released the backward of sum_i nu_i loss_i until review 25, where a custom
    # autograd.Function lifting a small output-gradient released 15.5 C, review 14) agrees with the oracle at every
    # factor, so the release is compared again with every factor small and distinct
    smallest = float(got[kept & (got > 0)].min())
    clip = method._clip  # set underneath the property: its range check is for what is released, and nothing here is
    try:
        for shrink in SMALL_FACTORS:
            method._clip = max(shrink * smallest, 1e-30)
            set_rng_state(state, x.device)  # the oracle's dropout masks again
            for p in params:
                p.grad = None
            again = method.privatize(model, loss_fn, x, y).norms.detach()
            check_release(method, params, names, again, rows, kept, got, want, rtol)
    finally:
        method._clip = clip
        set_rng_state(state, x.device)


SMALL_FACTORS = (1e-2, 1e-6)  # clips, relative to the probe's smallest norm, at which the release is compared again


def check_release(method, params, names, norms, rows, kept, got, want, rtol) -> None:
    """The released .grad of every parameter equals sum_i factor_i grad_i with the method's own factors of `norms`."""
    factors = method.clip_factors(norms).double()  # (k,); 0 for a dropped record
    # the tolerance's unit: what the clipped sum's norm is at most, with each example's own (certified) norm, which
    # covers the rounding of a gradient whose positions cancel (the two float32 sums then differ by ~u S_i, not u ||g_i||)
    scale = float((factors * torch.where(kept, torch.maximum(got, want), torch.zeros_like(got))).sum())
    for j, p in enumerate(params):
        expected = sum(f * r[j].double() for f, r, k in zip(factors, rows, kept) if k and f > 0)
        released = (p.grad if p.grad is not None else torch.zeros_like(p)).double()
        if not torch.allclose(released, expected + torch.zeros_like(released), rtol=rtol, atol=rtol * max(scale, 1e-12)):
            raise DprunError(f"method={method.name} releases for parameter {names.get(id(p), '?')} a clipped sum "
                             f"that differs from the sum of the per-example gradients it measured"
                             f"{'' if float(factors.max()) >= 1 else ' when they are clipped'}: part of that "
                             f"gradient is not covered by its norms (or the backward is not linear in the clip "
                             f"factors: a custom autograd.Function); use {BLACK_BOX}")


def batch_row(i: int, index: list | None) -> str:
    """Row i of a probe named for a message: "example 3 of the first batch" (index: the probe's rows, e.g. reversed;
    an int is a row of the first batch, a str a record from elsewhere, e.g. "training record 512": probe_rows.py)."""
    row = index[i] if index else i
    return row if isinstance(row, str) else f"example {row} of the first batch"


def check_own_rows(method, model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
                   index: list[int] | None = None) -> None:
    """Example j replaced by example j+1's data (the same random state: the same dropout masks by row), for each j:
    the method's norms of the other rows must not move. x: (k, ...) probe rows, k >= 2; the model in train mode."""
    k = len(y)
    if k < 2:
        return
    state = rng_state(x.device, host=True)
    base = method.privatize(model, loss_fn, x, y).norms
    if base is None:
        return
    base = base.detach().double()
    rtol = 5e-2 if method.precision == "bf16" else tolerance(x if x.is_floating_point() else base.float())
    for j in range(k):
        other = x.clone()
        other[j] = x[(j + 1) % k]
        set_rng_state(state, x.device)
        moved = method.privatize(model, loss_fn, other, y).norms.detach().double()
        rest = (torch.arange(k, device=base.device) != j) & torch.isfinite(base) & torch.isfinite(moved)
        atol = rtol * float(base[rest].abs().max()) if bool(rest.any()) else 0.0
        off = rest & ((moved - base).abs() > atol + rtol * base.abs())
        if bool(off.any()):
            i = int(off.nonzero()[0])
            raise DprunError(f"method={method.name}'s per-example gradient norm of {batch_row(i, index)} "
                             f"moves ({float(base[i]):.6g} -> {float(moved[i]):.6g}) when only "
                             f"{batch_row(j, index)} changes: a "
                             f"module's rows are not their examples' (the batch in another order, or rows mixing "
                             f"examples), so its norms do not bound what each example releases; use {BLACK_BOX}")
    set_rng_state(state, x.device)


def alone_grads(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(k, d) float64: each example's gradient from a forward and backward of that example ALONE (a batch of one), so
    that nothing another example does in the forward or the backward reaches it (per_example_grads runs through the
    batch's graph, whose backward a custom autograd.Function may couple)."""
    params = trainable(model)
    rows = []
    for i in range(len(y)):
        gs = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum(), params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).detach().double().flatten()
                               for p, g in zip(params, gs)]))
    return torch.stack(rows)


JL_DIRECTIONS = 4  # the check's own directions (the step's r does not matter to what it compares)
JL_RTOL = 1e-2  # estimates from the same directions: float32 rounding moves them < 1e-3 on ordinary data (docs/jl.md)


def check_jl_release(method, model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
                     index: list[int] | None = None) -> None:
    """jl's estimates and clipped sum against each example's gradient, twice, with the check's own directions V: the
    estimates M_i must equal those of the gradient G_i that is released, sqrt(mean_j <G_i, v_j>^2), and the release
    must equal sum_i nu_i G_i with jl's own factors; the jl accountant assumes both.

    First through the SAME forward as the projections (check_jl_same_forward): the model as the step runs it, its
    random draws replayed. Then against each example ALONE (a batch of one), which the forward probes cannot replace:
    a backward that mixes examples (a custom autograd.Function returning g + g.flip(0)) moved one example's release by
    2.7 C with jvp=double_vjp, 6.0 C with forward mode, and its batch backward mixes the per-example gradients of the
    first comparison alike. A batch of one draws other dropout masks, so the second comparison runs with the dropout
    modules off, or in eval mode where the forward is random elsewhere. The caller restores the random state and the
    train/eval flags."""
    check_jl_same_forward(method, model, loss_fn, x, y, index)
    dropout_off(model)
    with torch.no_grad():
        if not torch.equal(*(loss_fn(model(x), y).nan_to_num(nan=0.0) for _ in range(2))):
            model.eval()  # random outside dropout modules: each example alone would draw other values
    G = alone_grads(model, loss_fn, x, y)  # (k, d)
    compare_jl(method, model, loss_fn, x, y, G, index, "computed alone", small_factors=True)


def check_jl_same_forward(method, model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
                          index: list[int] | None = None) -> None:
    """jl's estimates and release against each example's gradient through the same forward as its projections
    (per_example_grads: one backward per example through the batch's graph), in the model's own mode with dropout on,
    the random state restored before each forward so both draw the same values. The comparison with each example
    alone turns dropout off (or the model to eval mode), and a model keyed to that (a branch on its dropout module's
    flag, or functional dropout) reached a parameter through a plain list in training only, which forward mode's
    functional_call does not substitute: 26.1 C under jvp=forward (review 21; 42.7 C in eval mode, review 20)."""
    state = rng_state(x.device, host=True)
    rows = per_example_grads(model, loss_fn, x, y)
    G = torch.stack([torch.cat([g.detach().double().flatten() for g in row]) for row in rows])  # (k, d)
    del rows
    compare_jl(method, model, loss_fn, x, y, G, index, "computed through the same forward", state=state)


def compare_jl(method, model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, G: torch.Tensor,
               index: list[int] | None, how: str, state=None, small_factors: bool = False) -> None:
    """jl's estimates (its projections on the check's directions) and release (check_jl_sum) against G (k, d), each
    example's gradient `how` it was computed; `state`: the random state G's forward started from, restored before
    each projection forward (the same draws). small_factors: the release again at small clip factors."""
    from runner.methods.jl import draw_directions, padding_rows

    params = trainable(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    finite = torch.isfinite(G).all(1)  # (k,): a row whose gradient is not finite (a nan where-branch) is one the
    if not bool(finite.all()):  # step leaves out (runner/methods/dropped.py): compared, it raised torch's own error
        keep = finite.nonzero()[:, 0]
        x, y, G = x[keep], y[keep], G[keep]
        index = [index[i] for i in keep.tolist()] if index else keep.tolist()
        if len(y) == 0:
            return
    V = draw_directions(dict(zip(names, params)), JL_DIRECTIONS, padding_rows(model))  # name -> (r, *p.shape)
    Vf = torch.cat([V[n].double().reshape(JL_DIRECTIONS, -1) for n in names], 1)  # (r, d)

    def projections():  # one direction per pass: the least memory (4 examples), no halving; a fresh graph each
        if state is not None:
            set_rng_state(state, x.device)
        for p in params:
            p.grad = None
        chunk, method.chunk = method.chunk, 1
        try:
            return method._projections(model, loss_fn, x, y, V)[2:]  # P (k, r), backward
        finally:
            method.chunk = chunk

    P, backward = projections()
    got = P.double().pow(2).mean(1).sqrt()  # (k,) jl's estimates
    want = (G @ Vf.T).pow(2).mean(1).sqrt()  # (k,) the estimates of each example's own gradient
    scale = float(want.max()) if len(want) else 0.0
    off = (got - want).abs() > JL_RTOL * (want + scale)
    if bool(off.any()):
        i = int(off.nonzero()[0])
        raise DprunError(f"method=jl's norm estimate for {batch_row(i, index)} is "
                         f"{float(got[i]):.6g}, but the same directions give {float(want[i]):.6g} for that "
                         f"example's gradient {how}: its projections are not those of the gradient it "
                         f"releases (a custom autograd.Function whose jvp and backward disagree, a parameter the "
                         f"forward reaches other than as its module's attribute, or a backward that mixes examples), "
                         f"so the jl accountant's analysis does not hold; use method=nxbp or multiloss (each example "
                         f"alone)")
    nu = method.clip_factors(P.pow(2).mean(1).sqrt()).double()  # (k,) jl's own factors, as JL.privatize forms them
    check_jl_sum(backward, nu, G, want)
    if not small_factors or not bool((got > 0).any()):
        return
    # and with every factor small and distinct (SMALL_FACTORS): a backward that is not linear in them (a custom
    # autograd.Function lifting a small output-gradient) released 14.7 C where jl's own factor allowed 2.0 (review 14)
    smallest = float(got[got > 0].min())
    for shrink in SMALL_FACTORS:
        check_jl_sum(projections()[1], (shrink * smallest / got.clamp_min(smallest)).clamp(max=1.0), G, want)


def check_jl_sum(backward, nu: torch.Tensor, G: torch.Tensor, want: torch.Tensor) -> None:
    """jl's release backward(nu) ((k,) factors) against sum_i nu_i G_i with each example's gradient alone (k, d)."""
    released = torch.cat([g.detach().double().flatten() for g in backward(nu.float()).values()])  # (d,)
    expected = nu.double() @ G  # (d,)
    if not torch.allclose(released, expected, rtol=JL_RTOL, atol=JL_RTOL * float((nu * want).sum()) + 1e-12):
        raise DprunError("method=jl releases a clipped sum that differs from sum_i nu_i g_i with each example's "
                         "gradient computed alone: the model's backward mixes the examples of the batch, or is not "
                         "linear in the clip factors (a custom autograd.Function), so an example's contribution is not "
                         "what jl's factors allow; use method=nxbp or multiloss (each example alone)")
