"""What a forward/backward must leave alone: every parameter and buffer of the model (values, tensors, versions),
and every tensor or float a module keeps as a plain attribute (`self.mean = 0.9 * self.mean + 0.1 * x.mean(0)`).

    before = snapshot(model)
    ...                                   # the check's forwards and backwards, the method's privatize
    check_unwritten(model, before, "reweight")    # DprunError naming the first parameter/buffer written

A forward that writes into a parameter or buffer (a running statistic, a cache of the last batch, an in-place
renormalisation) puts training data into the released model outside the clipping and the noise. Three signs,
any of which refuses: the tensor's version counter moved (an in-place op), the name now holds another tensor
(an attribute re-assigned), or its value changed (a write through .data, which no counter sees).
A plain attribute is no part of the state_dict, yet the next steps' gradients are computed through it, and it
couples the examples of one batch too, where the method forms each example's gradient alone (nxbp, multiloss: a
running mean updated by each example's forward moves the next example's gradient). It is refused when its value
changed or it appeared (a re-assignment to an equal value, a cache rebuilt the same, is not a write).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from runner.errors import DprunError


@dataclass
class Entry:
    tensor: torch.Tensor  # the parameter or buffer itself
    version: int
    value: torch.Tensor  # a detached copy


@dataclass
class Attributes:
    """The plain tensor and float attributes of the model's modules: name -> (module, attribute, the object it held,
    a copy of its value then)."""

    held: dict[str, tuple[nn.Module, str, object, object]]


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if b is not None}}


def named_attributes(model: nn.Module) -> dict[str, tuple[nn.Module, str, object]]:
    """Tensors and floats kept in a module's __dict__ (parameters, buffers and submodules live in their own dicts);
    bools and ints (flags, counters) are not data."""
    return {f"{path}.{attr}" if path else attr: (module, attr, value)
            for path, module in model.named_modules() for attr, value in vars(module).items()
            if isinstance(value, torch.Tensor) or type(value) is float}


def snapshot(model: nn.Module) -> dict[str, Entry | Attributes]:
    with torch.no_grad():
        state: dict = {n: Entry(t, t._version, t.detach().clone()) for n, t in named_state(model).items()}
        state[ATTRIBUTES] = Attributes({n: (m, a, v, v.detach().clone() if isinstance(v, torch.Tensor) else v)
                                        for n, (m, a, v) in named_attributes(model).items()})
        return state


ATTRIBUTES = " attributes"  # snapshot's key for the plain attributes (no parameter's name starts with a space)


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        try:
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.detach(), b.detach().to(a.device)))
        except RuntimeError:  # a tensor that escaped a vmap (written inside multiloss's per-example forward)
            return False
    return type(a) is type(b) and (a == b or (a != a and b != b))  # float nan stays nan


def written(model: nn.Module, before: dict) -> tuple[str, str] | None:
    """(what, name) of the first parameter, buffer or attribute written since `before`, or None."""
    now = named_state(model)
    for name, e in before.items():
        if name == ATTRIBUTES:
            continue
        t = now.get(name)
        if t is None or t is not e.tensor or t._version != e.version or not torch.equal(t.detach(), e.value):
            return ("parameter" if name in dict(model.named_parameters()) else "buffer"), name
    new = next(iter(set(now) - set(before)), None)  # a buffer registered by the forward
    if new is not None:
        return "buffer", new
    held = before[ATTRIBUTES].held if ATTRIBUTES in before else {}
    for name, (_, _, value) in named_attributes(model).items():
        if name not in held or not same(value, held[name][3]):
            return "attribute", name
    return None


def check_unwritten(model: nn.Module, before: dict, method: str) -> None:
    found = written(model, before)
    if found is not None:
        kind, name = found
        raise DprunError(f"{kind} {name} was written during a forward/backward of method={method}'s first step: "
                         f"the model stores training data (a running statistic, a cache, an in-place update) that "
                         f"is released without clipping or noise, so no method can bound it; compute it without "
                         f"writing into the module (or freeze it and set it before training)")


@torch.no_grad()
def restore(before: dict) -> None:
    """Put back what the check's passes may have changed (so that a refused model is left as it was given)."""
    for name, e in before.items():
        if name == ATTRIBUTES:
            for module, attr, original, value in e.held.values():
                if isinstance(original, torch.Tensor) and not same(original, value):
                    original.copy_(value)  # written in place
                setattr(module, attr, original)
        elif not torch.equal(e.tensor, e.value):
            e.tensor.copy_(e.value)
