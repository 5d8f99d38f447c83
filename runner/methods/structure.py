"""Whether a model's modules changed since the method validated it: a BatchNorm inserted, or a layer swapped for a
batch-coupling one, after attach and the first step's check would otherwise train unchecked.

    structure = Structure(model)          # at attach
    if structure.changed(model): ...      # each step: validate again and check the next step again

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
    def __init__(self, model: nn.Module):
        self.seen = _registrations
        self.modules = layout(model)

    def changed(self, model: nn.Module) -> bool:
        """True once after the model's modules changed (and then compares against the new ones)."""
        if _registrations == self.seen:
            return False
        self.seen = _registrations
        now = layout(model)
        if now == self.modules:
            return False
        self.modules = now
        return True
