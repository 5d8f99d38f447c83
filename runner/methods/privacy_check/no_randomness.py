"""A forward with every random draw replaced by a fixed value, so that two forwards of different batches can be
compared row by row in train mode.

    with no_randomness() as mode:
        out = model(x)     # dropout keeps every unit (scaled by 1 / (1 - p)), randn gives 0, rand 0.5, ...
    mode.unfixed           # the random operators it could not fix (the caller refuses: review 56)
    with counted_draws() as seen:
        out = model(x)     # every draw as drawn
    seen.draws             # how many random operators ran (0: the forward drew nothing torch draws)

The removal probe of the independence check (independence.py) compares the other rows of a batch with and without
one example. In train mode a model's randomness (F.dropout, DropPath, noise injection, the dropout inside
attention) draws other values for other batch shapes, so the probe skipped such forwards, and a model that read its
batch's size in train mode only passed once it added F.dropout (review 55: 7.6 C), or torch.poisson or cauchy_
noise (review 56). Under this mode the train forward is deterministic and row-aligned whatever the batch's shape.
The values are each draw's centre (its mean or median: 0 for a standard normal, the rate of a Poisson, exp(mean) for
a log-normal), or a fixed member of its support (bernoulli's 1: every unit kept; randint's low end; randperm's
reversal: its identity turned mixup inside a forward, x mixed with x[randperm(n)], into x alone, and the removal
probe passed a forward whose every row mixed two examples, 2 C per example: review 57); an operator with a dropout probability argument (fused attention) runs with it at 0. Any other operator
torch tags as random runs as it is and is listed in `unfixed`. Not a model's distribution: only what the check
compares. A forward that keeps drawing (rejection sampling, which a fixed value never leaves) is stopped after
MAX_DRAWS draws with a DprunError rather than left to loop.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from runner.errors import DprunError

aten = torch.ops.aten
MAX_DRAWS = 10_000  # random operators per forward before it is taken for a loop that a fixed draw never leaves


# no_randomness(end=...): "centre" answers each draw with its centre; "low" and "high" move the uniform, normal and
# integer draws to the ends of their ranges (uniform: from / just below to; normal: mean -+ SPREAD std; randint:
# low / high - 1), so a branch on a draw (`if torch.rand(()) < 0.1: mix the batch`) is taken under one of them: at
# the centre alone such a branch was never taken, and a model mixing its batch on 10% of its steps passed (stop 65)
ENDS = ("centre", "low", "high")
SPREAD = 2.0  # standard deviations from the mean at the normal draws' ends
VARIED = (aten.random_, aten.normal_, aten.uniform_, aten.normal, aten.randn, aten.randn_like, aten.rand,
          aten.rand_like, aten.randint, aten.randint_like)


def below(high: float, low: float, dtype: torch.dtype) -> float:
    """The largest value of `dtype` below `high` (towards `low`): a uniform draw's high end, which excludes `high`."""
    dtype = dtype if dtype.is_floating_point else torch.float32
    return float(torch.nextafter(torch.tensor(high, dtype=dtype), torch.tensor(low, dtype=dtype)))


class no_randomness(TorchDispatchMode):
    """Every aten random operator answered with a fixed value (see the module's docstring)."""

    def __init__(self, end: str = "centre", forwards: int = 1):
        super().__init__()
        self.forwards = max(1, int(forwards))  # the forwards run under this mode: MAX_DRAWS is per forward
        if end not in ENDS:
            raise ValueError(f"no_randomness end={end!r}: one of {', '.join(ENDS)}")
        self.end = end  # centre, or the low / high end of the uniform, normal and integer draws (see ENDS)
        self.unfixed: list[str] = []
        self.draws = 0
        self.varied = 0  # draws whose value moves with `end` (a forward with none needs no other end)

    def at_end(self, low: float, centre: float, high: float) -> float:
        return {"low": low, "centre": centre, "high": high}[self.end]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        self.draws += 1
        if self.draws > MAX_DRAWS * self.forwards:
            raise DprunError(f"the model's train-mode forward drew random values more than {MAX_DRAWS} times a "
                             f"forward ({self.draws} in {self.forwards}) under the privacy check's fixed draws (a loop that redraws until a value changes?), so "
                             f"the check cannot compare it; make the loop bounded, or use method=nxbp or multiloss")
        names = [a.name for a in func._schema.arguments]
        arg = lambda name, default=None: (args[names.index(name)] if names.index(name) < len(args)  # noqa: E731
                                          else kwargs.get(name, default)) if name in names else default
        packet = func.overloadpacket
        first = args[0] if args else None
        if packet is aten.native_dropout:  # (input, p, train) -> (output, mask): every unit kept, as dropout scales
            p = float(arg("p", 0.0))
            return (first * (1.0 / (1.0 - p)) if p < 1 and arg("train", True) else first.clone()), \
                torch.ones_like(first, dtype=torch.bool)
        if packet is aten.bernoulli_:
            return first.fill_(1)
        if packet is aten.bernoulli:
            return torch.ones_like(first)
        if packet in VARIED:
            self.varied += 1
        if packet is aten.random_:
            low = int(arg("from", 0)) if "from" in names else 0
            to = arg("to") if "to" in names else None
            return first.fill_(low if self.end != "high" or to is None else int(to) - 1)
        if packet is aten.normal_:
            mean, std = float(arg("mean", 0.0)), float(arg("std", 1.0))
            return first.fill_(self.at_end(mean - SPREAD * std, mean, mean + SPREAD * std))
        if packet is aten.uniform_:
            low, high = float(arg("from", 0.0)), float(arg("to", 1.0))
            return first.fill_(self.at_end(low, (low + high) / 2, below(high, low, first.dtype)))
        if packet is aten.exponential_:
            return first.fill_(1.0 / float(arg("lambd", 1.0)))
        if packet is aten.cauchy_:
            return first.fill_(float(arg("median", 0.0)))
        if packet is aten.log_normal_:
            return first.fill_(math.exp(float(arg("mean", 1.0))))
        if packet is aten.geometric_:
            return first.fill_(1.0)
        if packet is aten.poisson:
            return first.clone()  # its rate
        if packet is aten.binomial:
            return first * arg("prob")
        if packet is aten._standard_gamma:
            return first.clone()  # Gamma(alpha, 1)'s mean
        if packet is aten._sample_dirichlet:
            return first / first.sum(-1, keepdim=True)
        if packet in (aten.rrelu_with_noise, aten.rrelu_with_noise_, aten.rrelu_with_noise_functional):
            # every slope at the range's centre (nn.RReLU(inplace=True) calls the in-place form: review 57)
            slope = (float(arg("lower", 1 / 8)) + float(arg("upper", 1 / 3))) / 2
            out = F.leaky_relu(first, slope)
            if packet is aten.rrelu_with_noise_:
                return first.copy_(out)
            if packet is aten.rrelu_with_noise_functional:
                return out, torch.where(first >= 0, 1.0, slope).to(first.dtype)
            return out
        if packet is aten.normal:
            out = func(*args, **kwargs)
            mean, std = arg("mean", 0.0), arg("std", 1.0)
            out = out.zero_().add_(mean if torch.is_tensor(mean) else float(mean))
            step = self.at_end(-SPREAD, 0.0, SPREAD)
            return out.add_(std * step if torch.is_tensor(std) else float(std) * step) if step else out
        if packet in (aten.randn, aten.randn_like):
            return func(*args, **kwargs).fill_(self.at_end(-SPREAD, 0.0, SPREAD))
        if packet in (aten.rand, aten.rand_like):
            out = func(*args, **kwargs)
            return out.fill_(self.at_end(0.0, 0.5, below(1.0, 0.0, out.dtype)))
        if packet in (aten.randint, aten.randint_like):
            out = func(*args, **kwargs)
            low = int(arg("low", 0)) if "low" in names else 0
            return out.fill_(int(arg("high")) - 1 if self.end == "high" else low)
        if packet is aten.randperm:  # the reversal, not the identity: a row mix by a drawn order stays a mix
            out = func(*args, **kwargs)
            return out.copy_(torch.arange(out.numel() - 1, -1, -1, dtype=out.dtype, device=out.device))
        if packet is aten.multinomial:
            probs = first
            rows = probs.argmax(-1, keepdim=True)  # the likeliest category, every draw
            return rows.expand(*probs.shape[:-1], int(arg("num_samples", 1))).contiguous()
        if "dropout_p" in names:  # fused attention (flash, memory-efficient, cuDNN): no dropout
            at = names.index("dropout_p")
            if at < len(args):
                args = (*args[:at], 0.0, *args[at + 1:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
            return func(*args, **kwargs)
        self.unfixed.append(str(packet).removeprefix("aten."))
        return func(*args, **kwargs)


class counted_draws(TorchDispatchMode):
    """Counts the aten random operators that run (their values as drawn): whether a forward is random, seen by its
    draws rather than by two forwards that differ, which a draw per batch (a coin for a whole residual branch) does
    not show half the time."""

    def __init__(self):
        super().__init__()
        self.draws = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.draws += 1
        return func(*args, **(kwargs or {}))


def not_the_models():
    """The privacy check's own draws (row_order's sketch directions and shuffles) outside any mode above: they are
    not the model's, and under no_randomness they would be fixed (all-zero directions see nothing)."""
    return _disable_current_modes()
