"""A forward with every random draw replaced by a fixed value, so that two forwards of different batches can be
compared row by row in train mode.

    with no_randomness() as mode:
        out = model(x)     # dropout keeps every unit (scaled by 1 / (1 - p)), randn gives 0, rand 0.5, ...
    mode.unfixed           # the random operators it could not fix (the caller refuses: review 56)
    mode.varied            # draws whose value another profile moves (0: the other profiles show nothing more)
    with no_randomness(0.35):   # every draw with a range at its 0.35 quantile (PROFILES: centre, low, high, deciles)
        out = model(x)          # Python's random and numpy's global functions too (host_draws.py)
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
from statistics import NormalDist

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from runner.errors import DprunError
from runner.methods.privacy_check.host_draws import HostDraws

aten = torch.ops.aten
MAX_DRAWS = 10_000  # random operators per forward before it is taken for a loop that a fixed draw never leaves


# no_randomness(end=...): "centre" answers each draw with its centre; the other profiles move every draw that has a
# range to one quantile of it (uniform from + q (to - from), normal mean + z_q std, randint low + floor(q n), a
# Bernoulli coin 1 where p > 1 - q, a category by its cumulative probability, ...): "low" and "high" its ends (the
# unbounded ones at z = -+2), then the deciles' midpoints 0.05 ... 0.95. A branch on a draw (`if torch.rand(()) <
# 0.1: mix the batch`, `0.3 < torch.rand(()) < 0.4`, `torch.randint(0, 10, ()) == 3`, a multinomial's rare
# category) is then taken under one of them: at the centre alone it was never taken, and a model mixing its batch
# on 10% of its steps passed (stop 65, review 58). Python's `random` and numpy's global functions are fixed alike
# (host_draws.py). The removal probe runs every profile where the forward draws such values (PROFILES); the
# row-order check, on the whole batch, the three ENDS.
ENDS = ("centre", "low", "high")
DECILES = tuple(round(0.05 + 0.1 * i, 2) for i in range(10))
PROFILES = ENDS + DECILES
SPREAD = 2.0  # standard deviations from the mean at the unbounded draws' ends
TAIL = NormalDist().cdf(-SPREAD)  # the quantile there (0.0228)
# the operators whose value moves with the profile (a forward with none needs no other profile); bernoulli_ (the CPU's
# dropout) and native_dropout keep every unit at every profile, randperm is the reversal, Gamma and Dirichlet their means
VARIED = (aten.random_, aten.normal_, aten.uniform_, aten.normal, aten.randn, aten.randn_like, aten.rand,
          aten.rand_like, aten.randint, aten.randint_like, aten.exponential_, aten.cauchy_, aten.log_normal_,
          aten.geometric_, aten.poisson, aten.binomial, aten.bernoulli, aten.multinomial, aten.rrelu_with_noise,
          aten.rrelu_with_noise_, aten.rrelu_with_noise_functional)


def below(high: float, low: float, dtype: torch.dtype) -> float:
    """The largest value of `dtype` below `high` (towards `low`): a uniform draw's high end, which excludes `high`."""
    dtype = torch.float64 if dtype is None else dtype if dtype.is_floating_point else torch.float32
    return float(torch.nextafter(torch.tensor(high, dtype=dtype), torch.tensor(low, dtype=dtype)))


class Profile:
    """One profile's values: `q` the quantile of a bounded range (0 and 1 at the ends), `z` a standard normal's
    (-+SPREAD at the ends), `tail` the quantile an unbounded draw takes (TAIL and 1 - TAIL at the ends); None at the
    centre, where each draw keeps its own centre."""

    def __init__(self, end):
        if end not in PROFILES:
            raise ValueError(f"no_randomness end={end!r}: one of {', '.join(map(str, PROFILES))}")
        self.end = end
        self.q = {"centre": None, "low": 0.0, "high": 1.0}.get(end, end) if isinstance(end, str) else float(end)
        self.tail = None if self.q is None else min(max(self.q, TAIL), 1 - TAIL)
        self.z = None if self.q is None else NormalDist().inv_cdf(self.tail)

    def uniform(self, low: float, high: float, dtype=torch.float32) -> float:
        if self.q is None:
            return (low + high) / 2
        return min(low + self.q * (high - low), below(high, low, dtype))

    def index(self, n: int) -> int:
        """An integer in [0, n): 0 at the centre (the low end, as randint's centre has been)."""
        return 0 if self.q is None or n <= 1 else min(int(self.q * n), n - 1)


def categories(probs: torch.Tensor, q: float) -> torch.Tensor:
    """(..., 1) the category at cumulative probability q of each row of probs (..., n) (q = 0: the first with
    probability; q = 1: the last)."""
    cum = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
    at = torch.clamp(torch.tensor(q, dtype=cum.dtype, device=cum.device), min=1e-12, max=1.0)
    index = (cum < at).sum(-1, keepdim=True)
    return index.clamp(max=probs.shape[-1] - 1)


class no_randomness(TorchDispatchMode):
    """Every aten random operator answered with a fixed value (see the module's docstring)."""

    def __init__(self, end="centre", forwards: int = 1):
        super().__init__()
        self.forwards = max(1, int(forwards))  # the forwards run under this mode: MAX_DRAWS is per forward
        self.profile = Profile(end)
        self.end = end
        self._unfixed: list[str] = []
        self.draws = 0
        self.varied = 0  # draws whose value moves with the profile (a forward with none needs no other profile)
        self.host = HostDraws(self.profile, self)

    @property
    def unfixed(self) -> list[str]:
        """The random operators it could not fix: torch's, and Python's or numpy's global generator where a function
        host_draws.py does not patch drew from it (review 59: np.random.binomial, ranf, mtrand.rand)."""
        return self._unfixed + self.host.advanced()

    def count_draw(self) -> None:
        """One more draw: a forward that keeps drawing (rejection sampling, which a fixed value never leaves) is
        stopped with one line rather than left to loop (torch's draws and Python's or numpy's alike: review 59)."""
        self.draws += 1
        if self.draws > MAX_DRAWS * self.forwards:
            raise DprunError(f"the model's train-mode forward drew random values more than {MAX_DRAWS} times a "
                             f"forward ({self.draws} in {self.forwards}) under the privacy check's fixed draws (a "
                             f"loop that redraws until a value changes?), so the check cannot compare it; make the "
                             f"loop bounded, or use method=nxbp or multiloss")

    def __enter__(self):
        self.host.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self.host.__exit__(None, None, None)
            raise

    def __exit__(self, kind, value, trace):
        try:
            super().__exit__(kind, value, trace)
        finally:
            self.host.__exit__(kind, value, trace)
        if kind is not None and issubclass(kind, Exception) and not issubclass(
                kind, (DprunError, MemoryError, torch.OutOfMemoryError)):  # out of memory: not the draws' doing
            # a forward that fails on a fixed value (a division by a draw at its range's end): one line, not a trace
            raise DprunError(f"the model's train-mode forward failed under the privacy check's fixed random draws "
                             f"(every draw at its {self.end}{' quantile' if isinstance(self.end, float) else ''}): "
                             f"{kind.__name__}: {str(value).splitlines()[0] if str(value) else ''}; make it accept "
                             f"any value its draws can take, or use method=nxbp or method=multiloss") from value
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        self.count_draw()
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
        if packet in VARIED:
            self.varied += 1
        pr = self.profile
        if packet is aten.bernoulli:  # a coin: 1 where p > 1 - q (every unit kept at the centre)
            given = arg("p") if "p" in names else None
            p = first if given is None else given if torch.is_tensor(given) else torch.full_like(first, float(given))
            value = torch.ones_like(first) if pr.q is None else (p > 1 - pr.q).to(first.dtype)
            return kwargs["out"].copy_(value) if kwargs.get("out") is not None else value
        if packet is aten.random_:  # without bounds: [0, 2^mantissa] (floats) or [0, max] (integers)
            low = int(arg("from", 0)) if "from" in names else 0
            to = arg("to") if "to" in names else None
            if to is None:
                bits = torch.finfo(first.dtype).nmant + 1 if first.is_floating_point() else \
                    (torch.iinfo(first.dtype).bits - 1 if first.dtype != torch.bool else 1)
                return first.fill_(low + pr.index(2 ** bits))
            return first.fill_(low + pr.index(int(to) - low))
        if packet is aten.normal_:
            mean, std = float(arg("mean", 0.0)), float(arg("std", 1.0))
            return first.fill_(mean if pr.z is None else mean + pr.z * std)
        if packet is aten.uniform_:
            return first.fill_(pr.uniform(float(arg("from", 0.0)), float(arg("to", 1.0)), first.dtype))
        if packet is aten.exponential_:
            lambd = float(arg("lambd", 1.0))
            return first.fill_(1.0 / lambd if pr.q is None else -math.log1p(-pr.tail) / lambd)
        if packet is aten.cauchy_:
            median, sigma = float(arg("median", 0.0)), float(arg("sigma", 1.0))
            return first.fill_(median if pr.q is None else median + sigma * math.tan(math.pi * (pr.tail - 0.5)))
        if packet is aten.log_normal_:
            mean, std = float(arg("mean", 1.0)), float(arg("std", 2.0))
            return first.fill_(math.exp(mean if pr.z is None else mean + pr.z * std))
        if packet is aten.geometric_:
            p = float(arg("p", 0.5))
            return first.fill_(1.0 if pr.q is None or p >= 1 else max(1, math.ceil(math.log1p(-pr.tail) / math.log1p(-p))))
        if packet is aten.poisson:  # its rate; elsewhere rate + z sqrt(rate), rounded
            return first.clone() if pr.z is None else (first + first.sqrt() * pr.z).round().clamp_min(0)
        if packet is aten.binomial:
            count, prob = first, arg("prob")
            if pr.z is None:
                return count * prob
            return (count * prob + (count * prob * (1 - prob)).sqrt() * pr.z).round().clamp(min=0).minimum(count)
        if packet is aten._standard_gamma:
            return first.clone()  # Gamma(alpha, 1)'s mean
        if packet is aten._sample_dirichlet:
            return first / first.sum(-1, keepdim=True)
        if packet in (aten.rrelu_with_noise, aten.rrelu_with_noise_, aten.rrelu_with_noise_functional):
            # every slope at one point of its range (nn.RReLU(inplace=True) calls the in-place form: review 57)
            slope = pr.uniform(float(arg("lower", 1 / 8)), float(arg("upper", 1 / 3)))
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
            return out if not pr.z else out.add_(std * pr.z if torch.is_tensor(std) else float(std) * pr.z)
        if packet in (aten.randn, aten.randn_like):
            return func(*args, **kwargs).fill_(pr.z or 0.0)
        if packet in (aten.rand, aten.rand_like):
            out = func(*args, **kwargs)
            return out.fill_(pr.uniform(0.0, 1.0, out.dtype))
        if packet in (aten.randint, aten.randint_like):
            out = func(*args, **kwargs)
            low = int(arg("low", 0)) if "low" in names else 0
            return out.fill_(low + pr.index(int(arg("high")) - low))
        if packet is aten.randperm:  # the reversal, not the identity: a row mix by a drawn order stays a mix
            out = func(*args, **kwargs)
            return out.copy_(torch.arange(out.numel() - 1, -1, -1, dtype=out.dtype, device=out.device))
        if packet is aten.multinomial:  # the likeliest category at the centre, else the one at cumulative q
            probs = first
            rows = probs.argmax(-1, keepdim=True) if pr.q is None else categories(probs, pr.q)
            return rows.expand(*probs.shape[:-1], int(arg("num_samples", 1))).contiguous()
        if "dropout_p" in names:  # fused attention (flash, memory-efficient, cuDNN): no dropout
            at = names.index("dropout_p")
            if at < len(args):
                args = (*args[:at], 0.0, *args[at + 1:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
            return func(*args, **kwargs)
        self._unfixed.append(str(packet).removeprefix("aten."))
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
