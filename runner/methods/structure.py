"""Whether a model's modules or trainable parameters changed since the method validated it: a BatchNorm inserted, a
layer swapped for a batch-coupling one, or a parameter unfrozen (a tied embedding frozen on the first step, then
trained: reweight twopass released 1.24 C) after attach and the first step's check would otherwise train unchecked.

    structure = Structure(model, trainable(model))   # at attach
    if structure.changed(model, params): ...         # each step: validate again and check the next step again

torch calls a global hook whenever any module anywhere registers a submodule (Module.__setattr__, add_module,
register_module). Counting those calls makes the per-step test one integer comparison; the model is walked only
when some module registered one since the last look (a new model built, a layer inserted).
"""
from __future__ import annotations

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

_registrations = 0  # submodule registrations seen in this process, by any module


def _count(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    global _registrations
    _registrations += 1


register_module_module_registration_hook(_count)


def layout(model: nn.Module) -> tuple:
    """Each module once, in order, by identity and type (a module freed and another built at its address differ
    in type where it matters)."""
    return tuple((id(m), type(m)) for m in model.modules())


class Structure:
    def __init__(self, model: nn.Module, params: list):
        self.accept(model, params)

    def changed(self, model: nn.Module, params: list) -> bool:
        """True while the model's modules or its trainable parameters (`params`, this step's walk: requires_grad
        toggled, a parameter replaced) differ from those accepted last (so a refused change stays refused)."""
        if len(params) != len(self.params) or any(id(p) != i for p, i in zip(params, self.params)):
            return True
        if _registrations != self.seen:
            if layout(model) != self.modules:
                return True
            self.seen = _registrations  # registrations elsewhere (another model built): nothing here moved
        return False

    def accept(self, model: nn.Module, params: list) -> None:
        """The model as it is now was validated."""
        self.seen = _registrations
        self.modules = layout(model)
        self.params = [id(p) for p in params]
