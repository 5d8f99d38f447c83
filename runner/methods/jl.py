"""DP-SGD-JL / DP-Adam-JL (JL paper, Algorithms 1 and 3): per-example gradient norms estimated from r projections.

Each step draws v_1..v_r ~ N(0, I_d) over ALL trainable parameters (torch's RNG, seeded by the run), computes
P_ij = <grad loss_i, v_j> for the whole batch with one Jacobian-vector product per direction, estimates
M_i = sqrt(mean_j P_ij^2) (M_i^2 / ||g_i||^2 ~ chi^2_r / r), clips with nu_i = min(1, C / (M_i + 1e-6)) and
leaves sum_i nu_i g_i in .grad; base.step adds the noise and the optimizer step (optimizer=adam: DP-Adam-JL).
The model is a black box: no norm rules, any architecture torch.func can differentiate (stock nn.LSTM included).

    method.jvp=forward     forward-mode AD on the model's own autograd graph: ONE forward yields the losses
                           (primal, with the graph for the backward of sum_i nu_i loss_i) and the projections
                           (tangents): torch's dual tensors for one direction, vmap of torch.func.jvp over
                           several (the primal computed once); no second forward before the backward
    method.jvp=double_vjp  the paper's PyTorch route: g(u) = grad <u, losses>, then P_j = d/du <g(u), v_j>;
                           shares the forward, but a double backward per chunk of directions
    method.jvp=auto        forward; if an operator has no forward-mode formula (CPU nn.LSTM's mkldnn kernel),
                           log it once and use double_vjp from then on
    method.chunk=K         directions per pass (0 = all r at once); K=1: one dual-tensor pass per direction.
                           Out of memory: K is halved (logged) down to 1, the step retried (keeps forward mode)

    dprun method=jl r=4 dataset=synthetic dataset.like=cifar10 epochs=1 max_steps_per_epoch=20
    dprun method=jl r=1 dataset=synthetic dataset.like=imdb optimizer=adam lr=0.001     # DP-Adam-JL

Dropout: with jvp=forward the mask is drawn once (vmap randomness="same") and shared by the primal, every
tangent and the backward (one pass); further chunks of directions replay the RNG state, so they draw the same mask.
The step's mechanism is SubsampledJL(q, sigma, r): only the JL accountant (Theorem 4.1) accepts it.
"""
from __future__ import annotations

import logging

import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call, jvp, vmap
from torch.utils.checkpoint import CheckpointError

from runner.accountants.mechanisms import Mechanism, SubsampledJL
from runner.methods.centred_norms import centre_spatial_norms
from runner.errors import DprunError
from runner.methods.base import METHODS, Method, Privatized
from runner.methods.rng import rng_state, set_rng_state
from runner.methods.features import Feature
from runner.models.attention import composite_attention

log = logging.getLogger("dprun")

MODES = ("auto", "forward", "double_vjp")

Directions = dict[str, torch.Tensor]  # parameter name -> (r, *p.shape)


def trainable_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def draw_directions(params: dict[str, torch.Tensor], r: int, padding: dict[str, int] | None = None,
                    generator: torch.Generator | None = None) -> Directions:
    """v_1..v_r ~ N(0, I_d) over all the given parameters, from `generator` (None: torch's global RNG):
    name -> (r, *p.shape).
    padding: embedding weight name -> padding_idx (padding_rows), whose row is set to 0 after the draw (the same
    stream of draws): its gradient is 0, so <g, v> is unchanged, but forward mode's tangent of an embedding looks
    the row up at every padding position (the backward zeroes it) and would count it."""
    directions = {n: torch.randn((r, *p.shape), device=p.device, dtype=p.dtype, generator=generator)
                  for n, p in params.items()}
    for n, row in (padding or {}).items():
        if n in directions:
            directions[n][:, row] = 0.0
    return directions


def padding_rows(model: nn.Module) -> dict[str, int]:
    """Trainable embedding weights with a padding_idx: parameter name -> that row. Its gradient is always 0 (the
    backward zeroes it), while forward mode's tangent V[ids] includes V[padding_idx] wherever the padding token
    sits: an estimate M_i from those projections measured the padding positions' output-gradients too (7.1 against
    the true norm 1.0 for an example of one token and seven padding positions that reach the loss)."""
    rows = {}
    for path, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.padding_idx is not None and m.weight.requires_grad:
            rows[f"{path}.weight" if path else "weight"] = int(m.padding_idx) % m.num_embeddings
    return rows


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _chunks(r: int, chunk: int) -> list[slice]:
    step = chunk if chunk > 0 else max(r, 1)
    return [slice(s, min(s + step, r)) for s in range(0, r, step)]


def forward_projections(model, loss_fn, x, y, directions: Directions, chunk: int = 0):
    """Forward-mode AD on the model's own autograd graph. Returns losses (B,), outputs (B, classes), P (B, r) and
    backward(nu) -> {name: sum_i nu_i g_i}. The first chunk of directions shares its forward with the backward."""
    with composite_attention():  # SDPA's fused kernels have no forward-mode formula (runner/models/attention.py)
        return _forward_projections(model, loss_fn, x, y, directions, chunk)


def _forward_projections(model, loss_fn, x, y, directions: Directions, chunk: int):
    # the projections' tangents and the release's backward both on leaf copies of the parameters (views: no copy),
    # the tensors functional_call substitutes: a path to a parameter around it (a plain list, a closure) reaches
    # neither, so what is released is what was projected. With the real parameters the backward released that path's
    # gradient too, unprojected: a model taking it only above 32 rows, after its 100th forward or under torch.func
    # (vmap, r >= 2) passed the first step's check and released 14.6-47 C (review 22)
    named = {n: p.detach().requires_grad_() for n, p in trainable_params(model).items()}
    r = next(iter(directions.values())).shape[0]
    slices = _chunks(r, chunk)
    before = rng_state(x.device)  # replayed for every chunk after the first: the same dropout masks
    losses, outputs, tangents = _project(model, loss_fn, x, y, named, _rows(directions, slices[0]))
    check_graph(losses, forward=True)
    rows = [tangents.detach()]  # each (k, B)
    if len(slices) > 1:
        after = rng_state(x.device)
        detached = {n: p.detach() for n, p in named.items()}
        with torch.no_grad():
            for s in slices[1:]:
                set_rng_state(before, x.device)
                rows.append(_project(model, loss_fn, x, y, detached, _rows(directions, s))[2])
        set_rng_state(after, x.device)
    P = torch.cat(rows).T  # (B, r)
    return losses.detach(), outputs.detach(), P, _backward_on(losses, named)


# torch operators that overwrite at indices that may repeat: their forward-mode tangent follows the one write that
# lands, their backward gives the output-gradient to every duplicate (an example of 6 values: -0.236 against -1.743),
# so forward mode's projections are not those of the gradient released (review 23: a slot layout writing all 256
# features to one slot on rare records released 11-58 C). Seen in the step's graph, forward mode refuses (auto: switches
# to double_vjp, whose projections come from the backward itself). index_put / put with accumulate=True add: exact.
OVERWRITES = ("IndexPutBackward0", "PutBackward0", "ScatterBackward0", "IndexCopyBackward0", "ScatterReduceBackward0",
              "IndexReduceBackward0")


class ForwardModeMismatch(NotImplementedError):
    """The step's graph holds an operator whose forward-mode derivative is not its backward's (OVERWRITES)."""


# normalisation kernels (instance_norm runs batch_norm's), by a part of their graph node's name (any overload:
# _native_batch_norm_legit's node passed an exact-name list, review 28): their CPU backward forms the gradients from
# the raw input and cancels at a large mean, where the tangents do not (runner/methods/centred_norms.py). jl centres
# the nn modules' outputs; a kernel still in the graph is a functional call outside them (F.group_norm in a forward)
UNCENTRED = ("GroupNorm", "BatchNorm", "LayerNorm")


def check_graph(losses: torch.Tensor, forward: bool) -> None:
    """A walk of the nodes of the graph that produced `losses`, every step (a model may take a path only on some
    data): DprunError on an UNCENTRED kernel (either mode); forward mode: ForwardModeMismatch on an OVERWRITES
    operator."""
    seen, stack = set(), [losses.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if forward and name in OVERWRITES and not getattr(node, "_saved_accumulate", False):
            raise ForwardModeMismatch(f"{name.removesuffix('Backward0')} writes at indices that may repeat, where "
                                      f"forward mode's derivative is not the backward's")
        if any(kernel in name for kernel in UNCENTRED):
            raise DprunError(f"method=jl: the model runs a normalisation kernel ({name.removesuffix('Backward0')}) "
                             f"outside an nn.GroupNorm, nn.InstanceNorm or nn.LayerNorm module (a functional call in "
                             f"its forward), whose backward cancels at a large mean where jl's estimates do not (1e6 C "
                             f"released: docs/jl.md); use the nn modules (jl centres them), or method=reweight, nxbp or "
                             f"multiloss")
        stack.extend(n for n, _ in node.next_functions)


def _rows(directions: Directions, s: slice) -> Directions:
    return {n: t[s] for n, t in directions.items()}  # name -> (k, *p.shape)


def _project(model, loss_fn, x, y, theta: dict[str, torch.Tensor], v: Directions):
    """losses (B,) and outputs (B, classes), with autograd history if theta has it, and tangents (k, B).

    One direction: torch's dual tensors (torch.autograd.forward_ad), the cheapest per operator. Several: vmap of
    torch.func.jvp over the directions; the primal is not batched, so it is computed once (and dropout draws
    one mask, randomness="same")."""
    k = next(iter(v.values())).shape[0]
    if k == 1:
        with fwAD.dual_level():
            duals = {n: fwAD.make_dual(p, v[n][0]) for n, p in theta.items()}
            out = functional_call(model, duals, (x,))  # frozen params and buffers: the module's own
            losses, tangent = fwAD.unpack_dual(loss_fn(out, y))
            return losses, fwAD.unpack_dual(out).primal, tangent.unsqueeze(0)

    def f(th):  # th -> (losses (B,), outputs (B, classes))
        out = functional_call(model, th, (x,))
        return loss_fn(out, y), out

    one = lambda u: jvp(f, (theta,), (u,), has_aux=True)  # noqa: E731
    losses, tangents, out = vmap(one, out_dims=(None, 0, None), randomness="same")(v)
    return losses, out, tangents  # (B,), (B, classes), (k, B)


def _backward_on(losses: torch.Tensor, named: dict[str, torch.Tensor]):
    """backward(nu) -> {name: sum_i nu_i grad loss_i}: one vjp on the graph that produced `losses`."""

    def backward(nu: torch.Tensor) -> dict[str, torch.Tensor]:
        try:
            grads = torch.autograd.grad(losses, list(named.values()), grad_outputs=nu.to(losses.dtype),
                                        allow_unused=True)
        except CheckpointError as e:  # not visible at attach: a call inside forward(), not a module
            raise DprunError(f"method=jl cannot run this model's torch.utils.checkpoint(use_reentrant=False) "
                             f"with forward-mode projections: its recomputation in the backward saves other "
                             f"tensors than the forward under forward AD did ({first_line(e)}); use "
                             f"method.jvp=double_vjp, or method=multiloss or nxbp") from None
        return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named.items(), grads)}

    return backward


def double_vjp_projections(model, loss_fn, x, y, directions: Directions, chunk: int = 0):
    """The double-vjp trick on the model's own autograd graph: g(u) = sum_i u_i grad loss_i is linear in u, so
    d/du <g(u), v_j> = (<grad loss_i, v_j>)_i = P_:j. Same return values as forward_projections."""
    with composite_attention():  # SDPA's fused backward is not differentiable (runner/models/attention.py)
        return _double_vjp_projections(model, loss_fn, x, y, directions, chunk)


def _double_vjp_projections(model, loss_fn, x, y, directions: Directions, chunk: int):
    named = trainable_params(model)
    names, params = list(named), list(named.values())
    out = model(x)  # (B, classes), one forward with the graph
    losses = loss_fn(out, y)  # (B,)
    check_graph(losses, forward=False)
    u = torch.ones_like(losses, requires_grad=True)  # (B,)
    g = torch.autograd.grad(losses, params, grad_outputs=u, create_graph=True, allow_unused=True)
    used = [i for i, gi in enumerate(g) if gi is not None and gi.requires_grad]
    r = next(iter(directions.values())).shape[0]
    rows = []
    for s in _chunks(r, chunk):
        k = s.stop - s.start
        if not used:
            rows.append(losses.new_zeros(k, len(losses)))
            continue
        gs = [g[i] for i in used]
        vs = [directions[names[i]][s] for i in used]  # each (k, *p.shape)
        if k == 1:
            (pj,) = torch.autograd.grad(gs, u, grad_outputs=[v[0] for v in vs], retain_graph=True)
            rows.append(pj.unsqueeze(0))
        else:
            (pj,) = torch.autograd.grad(gs, u, grad_outputs=vs, retain_graph=True, is_grads_batched=True)
            rows.append(pj)  # (k, B)
    P = torch.cat(rows).T.detach()  # (B, r)

    return losses.detach(), out.detach(), P, _backward_on(losses, named)


PROJECTORS = {"forward": forward_projections, "double_vjp": double_vjp_projections}

# release_agrees' tolerance: the released sum's projections may differ from sum_i nu_i P_ij by this much of C, plus this
# much of sqrt(sum_i (nu_i M_i)^2), which grows like a sum's rounding (sqrt(B)), not like the sum itself: with
# sum_i nu_i M_i (B C when all are clipped) one record could spend the whole batch's slack (review 31: 0.58 C of pure
# residue kept at B = 16384). Honest batches on the zoo's models: gaps of at most 1.2e-5 C at B <= 64
GAP_OF_C, GAP_OF_RMS = 1e-3, 1e-4


def release_agrees(grads: dict, directions: Directions, P: torch.Tensor, nu: torch.Tensor, norms: torch.Tensor,
                   clip: float) -> torch.Tensor:
    """0-dim bool: the released sum G = sum_i nu_i g_i projects on the step's directions as the estimates said,
    sqrt(mean_j Q_j^2) <= GAP_OF_C C + GAP_OF_RMS sqrt(sum_i (nu_i M_i)^2) with Q_j = <G, v_j> - sum_i nu_i P_ij.

    The accountant assumes each estimate M_i is the projection norm of exactly what is released for example i. Where an
    example's exact gradient cancels below float32's rounding, the backward keeps a rounding residue its tangents do
    not see: a stack of convs, InstanceNorms and Tanh on an image of constant pixels released 374 C (4 layers) and
    50,390 C (5 layers) at r = 64, growing ~300x a layer with the norms' 1/sqrt(eps) (review 30). The residue does not
    depend on the directions, so G's projections show it: the gap is that residue's norm, estimated on r directions.
    (B,) -> one (r,) product per parameter, float64 across parameters; no value read (Method.clipped_sum reads it
    with the chunk's one read, and forms the chunk again without the records whose release alone disagrees:
    runner/methods/dropped.py)."""
    r = P.shape[1]
    projected = torch.zeros(r, dtype=torch.float64, device=P.device)
    for n, g in grads.items():
        projected += (directions[n].reshape(r, -1) @ g.detach().reshape(-1)).double()  # (r,) <G, v_j>
    expected = (nu.double().unsqueeze(1) * P.double()).sum(0)  # (r,) sum_i nu_i P_ij (rows with nu = 0 add 0)
    kept = torch.where(nu > 0, nu * norms, torch.zeros((), dtype=norms.dtype, device=norms.device))
    gap = (projected - expected).square().mean().sqrt()
    return gap <= GAP_OF_C * clip + GAP_OF_RMS * kept.double().square().sum().sqrt()


@METHODS.register("jl")
class JL(Method):
    name = "jl"
    exact = False
    default_accountant = "jl"
    summary = "DP-SGD-JL / DP-Adam-JL: norms estimated from r jvp projections (black box; any model)"
    compiles = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.r = int(self.option("r", 1))
        if self.r < 1:
            raise DprunError(f"method.r={self.r} must be >= 1 for method=jl (the JL dimension: number of projections)")
        self.mode = self.choice("jvp", "auto", MODES)
        self.chunk = int(self.option("chunk", 0))
        if self.chunk < 0:
            raise DprunError(f"method.chunk={self.chunk} must be >= 0 (0 = all r directions in one vmap call)")
        self.active = "double_vjp" if self.mode == "double_vjp" else "forward"  # auto may switch, once
        # double_vjp's vmap cannot ask a channels-last tensor's layout ("NYI: querying is_contiguous inside of vmap"):
        # memory_format=auto leaves its model NCHW (runner/memory_format.py); auto's switch puts the model back
        self.channels_last = self.mode != "double_vjp"
        # where the directions come from: torch's global RNG (None), or a generator every rank seeds alike
        # (make_private on several processes: a program that seeds torch per rank drew other directions on each
        # rank, and an example at a rank boundary moved onto another rank's directions: review 20)
        self.direction_generator: torch.Generator | None = None

    def prepare(self, model, data=None):
        if not trainable_params(model):
            raise DprunError("method=jl: the model has no trainable parameters")
        for path, m in model.named_modules():
            if isinstance(m, nn.EmbeddingBag) and m.weight.requires_grad:
                raise DprunError(f"{path or '<model>'} (EmbeddingBag) cannot be trained with method=jl: torch has "
                                 f"neither a forward-mode derivative nor a double backward for embedding_bag, and "
                                 f"jl's projections need one; use method=multiloss or nxbp (exact on it: each "
                                 f"example's gradient alone), or freeze its weight")
        centre_spatial_norms(model)  # its estimates and its release through the same centred values (review 25)
        return model

    def unsupported(self, feature: Feature) -> str | None:
        if feature is Feature.BF16:
            return ("the JL accountant assumes the norm estimates are projections of exactly the gradient that is "
                    "released; under bf16 the projections and the backward round differently")
        return None

    def begin_step(self, model) -> None:
        """The step's v_1..v_r, shared by every chunk (and rank) of the logical batch."""
        self._directions = draw_directions(trainable_params(model), self.r, padding_rows(model),
                                           self.direction_generator)

    def end_step(self) -> None:
        self._directions = None

    def backward_holds_records(self) -> bool:
        """Its clipped sum is the backward of sum_i nu_i loss_i through the projections' forward graph, which holds a
        record's inf/nan values: a record whose estimate or loss is not finite is left out by Method.clipped_sum
        (runner/methods/dropped.py), not multiplied by nu = 0 (0 * inf = nan for everyone)."""
        return True

    def mechanism(self, sample_rate: float) -> Mechanism:
        return SubsampledJL(sample_rate=float(sample_rate), noise_multiplier=self.sigma, r=self.r)

    def projections(self, model, loss_fn, x, y, directions: Directions):
        """losses, outputs, P (B, r), backward(nu); under jvp=auto the first unsupported operator switches to
        double_vjp for good (logged once). Out of memory with several directions per pass: halve method.chunk
        (logged) and retry with the same directions and RNG state, down to one direction per pass, whose memory
        is a forward with its graph plus one tangent: JL(r) then fits where non-private nearly fits, at any r."""
        while True:
            state = rng_state(x.device)
            try:
                return self._projections(model, loss_fn, x, y, directions)
            except torch.OutOfMemoryError:
                r = next(iter(directions.values())).shape[0]
                per_pass = self.chunk if 0 < self.chunk < r else r
                if per_pass <= 1:
                    raise
                self.chunk = per_pass // 2
                log.warning("method=jl: out of memory with %d directions per pass; using method.chunk=%d from now "
                            "on", per_pass, self.chunk)
                if x.device.type == "cuda":
                    torch.cuda.empty_cache()
                set_rng_state(state, x.device)

    def _projections(self, model, loss_fn, x, y, directions: Directions):
        if self.mode == "auto" and self.active == "forward":
            try:
                return forward_projections(model, loss_fn, x, y, directions, self.chunk)
            except torch.OutOfMemoryError:
                raise
            except (NotImplementedError, RuntimeError) as e:
                log.warning("method=jl: forward-mode AD failed (%s); using method.jvp=double_vjp from now on",
                            first_line(e))
                self.active = "double_vjp"
                model.to(memory_format=torch.contiguous_format)  # vmap needs NCHW weights (channels_last above)
        try:
            return PROJECTORS[self.active](model, loss_fn, x, y, directions, self.chunk)
        except RuntimeError as e:  # NotImplementedError too: an operator without a forward-mode formula (forward)
            if not isinstance(e, NotImplementedError) and "not implemented" not in str(e):  # or a double backward
                raise
            other = "method.jvp=double_vjp, " if self.active == "forward" else ""
            raise DprunError(f"method=jl with method.jvp={self.active} cannot differentiate this model "
                             f"({first_line(e)}); use {other}method=multiloss or nxbp") from None

    def privatize(self, model, loss_fn, x, y) -> Privatized:
        params = trainable_params(model)
        directions = getattr(self, "_directions", None)  # name -> (r, *p.shape): the step's (begin_step)
        if directions is None:  # privatize called on its own: this call's draw
            directions = draw_directions(params, self.r, padding_rows(model), self.direction_generator)
        losses, outputs, P, backward = self.projections(model, loss_fn, x, y, directions)
        norms = P.pow(2).mean(1).sqrt()  # (B,) M_i, the norm estimates
        nu = self.clip_factors(norms)  # (B,)
        grads = backward(nu)  # sum_i nu_i g_i, one backward
        consistent = release_agrees(grads, directions, P, nu, norms, self.clip)
        for n, p in params.items():
            g = grads[n].detach()
            p.grad = g if p.grad is None else p.grad + g
        return Privatized(losses, outputs, norms, consistent)

