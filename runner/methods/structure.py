"""Whether a model changed since the method validated it: a module inserted or swapped (a BatchNorm, a layer that
mixes the batch), a hook added, a forward replaced, or a parameter unfrozen (a tied embedding frozen on the first
step, then trained: reweight twopass released 1.24 C), after attach and the first step's check would otherwise
train unchecked.

    structure = Structure(model, trainable(model))   # at attach
    if structure.changed(model, params): ...         # each step: validate again, and check this step again
    structure.accept(model, params)                  # once validated

The model is walked every step (~13-15 us on the bench's CNN and transformer, against ~12-23 us for the
trainable-parameter walk a step already makes): torch's module-registration hook does not see
`Sequential.insert`, `ModuleList.insert` or `model._modules[k] = m` (they write the dict directly), and one such
parameter-free layer released 2.8-3.8 C (stop 55's review).
"""
from __future__ import annotations

from torch import nn
from torch.nn.modules import module as torch_module

_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def layout(model: nn.Module) -> tuple:
    """Each module once (preorder) by identity and type, with its hook counts and any forward set on the instance,
    and the global hooks' counts: what decides the function the model computes, apart from its tensors' values."""
    out = [tuple(len(getattr(torch_module, name, ())) for name in _GLOBAL_HOOKS)]
    stack, seen = [model], set()
    while stack:
        m = stack.pop()
        if m is None or id(m) in seen:
            continue
        seen.add(id(m))
        d = m.__dict__
        out.append((id(m), type(m), len(d.get("_forward_hooks", ())), len(d.get("_forward_pre_hooks", ())),
                    len(d.get("_backward_hooks", ())), len(d.get("_backward_pre_hooks", ())), id(d.get("forward"))))
        stack.extend(d.get("_modules", {}).values())
    return tuple(out)


class Structure:
    def __init__(self, model: nn.Module, params: list):
        self.accept(model, params)

    def changed(self, model: nn.Module, params: list) -> bool:
        """True while the model's layout or its trainable parameters (`params`, this step's walk: requires_grad
        toggled, a parameter replaced) differ from those accepted last (so a refused change stays refused)."""
        if len(params) != len(self.params) or any(id(p) != i for p, i in zip(params, self.params)):
            return True
        return layout(model) != self.modules

    def accept(self, model: nn.Module, params: list) -> None:
        """The model as it is now was validated."""
        self.modules = layout(model)
        self.params = [id(p) for p in params]
