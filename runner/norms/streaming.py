"""Per-example squared gradient norms computed DURING the backward, one layer at a time (memory-lean two-pass).

    with StreamingNorms(plan, how="auto") as sn:
        losses = loss_fn(model(x), y)            # (B,); forward hooks keep each call's input, hook its output
    norms_sq = sn.backward(losses.sum())         # (B,); the graph is kept for the second backward

Recorder (hooks.py) keeps every layer's output-gradient until the backward has finished, i.e. a second copy of
the activations next to the saved ones: ReweightGP's twopass peaked at 2.3x the non-private step on ResNet-18.
Here a tensor hook on each call's output receives the output-gradient as the backward reaches the layer; once
all of a module's calls have theirs, the rule's norm is formed and the gradients are dropped, so at any time
only one layer's output-gradient and its norm transients are alive on top of what the non-private backward holds.
The norm transients (a conv's unfolded input, ghost Gram matrices, a direct per-example gradient) are bounded
too: the batch is cut into chunks whose transients are no larger than the layer's own input and output-gradient.
Per-example norms are independent across examples, so chunking is exact.

The backward asks for the gradients of the "source" calls' OUTPUTS only (gradient edges: torch.autograd.graph):
the calls on an input that needs no gradient (the first layer of a chain: the data, token ids, a recurrent cell's
zero initial state). When every input needs no gradient but its own layers' parameters, each covered call lies on a
path from the loss to a source output and its hook fires; no weight gradient at all is computed (asking for the
source layers' parameters, as before, computed a recurrent cell's whole weight gradient: issue 31). Any call still waiting afterwards (input data that requires grad, an
unused output) gets a second pass that asks for its own layer's parameters, so a norm is never left at zero.

A hook registered before an in-place change of the output (nn.ReLU(inplace=True) after a Linear) still gets the
gradient of the value the layer produced (PyTorch's tensor-hook semantics), so only an in-place change of a
recorded INPUT is refused (it would make the recorded input wrong), as in Recorder. Where the output is an autograd
view (a Linear on a sequence), the hook and the edge sit on the product under it (`carrier`): an in-place op on a
view moves the view itself onto a new node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from runner.errors import DprunError
from runner.norms.base import added
from runner.norms.certify import exact_float32
from runner.norms.coverage import Plan
from runner.norms.hooks import CallHooks, plain


TRANSIENT_BUDGET = 1.0  # a chunk's norm transients: at most this fraction of the layer's input + output-gradient
# ... or up to this many bytes: below it chunks save too little memory to pay for their kernels (L&K's fig. 6 CNN at
# B=16 cut its conv norms into 6 chunks of 3 examples, ~1 MB saved for 5 more rounds of ~20 small kernels each)
TRANSIENT_FLOOR_BYTES = 2**20
# book-keeping's lean recorder (lean.py): modules called once get no tensor hook, in call order, while their outputs
# add up to at most this many bytes; the backward returns their output-gradients with the sources' (autograd.grad on
# each output's gradient edge) and their norms are formed after it. Small layers pay for a hook more than they save:
# L&K's fig. 6 CNN at B=16 ran its bk step at 1.41x the non-private step with a hook per layer, 1.31x without (one
# process, interleaved; issue 26's budget). The cost in memory: these output-gradients wait for the backward's end,
# at most this many bytes in all, and so do their norms' transients (a module called again, a recurrent cell, is
# hooked after all: its norm waiting for the end met every other layer's records there, +9 MB on the LSTM at B=128).
# twopass/recompute keep a hook per call (0): their point is one layer's output-gradient at a time (capture gave
# them 1-4% on fig. 6 for +20% memory)
CAPTURE_BYTES = 2**21


def carrier(out: torch.Tensor) -> torch.Tensor:
    """The tensor whose gradient edge (or hook) gets a call's output-gradient: `out` itself, or, where `out` is an
    autograd view that only reshapes a product (a Linear on a sequence returns its (B*T, o) product viewed as
    (B, T, o)), that product. An in-place op on such a view (nn.ReLU(inplace=True) after the Linear) moves the view
    onto a new node, and the old view node's edge and hooks then get no gradient at all: the layer's gradient was
    silently zero (review 33). The product's own node still gets the gradient of the value the layer produced, the
    same values (the view's backward only reshapes it); _on_grad reshapes it back."""
    base = out._base
    if (base is not None and base._base is None and base.requires_grad and base.numel() == out.numel()
            and base.is_contiguous() and out.is_contiguous()):
        return base
    return out


@dataclass
class Pending:
    """One module's calls in this step: the recorded inputs, the output-gradients received so far."""
    inputs: list = field(default_factory=list)  # detached inputs, one per call
    versions: list = field(default_factory=list)  # the inputs' version counters at the call (None when compiling)
    shapes: list = field(default_factory=list)  # (shape, dtype, device) of each output, to zero-fill unused calls
    grads: list = field(default_factory=list)  # output-gradient per call, None until its hook fires
    waiting: int = 0  # calls whose output-gradient has not arrived
    edges: list = field(default_factory=list)  # each call's output as a gradient edge (None: no gradient); remember


class StreamingNorms(CallHooks):
    def __init__(self, plan: Plan, how: str = "auto", capture_bytes: int = 0, remember: str = ""):
        super().__init__(plan)
        self.how = how
        # for the pass that forms the clipped sums (runner/norms/released.py): remember "terms" (recompute: its second
        # forward records the calls again), each module's (B,) certified squared norms and the backward's targets;
        # "calls" (twopass: through this graph), also each module's calls (inputs, output edges)
        if remember not in ("", "terms", "calls"):
            raise ValueError(f"StreamingNorms remember={remember!r}: '', terms or calls")
        self.remember = remember
        self.remembered: dict[int, Pending] = {}
        self.layer_terms: dict[int, torch.Tensor] = {}  # id(module) -> its (B,) term (remember)
        self.targets: list[list] = []  # each autograd.grad call's targets, in order (remember)
        self.capture_bytes = capture_bytes  # modules called once, outputs up to this in all: no hook (CAPTURE_BYTES)
        # calls without a hook: (module key, call index, output's gradient edge, its bytes, (output, its version))
        self.captured: list = []
        self.captured_bytes = 0  # their outputs' bytes: at most capture_bytes in all
        self.rules = {id(m): (path, m, rule) for path, m, rule in plan.layers}
        self.pending: dict[int, Pending] = {}
        # where the backward may stop: the output of each call on an input that needs no gradient (the first layer
        # of a chain: the data, token ids, a recurrent cell's zero initial state), as a gradient edge (the graph
        # node, not the tensor: the output itself is not kept)
        self.sources: list = []
        self.tensor_hooks: list = []  # on the recorded outputs; removed after the first backward
        self.terms: list[torch.Tensor] = []  # each module's (B,) certified squared norms, summed once at the end
        self.complete = True  # False when a call waited for its output-gradient after a graph-freeing backward
        self.layers = 0  # modules whose squared norms are in `terms`

    def on_call(self, module, inp, out):
        p = self.pending.setdefault(id(module), Pending())
        p.inputs.append(inp.detach())
        p.versions.append(None if torch.compiler.is_compiling() else inp._version)
        p.shapes.append((out.shape, out.dtype, out.device))
        p.grads.append(None)
        node = carrier(out)  # what carries the output's gradient (a Linear's product under its (B, T, o) view)
        if self.remember == "calls":
            p.edges.append(torch.autograd.graph.get_gradient_edge(node) if out.requires_grad else None)
        if not inp.requires_grad and out.requires_grad:
            self.sources.append(torch.autograd.graph.get_gradient_edge(node))
        if out.requires_grad:
            p.waiting += 1
            index = len(p.grads) - 1
            nbytes = out.numel() * out.element_size()
            if index == 1:  # called again (a recurrent cell): every call of it hooked
                self._hook_captured_call(id(module))
            first = index == 0 and not torch.compiler.is_compiling()
            deferred = first and self.defers(module, inp, out)  # its norm after the backward (lean.py: defer)
            if first and (deferred or self.captured_bytes + nbytes <= self.capture_bytes):
                # the edge, not the tensor: the output is not kept, and an in-place change after the call (ReLU
                # inplace) does not move it (the gradient is the layer's output's, as a tensor hook's)
                # (a small output itself is held until the forward ends, at most capture_bytes: _hook_captured_call;
                # a deferred one's is not: it stays captured even if called again)
                held = None if deferred else (node, node._version)
                self.captured.append((id(module), index, torch.autograd.graph.get_gradient_edge(node),
                                      0 if deferred else nbytes, held))
                self.captured_bytes += 0 if deferred else nbytes
            else:
                self.tensor_hooks.append(node.register_hook(partial(self._on_grad, id(module), index)))

    def defers(self, module, inp: torch.Tensor, out: torch.Tensor) -> bool:
        """Should this call's norm wait for the backward's end (captured by its gradient edge, no hook, whatever its
        size)? Never here; book-keeping's lean recorder defers the layers whose records it keeps anyway (lean.py)."""
        return False

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self.captured = [c[:4] + (None,) for c in self.captured]  # the forward is over: no output kept

    def _hook_captured_call(self, key: int) -> None:
        """A module called a second time: its first call, if captured, gets the tensor hook after all, so that the
        module's norm is still formed inside the backward, where its transients do not meet every other layer's
        records (a recurrent cell's 28 calls: +9 MB on the LSTM at B=128 when its norm waited for the backward's
        end). An output changed in place since its call stays captured (a hook now would get the changed value's
        gradient): exact, its norm formed after the backward."""
        at = next((i for i, c in enumerate(self.captured) if c[0] == key), None)
        if at is None or self.captured[at][4] is None:  # not captured, or deferred (no output held): as it is
            return
        out, version = self.captured[at][4]
        if out._version != version:  # (the forward is still on: the output is held)
            return
        key, index, _, nbytes, _ = self.captured.pop(at)
        self.captured_bytes -= nbytes
        self.tensor_hooks.append(out.register_hook(partial(self._on_grad, key, index)))

    def _on_grad(self, key: int, index: int, grad: torch.Tensor) -> None:
        p = self.pending.get(key)
        if p is None or p.grads[index] is not None:  # the norms are done, or this call's gradient arrived already: a
            return  # later backward over the same graph fires the hook again (review 29: the count went wrong)
        shape, dtype, device = p.shapes[index]
        if grad is None:  # _grad's: the call's output does not reach the loss (unused, or only through argmax)
            grad = torch.zeros(shape, dtype=dtype, device=device)  # review 44: grad.shape on None crashed the step
        grad = plain(grad)
        p.grads[index] = grad if grad.shape == shape else grad.reshape(shape)  # a carrier's (B*T, o): carrier()
        p.waiting -= 1
        if p.waiting == 0:  # every call of the module has its output-gradient: its norm, then free them
            self._add(key)

    def _calls(self, key: int) -> tuple[str, torch.nn.Module, object, list, list]:
        """A module whose calls all have their output-gradients (or never will): (path, module, rule, inputs,
        output-gradients), its pending record removed; an input modified in place since its call is refused."""
        path, module, rule = self.rules[key]
        p = self.pending.pop(key)
        for inp, version in zip(p.inputs, p.versions):
            if version is not None and inp._version != version:
                raise DprunError(f"{path} ({type(module).__name__}): its input was modified in place after the "
                                 f"call, so its recorded input is wrong; use inplace=False before this layer")
        grads = [g if g is not None else torch.zeros(shape, dtype=dt, device=dev)  # an unused call: zero
                 for g, (shape, dt, dev) in zip(p.grads, p.shapes)]
        if self.remember == "calls":
            self.remembered[key] = Pending(p.inputs, p.versions, p.shapes, [None] * len(p.grads), 0, p.edges)
        return path, module, rule, p.inputs, grads

    def _add(self, key: int) -> None:
        path, module, rule, inputs, grads = self._calls(key)
        term = self.layer_norm_sq(module, rule, inputs, grads)
        if self.remember:
            self.layer_terms[key] = term
        self._accumulate(term)

    def layer_norm_sq(self, module, rule, inputs: list, grads: list) -> torch.Tensor:
        """(B,) certified squared norms of one module's per-example gradient from its calls' records, in batch chunks
        whose transients stay within the layer's own records (chunk_size)."""
        B = inputs[0].shape[0]
        chunk = chunk_size(rule, module, inputs, grads)
        parts = []
        for start in range(0, B, chunk):
            rows = slice(start, start + chunk)
            seq = [rule.sequence(module, inp[rows], g[rows]) for inp, g in zip(inputs, grads)]
            a = torch.cat([s[0] for s in seq], 1) if len(seq) > 1 else seq[0][0]
            g = torch.cat([s[1] for s in seq], 1) if len(seq) > 1 else seq[0][1]
            with exact_float32(g.device):
                parts.append(rule.norm_sq(module, a, g, self.how).detach())  # (chunk,) certified upper bounds
            del seq, a, g
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _accumulate(self, contribution: torch.Tensor) -> None:
        """Add one module's (B,) certified squared norms; `layers` counts the terms (certified_norms' rounding)."""
        self.terms.append(contribution)
        self.layers += 1

    def backward(self, loss: torch.Tensor, batch_size: int, keep_graph: bool = True) -> torch.Tensor | None:
        """Run the first backward and return the (B,) per-example squared norms (certified upper bounds). keep_graph=False (ReweightGP's
        recompute mode) frees each saved activation as the backward passes it, as a non-private backward does, and
        asks for the source calls' outputs only; when a call is still waiting afterwards the graph is gone, so
        `complete` is False and the caller runs the forward again and calls backward_all."""
        if loss.requires_grad:  # every covered call between the loss and a source: no weight gradient
            self._grad(loss, self.sources, keep_graph)
        self.sources = []
        waiting = [self.rules[k][1] for k, p in self.pending.items() if p.waiting]
        if not keep_graph and loss.requires_grad and waiting:
            self.complete = False  # the graph is gone: the caller starts again with backward_all
            self._remove_hooks()
            self.pending.clear()
            return None
        if loss.requires_grad and waiting:
            # A call the source pass did not reach: an unused output, or a layer whose only gradient-carrying
            # ancestor is not a source (input data that requires grad, e.g. in a user's loop). Ask for the waiting
            # layers' own parameters: every covered call whose output reaches the loss lies on a path to them, so
            # no norm is ever silently left at zero (which would skip clipping). Layers done already ignore it.
            params = [p for m in waiting for p in m.parameters(recurse=False) if p.requires_grad]
            if params:
                if self.remember:
                    self.targets.append(params)
                torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        return self._finish(batch_size, loss)

    def backward_all(self, loss: torch.Tensor, batch_size: int) -> torch.Tensor:
        """One backward (graph freed as it goes) that asks for every covered layer's parameters: every call whose
        output reaches the loss gets its output-gradient, at the cost of computing every weight gradient."""
        params = [p for _, m, _ in self.plan.layers for p in m.parameters(recurse=False) if p.requires_grad]
        if loss.requires_grad:
            self._grad(loss, params, keep_graph=False)
        return self._finish(batch_size, loss)

    def _grad(self, loss: torch.Tensor, targets: list, keep_graph: bool) -> None:
        """One backward asking for `targets` (gradient edges or parameters) and the captured calls' outputs, whose
        gradients it hands to _on_grad (None: the output does not reach the loss, a zero gradient)."""
        captured, self.captured = [(key, index, edge) for key, index, edge, _, _ in self.captured], []  # outputs freed
        if not targets and not captured:
            return
        if self.remember:
            self.targets.append(list(targets) + [edge for _, _, edge in captured])
        grads = list(torch.autograd.grad(loss, list(targets) + [edge for _, _, edge in captured],
                                         retain_graph=keep_graph, allow_unused=True))[len(targets):]
        # last call first, as the backward meets them (method.keep_mb's first step ranks layers in that order); each
        # output-gradient handed over and dropped here, so a layer whose norm keeps a stash frees it at once (not
        # when the last deferred norm is formed: book-keeping's defer=all held every one, 114 against 93 MB)
        for j in reversed(range(len(captured))):
            key, index, _ = captured[j]
            grad, grads[j] = grads[j], None
            self._on_grad(key, index, grad)
            del grad

    def _remove_hooks(self) -> None:
        for h in self.tensor_hooks:
            h.remove()
        self.tensor_hooks.clear()

    def _finish(self, batch_size: int, loss: torch.Tensor) -> torch.Tensor:
        self._remove_hooks()
        for key in list(self.pending):  # calls whose output never reached the loss: a zero gradient
            self._add(key)
        return summed_terms(self.terms, loss.new_zeros(batch_size).detach())


def summed_terms(terms: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """(B,) the layers' certified squared norms added: one stack and one sum (two kernels, not one add per layer: a
    GPU step of ResNet-18 has 41 such layers and is launch-bound); non-negative terms in any order, which
    certified_norms' gamma_{layers} covers. `empty` when no layer was reached."""
    if not terms:
        return empty
    if len(terms) == 1:
        return terms[0]
    if len({t.dtype for t in terms}) > 1:  # mixed precisions: added pairwise, promoted as before
        return added(terms)
    return torch.stack(terms).sum(0)


def chunk_size(rule, module, inputs: list, grads: list, floor_bytes: int | None = None,
               budget: float = TRANSIENT_BUDGET) -> int:
    """Examples per chunk so that one chunk's norm transients are at most `budget` times the layer's own recorded
    input and output-gradient (all calls), or floor_bytes (default TRANSIENT_FLOOR_BYTES) if more; the whole batch
    when they already fit."""
    floor_bytes = TRANSIENT_FLOOR_BYTES if floor_bytes is None else floor_bytes
    B = inputs[0].shape[0]
    own = sum(t[0].numel() for t in inputs) + sum(g[0].numel() for g in grads)  # per example
    transient = 0
    for inp, g in zip(inputs, grads):  # one example through `sequence`: the shapes of (a, g)
        a1, g1 = rule.sequence(module, inp[:1], g[:1])
        T = a1.shape[1] if a1.dim() > 1 else 1
        k, o = a1.numel() // T, g1.numel() // T
        transient += a1.numel() + g1.numel() + min(2 * T * T, o * k)  # (a, g), then a Gram or a per-example grad
    budget = max(own * budget, floor_bytes / inputs[0].element_size() / B)  # elements per example
    if transient <= budget:
        return B
    return max(1, int(B * budget // transient))
