"""A forward with every random draw replaced by a fixed value, so that two forwards of different batches can be
compared row by row in train mode.

    with no_randomness():
        out = model(x)     # dropout keeps every unit, randn gives 0, rand 0.5, bernoulli(p) 1, randperm the identity

The removal probe of the independence check (independence.py) compares the other rows of a batch with and without
one example. In train mode a model's randomness (F.dropout, DropPath, noise injection, the dropout inside
nn.MultiheadAttention) draws other values for other batch shapes, so the probe skipped such forwards, and a model
that read its batch's size in train mode only passed once it added F.dropout (review 55: 7.6 C). Under this mode
the train forward is deterministic and row-aligned whatever the batch's shape. The values are the draws' centres
(their expectations where that is a value of the draw's support: 0 for a standard normal, the mean for normal_,
the middle of uniform_), or a fixed member of the support (bernoulli's 1: every dropout unit kept, scaled by
1 / (1 - p) as always). Not a model's distribution: only what the check compares.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _filled(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(like, value)


class no_randomness(TorchDispatchMode):
    """Every aten random operator answered with a fixed value (see the module's docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is aten.native_dropout:  # (input, p, train) -> (output, mask): every unit kept
            x = args[0]
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        if packet in (aten.bernoulli_, aten.random_):  # in place: every trial a success / the lowest value
            return args[0].fill_(1 if packet is aten.bernoulli_ else kwargs.get("from", 0))
        if packet is aten.bernoulli:
            return torch.ones_like(args[0])
        if packet is aten.normal_:
            return args[0].fill_(float(args[1]) if len(args) > 1 else float(kwargs.get("mean", 0.0)))
        if packet is aten.uniform_:
            low = float(args[1]) if len(args) > 1 else float(kwargs.get("from", 0.0))
            high = float(args[2]) if len(args) > 2 else float(kwargs.get("to", 1.0))
            return args[0].fill_((low + high) / 2)
        if packet is aten.exponential_:
            return args[0].fill_(1.0 / float(args[1] if len(args) > 1 else kwargs.get("lambd", 1.0)))
        if packet in (aten.randn, aten.normal):
            out = func(*args, **kwargs)
            return out.zero_() if packet is aten.randn else _filled(out, 0.0).add_(
                args[0] if torch.is_tensor(args[0]) else float(args[0]))
        if packet is aten.randn_like:
            return torch.zeros_like(args[0], **{k: v for k, v in kwargs.items() if k != "generator"})
        if packet is aten.rand:
            return func(*args, **kwargs).fill_(0.5)
        if packet is aten.rand_like:
            return torch.full_like(args[0], 0.5, **{k: v for k, v in kwargs.items() if k != "generator"})
        if packet in (aten.randint, aten.randint_like):
            out = func(*args, **kwargs)
            low = args[1] if packet is aten.randint_like and len(args) > 2 else (
                args[0] if packet is aten.randint and len(args) > 2 else 0)
            return out.fill_(int(low))
        if packet is aten.randperm:
            n = args[0]
            return torch.arange(n, dtype=kwargs.get("dtype") or torch.long, device=kwargs.get("device"))
        if packet is aten.multinomial:
            probs = args[0]
            return probs.argmax(-1, keepdim=True).expand(*probs.shape[:-1], int(args[1])).contiguous()
        return func(*args, **kwargs)
