"""The clipped sums of twopass and recompute: formed from the output-gradients whose norms were taken.

twopass and recompute measure each example's norm in a first backward that keeps one layer's output-gradient at a
time (streaming.py). They used to release a second backward of sum_i nu_i loss_i. That backward is another
computation: its output-gradients round differently from the first's, and where a layer's backward cancels, the
difference is far above the rounding the norm's certificate covers. Review 25 measured 17.6 C from one example
through a GroupNorm (torch's CPU kernel forms dgamma = (sum g x - mean sum g) rstd, which cancels at a large mean)
and 2.7 C through the conv below one (a constant image: the GroupNorm's input-gradient sums to rounding noise, which
the conv's weight gradient multiplies by the pixel value).

So the second pass repeats the FIRST backward, unweighted (sum_i loss_i, the same targets, the same graph or the same
forward replayed), and each layer's clipped sum is formed from the records it delivers (inputs, output-gradients),
with the first pass's clip factors, by the rule's own clipped_sums: book-keeping's sums, one layer at a time. The
same records' certified per-example squared norms are formed again and must be at most the first pass's, layer by
layer, for every example kept (one read a step): then each example's released contribution, nu_i times the exact
norm of what is summed for it, is at most C, as book-keeping's. On a deterministic backend the two passes' records
are equal bit for bit. Where they are not (a backward or a forward that changes between the passes: a user's
autograd.Function counting its calls, a forward drawing from its own generator under recompute, a user's gradient hook
read before it in the first pass and after it in the second), the chunk says so (agrees(), Privatized.consistent) and
is formed again without the records whose release alone disagrees, each left out as a record that is not finite is
(runner/methods/dropped.py); a chunk that still disagrees is refused in one line. Ending the run at once instead let
one record's presence decide the run's outcome (review 29). A fingerprint of the
output-gradients (their sum and sum of squares) was the check at first: review 27 got a permutation of +-1 values
past it (1414 C), an input changed by the second forward (8602 C; 2.08 C from an honest model's own noise
generator) and a hook read at two points (1414 C).

    with StreamingNorms(plan, how, remember="calls") as first:   # twopass: the graph kept
        losses = loss_fn(model(x), y)
    nu = clip_factors(certified_norms(first.backward(losses.sum(), B), first.layers))
    sums = ReleasedSums.through_graph(first, nu).run(losses.sum(), B)   # {id(parameter): clipped sum}
"""
from __future__ import annotations

from functools import partial

import torch

from runner.errors import DprunError
from runner.norms.certify import exact_float32
from runner.norms.streaming import Pending, StreamingNorms


class ReleasedSums(StreamingNorms):
    """A second pass through the first's output-gradients: each module's clipped sum as its calls' gradients arrive
    (the records freed at once, as the first pass's norms freed them)."""

    def __init__(self, plan, nu: torch.Tensor, first: StreamingNorms):
        super().__init__(plan, first.how)
        self.nu = nu  # (B,) the first pass's clip factors
        self.first = first  # its per-layer terms and backward targets
        self.sums: dict[int, torch.Tensor] = {}  # id(parameter) -> its clipped sum
        self.node_hooks: list = []
        self.edge_calls: dict[tuple, tuple] = {}  # (id(node), output_nr) -> (module key, call index)
        self.agreed: list[tuple[str, torch.Tensor]] = []  # (module path, 0-dim bool: its norms are within the first's)

    @classmethod
    def through_graph(cls, first: StreamingNorms, nu: torch.Tensor) -> "ReleasedSums":
        """twopass: the first pass's graph is kept; its calls' records are taken over and each call's output is
        reached by a hook on the graph node that made it (the output tensor itself was not kept)."""
        self = cls(first.plan, nu, first)
        for key, p in first.remembered.items():
            self.pending[key] = Pending(p.inputs, p.versions, p.shapes, [None] * len(p.shapes), 0, p.edges)
            for index, edge in enumerate(p.edges):
                if edge is not None:
                    self.pending[key].waiting += 1
                    self.edge_calls[(id(edge.node), edge.output_nr)] = (key, index)
                    self.node_hooks.append(edge.node.register_prehook(
                        partial(self._on_node, key, index, edge.output_nr)))
        first.remembered = {}
        return self

    def _on_node(self, key: int, index: int, output_nr: int, grad_outputs):
        # the gradient of the node's output `output_nr`: the layer's own output, before any in-place change after it
        # (a tensor hook's semantics); None where that output got no gradient (zeros, as the first pass had)
        p = self.pending.get(key)
        if p is not None and p.grads[index] is None:
            grad = grad_outputs[output_nr]
            if grad is None:
                shape, dtype, device = p.shapes[index]
                grad = torch.zeros(shape, dtype=dtype, device=device)
            self._on_grad(key, index, grad)
        return None

    def run(self, loss: torch.Tensor, batch_size: int, graph_kept: bool, ask_all: bool = False) -> dict:
        """The first pass's backward again, unweighted: through its kept graph (graph_kept: twopass; the same
        targets in the same order), or through a second forward's graph, whose calls this recorded (recompute:
        the source calls' outputs, or every covered layer's parameters where the first pass asked for them).
        Returns {id(parameter): clipped sum}."""
        try:
            if graph_kept:
                targets = self.first.targets
                for i, wanted in enumerate(targets if loss.requires_grad else []):
                    grads = torch.autograd.grad(loss, wanted, retain_graph=i < len(targets) - 1, allow_unused=True)
                    self._targets_reached(wanted, grads)
                self._finish(batch_size, loss)
            elif ask_all:
                self.backward_all(loss, batch_size)
            elif self.backward(loss, batch_size, keep_graph=False) is None:
                raise DprunError("method.mode=recompute: the second forward reached layers the first did not; its "
                                 "clipped sums cannot be formed from the certified output-gradients")
        finally:
            for h in self.node_hooks:
                h.remove()
            self.node_hooks.clear()
        return self.sums

    def agrees(self) -> torch.Tensor:
        """0-dim bool: every layer's certified norms of what it summed were at most the first pass's, for every example
        kept (read once by the caller)."""
        flags = [flag for _, flag in self.agreed]
        return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool)

    def _targets_reached(self, wanted: list, grads) -> None:
        """A call whose output is itself a target of the backward (a source: the first layer of a chain) gets its
        gradient as autograd's return value, not through its node, which the backward stops at."""
        for target, grad in zip(wanted, grads):
            if isinstance(target, torch.Tensor):
                continue
            call = self.edge_calls.get((id(target.node), target.output_nr))
            if call is not None:
                self._on_node(call[0], call[1], 0, (grad,))

    def _add(self, key: int) -> None:
        path, module, rule, inputs, grads = self._calls(key)
        measured = self.first.layer_terms.get(key)  # (B,) the first pass's certified squared norms of this layer
        again = self.layer_norm_sq(module, rule, inputs, grads)  # (B,) the same of the records summed below
        if measured is None or measured.shape != again.shape:
            agrees = torch.zeros((), dtype=torch.bool, device=again.device)
        else:  # an example left out (nu = 0: not finite) has its rows masked in the sums; no value read here
            agrees = ((again <= measured) | (self.nu <= 0)).all()
        self.agreed.append((f"{path} ({type(module).__name__})", agrees))
        with exact_float32(again.device), torch.no_grad():
            sums = rule.clipped_sums_calls(module, list(zip(inputs, grads)), self.nu, None)
        for name, s in sums.items():
            self.sums[id(getattr(module, name))] = s
