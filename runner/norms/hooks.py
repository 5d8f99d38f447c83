"""Record every call of the covered modules in one forward pass, then their output-gradients in one backward.

    with Recorder(plan) as rec:
        losses = loss_fn(model(x), y)                       # forward hooks keep each call's input and output
    rec.backprops(losses.sum(), retain_graph=False)         # d(sum_i loss_i)/d(output) of every call, in call order
    for path, module, rule, a, g in rec.layers():           # calls concatenated along T: (B, T, ...)
        ...

The gradients are taken w.r.t. the recorded output tensors with torch.autograd.grad, so (1) no parameter
gradient is computed in this backward, (2) each call's gradient lands at its own index, whatever order the
backward visits the calls in (reverse call order for a recurrent cell), and (3) because the loss is a sum of
per-example losses, row i of every output-gradient belongs to example i alone. A call whose input or output
was later modified in place (e.g. nn.ReLU(inplace=True) on a Linear's output) would give a wrong gradient:
that raises DprunError instead.

Memory: backprops drops the recorded outputs (only their gradients are needed); `raw_layers()` gives the
recorded (input, output-gradient) pairs without any rule-specific copy (a conv's unfolded input), and
`release(module)` frees a module's records as soon as its contribution has been used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runner.errors import DprunError
from runner.norms.coverage import Plan
from runner.norms import tensor_cores
from runner.norms.tensor_cores import records


@dataclass
class Call:
    inp: torch.Tensor  # detached input (shares the version counter with the original)
    out: torch.Tensor | None  # the output, still in the graph (None after backprops)
    versions: tuple[int, int] | None  # None: recorded while compiling (no check)
    grad: torch.Tensor | None = None
    modified: bool = False  # set by backprops, which then drops `out` (memory)


def plain(t):
    """t as a plain torch.Tensor (a view, no copy) where it is a subclass: the rules' norms and sums on a recorded
    input or output-gradient run torch's own code, not the subclass's __torch_function__ (review 29: an input whose
    class answered vector_norm with zeros left a layer out of the norm, 2828 C in every mode). A subclass torch.compile
    traces with (its fake tensors) is left to it."""
    if type(t) is torch.Tensor or not isinstance(t, torch.Tensor) or torch.compiler.is_compiling():
        return t
    return t.as_subclass(torch.Tensor)


_OPEN: list = []  # the open CallHooks, innermost last: where the installed hooks (install_call_hooks) send calls
INSTALLED = "_dprun_call_hook"  # a module attribute: True once install_call_hooks gave the module its hook


def install_call_hooks(plan: Plan) -> None:
    """A forward hook on each covered module, kept, that passes its calls to the open CallHooks (none open: it does
    nothing). A CallHooks then registers no hook of its own on these modules when it opens: registering one inside
    torch.compile's traced step is a graph break that makes Dynamo run the whole book-keeping frame eagerly, its
    forward cut into a graph per layer (runner/methods/compiled.py), and per step it is ~2 Python calls a module
    fewer in eager. A deep copy of the module keeps the hook and the mark."""
    for _, module, _ in plan.layers:
        if not getattr(module, INSTALLED, False):
            module.register_forward_hook(_to_open_hooks, with_kwargs=True)
            setattr(module, INSTALLED, True)


def _to_open_hooks(module, args, kwargs, out):
    for hooks in _OPEN:  # every open CallHooks that covers the module, as when each registered its own hook
        if id(module) in hooks.covered:
            hooks._hook(module, args, kwargs, out)


class CallHooks:
    """While open (`with`), on_call(module, input, output) runs after every call of a covered module of the plan;
    Recorder and StreamingNorms (streaming.py) are its two uses. A module with an installed hook
    (install_call_hooks) sends its calls here; the others get a hook while this is open."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.covered = frozenset(id(m) for _, m, _ in plan.layers)
        self.handles: list = []
        # bf16 on the tensor-core route or not, decided once for the step (runner/norms/tensor_cores.py): a layer's
        # norm and its clipped sum are formed from the same records even if a graph break splits a compiled step
        self.tensor_cores = tensor_cores.enabled()

    def __enter__(self):
        for _, module, _ in self.plan.layers:
            if not getattr(module, INSTALLED, False):
                self.handles.append(module.register_forward_hook(self._hook, with_kwargs=True))
        _OPEN.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _OPEN.remove(self)
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _hook(self, module, args, kwargs, out):
        self.on_call(module, plain(args[0] if args else next(iter(kwargs.values()))), out)

    def on_call(self, module: torch.nn.Module, inp: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError


class Recorder(CallHooks):
    def __init__(self, plan: Plan):
        super().__init__(plan)
        self.calls: dict[int, list[Call]] = {id(m): [] for _, m, _ in plan.layers}

    def on_call(self, module, inp, out):
        # inside torch.compile the version counters are the tracer's, not the run's: no check there (the compiled
        # step's first step runs eager and makes it, runner/methods/compiled.py)
        versions = None if torch.compiler.is_compiling() else (inp._version, out._version)
        self.calls[id(module)].append(Call(inp.detach(), out, versions))

    def backprops(self, loss: torch.Tensor, retain_graph: bool) -> None:
        calls = [c for cs in self.calls.values() for c in cs if c.out.requires_grad]
        if calls:  # else no covered layer reached the loss: every output-gradient is zero
            grads = torch.autograd.grad(loss, [c.out for c in calls], allow_unused=True, retain_graph=retain_graph)
            for c, g in zip(calls, grads):
                c.grad = plain(g)
        for cs in self.calls.values():  # memory: check in-place use now and drop the outputs (only grads are needed)
            for c in cs:
                c.modified = c.versions is not None and (c.inp._version, c.out._version) != c.versions
                if c.grad is None:
                    c.grad = torch.zeros_like(c.out)
                c.out = None

    def release(self, module) -> None:
        """Free a module's recorded inputs and output-gradients once its contribution has been used."""
        self.calls[id(module)] = []

    def raw_layers(self):
        """(path, module, rule, [(input, output-gradient) per call]) per covered module that was called."""
        for path, module, rule in self.plan.layers:
            calls = self.calls[id(module)]
            if calls:
                for c in calls:
                    self._check(path, module, c)
                # bf16: the norm (layers()) and the clipped sum are formed from the same float32 upcasts
                route = rule.tensor_cores and self.tensor_cores
                yield path, module, rule, [records(c.inp, c.grad, route) for c in calls]
            del calls

    @staticmethod
    def _check(path, module, c) -> None:
        modified = c.modified if c.out is None else (
            c.versions is not None and (c.inp._version, c.out._version) != c.versions)
        if modified:
            raise DprunError(f"{path} ({type(module).__name__}): its input or output was modified in place "
                             f"after the call, so its recorded gradient is wrong; use inplace=False "
                             f"(e.g. nn.ReLU(inplace=False)) after this layer")

    def layers(self):
        """(path, module, rule, a, g) per covered module that was called; a, g concatenated over calls (dim 1)."""
        for path, module, rule in self.plan.layers:
            calls = self.calls[id(module)]
            if not calls:
                continue
            parts = []
            for c in calls:
                self._check(path, module, c)
                grad = c.grad if c.grad is not None else torch.zeros_like(c.out)
                parts.append(rule.sequence(module, *records(c.inp, grad, rule.tensor_cores and self.tensor_cores)))
            a = torch.cat([p[0] for p in parts], 1) if len(parts) > 1 else parts[0][0]
            g = torch.cat([p[1] for p in parts], 1) if len(parts) > 1 else parts[0][1]
            yield path, module, rule, a, g
            del a, g, parts  # memory: this layer's (a, g) must not outlive the caller's use of them
