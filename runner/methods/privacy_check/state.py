"""What a forward/backward must leave alone: every parameter and buffer of the model (values, tensors, versions).

    before = snapshot(model)
    ...                                   # the check's forwards and backwards, the method's privatize
    check_unwritten(model, before, "reweight")    # DprunError naming the first parameter/buffer written

A forward that writes into a parameter or buffer (a running statistic, a cache of the last batch, an in-place
renormalisation) puts training data into the released model outside the clipping and the noise. Three signs,
any of which refuses: the tensor's version counter moved (an in-place op), the name now holds another tensor
(an attribute re-assigned), or its value changed (a write through .data, which no counter sees).
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


def named_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if b is not None}}


def snapshot(model: nn.Module) -> dict[str, Entry]:
    with torch.no_grad():
        return {n: Entry(t, t._version, t.detach().clone()) for n, t in named_state(model).items()}


def written(model: nn.Module, before: dict[str, Entry]) -> str | None:
    """The first parameter or buffer written since `before` (its name), or None."""
    now = named_state(model)
    for name, e in before.items():
        t = now.get(name)
        if t is None or t is not e.tensor or t._version != e.version or not torch.equal(t.detach(), e.value):
            return name
    return next(iter(set(now) - set(before)), None)  # a buffer registered by the forward


def check_unwritten(model: nn.Module, before: dict[str, Entry], method: str) -> None:
    name = written(model, before)
    if name is not None:
        kind = "parameter" if name in dict(model.named_parameters()) else "buffer"
        raise DprunError(f"{kind} {name} was written during a forward/backward of method={method}'s first step: "
                         f"the model stores training data (a running statistic, a cache, an in-place update) that "
                         f"is released without clipping or noise, so no method can bound it; compute it without "
                         f"writing into the module (or freeze it and set it before training)")


@torch.no_grad()
def restore(before: dict[str, Entry]) -> None:
    """Put back what the check's passes may have changed (so that a refused model is left as it was given)."""
    for e in before.values():
        if not torch.equal(e.tensor, e.value):
            e.tensor.copy_(e.value)
