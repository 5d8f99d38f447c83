"""`method.keep_mb`: book-keeping's per-step memory budget for kept per-example gradients (issue 31).

A layer's per-example gradient G_i (B x o x k) kept for its clipped sum replaces the layer's records a, g
(B x T x (k+o)), freed at once, and turns the clipped sum from a GEMM over the B*T rows into nu @ G. Keeping it
saves memory when o*k <= T*(k+o) (always done); otherwise it costs B*(o*k - T*(k+o)) elements more, alive until the
clipped sums, and saves ~B*(T-1)*k*o multiply-adds. `method.keep` decides per layer by a fixed ratio;
`method.keep_mb` instead keeps the layers that save the most time per extra byte, best first, while their extra
bytes in the step stay within the budget (fastDP's MixOpt keeps all of them, without a cap).

    budget = KeepBudget(megabytes=16)
    budget.begin_step()                                   # reweight bk, at each step (each chunk)
    budget.admits(key, N=256, T=25, k=256, o=32, itemsize=4)   # keep this layer's G_i?

The ranking needs every layer's shape: the first step sees them as its backward reaches them (the budget then
only admits a layer while the step's total allows), later steps choose from all of them. Memory only: the clipped
sums and norms are the same whichever layers keep (tests/test_lean_recorder.py).
"""
from __future__ import annotations

from runner.errors import DprunError


def extra_per_example(T: int, k: int, o: int) -> int:
    """Elements a kept G_i adds over the records it frees, per example (<= 0: keeping saves memory)."""
    return o * k - T * (k + o)


class KeepBudget:
    def __init__(self, megabytes: float):
        self.limit = float(megabytes) * 2**20  # bytes per step
        self.layers: dict = {}  # key -> (T, k, o, itemsize) of every layer whose keeping costs memory
        self.used = 0.0  # bytes admitted in this step

    def begin_step(self) -> None:
        self.used = 0.0

    def admits(self, key, N: int, T: int, k: int, o: int, itemsize: int) -> bool:
        extra = extra_per_example(T, k, o)
        if extra <= 0:
            return True  # fewer bytes than the records it replaces, and faster
        self.layers[key] = (T, k, o, itemsize)
        cost = N * extra * itemsize
        if key not in self.ranked_within(N) or self.used + cost > self.limit:
            return False
        self.used += cost
        return True

    def ranked_within(self, N: int) -> set:
        """The layers kept for N examples: by multiply-adds saved per extra byte, best first, while they fit."""
        def saved_per_byte(item):
            T, k, o, itemsize = item[1]
            return (T - 1) * k * o / (extra_per_example(T, k, o) * itemsize)

        chosen, total = set(), 0.0
        for key, (T, k, o, itemsize) in sorted(self.layers.items(), key=saved_per_byte, reverse=True):
            cost = N * extra_per_example(T, k, o) * itemsize
            if total + cost <= self.limit:
                chosen.add(key)
                total += cost
        return chosen


def keep_budget(value) -> KeepBudget | None:
    """method.keep_mb: null (method.keep's per-layer ratio decides) or a number of megabytes >= 0."""
    if value is None:
        return None
    try:
        megabytes = float(value)
    except (TypeError, ValueError):
        megabytes = -1.0
    if isinstance(value, bool) or not megabytes >= 0:
        raise DprunError(f"method.keep_mb={value!r} is not valid: null (method.keep decides per layer) or a number "
                         f"of megabytes >= 0 (0: keep only the per-example gradients that save memory)")
    return KeepBudget(megabytes)
