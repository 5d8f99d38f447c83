"""Python's `random` and numpy's global random functions answered with fixed values while no_randomness is on, as
torch's operators are there (one profile: its centre, range ends or a decile).

A forward drawing from them (`if random.random() < 0.1: mix the batch`, timm's Mixup `np.random.rand() < prob`,
`random.choice`, a per-row flip with `random.random()`) was replayed from one saved state at most: the check saw one
step's coin (a batch mixed on 10% of steps passed on 15-17 of 20 seeds), and per-row draws shifted when a row was
removed, refusing sound augmentation (review 58). Patched here, in the check's thread only (a user's prefetching
thread draws as it does): Python's module functions through its hidden instance (`random()` and `getrandbits()`,
which uniform, randint, choice, sample and shuffle call; the samplers that loop until a draw is accepted answered
directly), and numpy's rand, random, random_sample, ranf, sample, uniform, randn, standard_normal, normal, randint,
choice, permutation and shuffle on `numpy.random`. Every patched call counts toward no_randomness's draw limit. Any
other function drawing from Python's or numpy's global generator (np.random.binomial, `np.random.mtrand.rand`, a
name bound before: `from random import random`) moves that generator's state, which `advanced` reports: the forward
is refused as one the check cannot fix (review 59: such coins passed on 8 of 10 seeds). Not seen: a generator of
the model's own seeded from the OS (`random.SystemRandom`, `secrets`, `os.urandom`, a fresh `random.Random()`):
replayed neither, caught only where two forwards happen to differ.

    with HostDraws(profile, mode):   # mode.count_draw() and mode.varied += 1 at each patched call
        ...
"""
from __future__ import annotations

import math
import random
import threading

import numpy as np

NUMPY = ("rand", "random", "random_sample", "ranf", "sample", "uniform", "randn", "standard_normal", "normal",
         "randint", "choice", "permutation", "shuffle")
# Python's samplers that loop until a draw is accepted, which a constant random() may never be (review 59:
# normalvariate at the low profile looped for ever): answered with the profile's value of their distribution
PYTHON_SAMPLERS = ("gauss", "normalvariate", "lognormvariate", "gammavariate", "betavariate", "vonmisesvariate")
TINY = 2.0 ** -53  # the low end of a host uniform draw: random() can return 0, but a forward dividing by it (review
# 59: `1 + 0.01 / random.random()`) would fail the check at a value it almost never sees


class HostDraws:
    def __init__(self, profile, mode):
        self.profile, self.mode = profile, mode  # mode: no_randomness (count_draw, varied)
        self.saved: list[tuple[object, str, object, bool]] = []
        self.before = self.after = None
        self.thread = None

    def __enter__(self):
        self.thread = threading.get_ident()  # other threads (a user's prefetching) draw as they do (review 59)
        self.before, self.after = host_states(), None
        inst = random._inst
        self._set(inst, "random", self._unit)
        self._set(inst, "getrandbits", lambda k: self.profile.index(1 << k))
        # randrange, randint, choice, sample and shuffle draw through _randbelow(n): answered over all of [0, n), not
        # through getrandbits below 2^(k-1) (review 60: randrange(3) never gave 2, randint(0, 99) never passed 63)
        self._set(inst, "_randbelow", lambda n: self.profile.index(n))
        for name in PYTHON_SAMPLERS:
            self._set(inst, name, getattr(self, "py_" + name))
            self._set(random, name, getattr(inst, name))
        self._set(random, "random", inst.random)
        self._set(random, "getrandbits", inst.getrandbits)
        for name in NUMPY:
            if hasattr(np.random, name):
                self._set(np.random, name, getattr(self, "np_" + name))
        return self

    def __exit__(self, *exc):
        self.after = host_states()
        for owner, name, value, had in reversed(self.saved):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        self.saved.clear()
        return False

    def advanced(self) -> list[str]:
        """Python's or numpy's global generator, where it moved under the mode: a function not patched here drew
        (np.random.binomial, mtrand.rand, a name bound before: review 59), so the forward is not fixed."""
        if self.before is None:
            return []
        now = self.after if self.after is not None else host_states()
        moved = []
        if now[0] != self.before[0]:
            moved.append("Python's random (a function the check does not fix)")
        a, b = now[1], self.before[1]
        if a[0] != b[0] or not np.array_equal(a[1], b[1]) or a[2:] != b[2:]:
            moved.append("numpy's global random functions (one the check does not fix)")
        return moved

    def _set(self, owner, name: str, fixed) -> None:
        had = name in vars(owner) if hasattr(owner, "__dict__") else True
        original = getattr(owner, name, None)
        self.saved.append((owner, name, original, had))

        def call(*args, **kwargs):
            if threading.get_ident() != self.thread:
                return original(*args, **kwargs)
            self.mode.count_draw()
            self.mode.varied += 1
            return fixed(*args, **kwargs)

        setattr(owner, name, call)

    def _unit(self) -> float:
        return max(self.profile.uniform(0.0, 1.0, None), TINY)

    def _z(self) -> float:
        return self.profile.z or 0.0

    # Python's samplers: the profile's point of each distribution
    def py_gauss(self, mu=0.0, sigma=1.0):
        return mu + sigma * self._z()

    py_normalvariate = py_gauss

    def py_lognormvariate(self, mu, sigma):
        return math.exp(mu + sigma * self._z())

    def py_gammavariate(self, alpha, beta):  # its mean, moved by z standard deviations, kept above 0
        return max(alpha * beta + self._z() * math.sqrt(alpha) * beta, TINY * alpha * beta)

    def py_betavariate(self, alpha, beta):
        q = self.profile.q
        mean = alpha / (alpha + beta)
        return mean if q is None else min(max(q, TINY), 1 - TINY)

    def py_vonmisesvariate(self, mu, kappa):
        return (mu + math.pi * (self._unit() * 2 - 1) if self.profile.q is not None else mu) % (2 * math.pi)

    # numpy's global functions, each a constant of its profile, shaped as numpy would shape it
    def _full(self, size, value, dtype=float):
        return np.float64(value) if size is None and dtype is float else \
            dtype(value) if size is None else np.full(size, value, dtype=dtype)

    def np_rand(self, *dims):
        return self._full(dims or None, self._unit())

    def np_random(self, size=None):
        return self._full(size, self._unit())

    np_random_sample = np_ranf = np_sample = np_random

    def np_uniform(self, low=0.0, high=1.0, size=None):
        low, high = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
        q = 0.5 if self.profile.q is None else min(max(self.profile.q, TINY), 1 - 1e-12)
        value = low + q * (high - low)
        return np.float64(value) if size is None and value.ndim == 0 else \
            np.broadcast_to(value, size or value.shape).copy()

    def np_randn(self, *dims):
        return self._full(dims or None, self._z())

    def np_standard_normal(self, size=None):
        return self._full(size, self._z())

    def np_normal(self, loc=0.0, scale=1.0, size=None):
        value = np.asarray(loc, dtype=float) + self._z() * np.asarray(scale, dtype=float)
        return np.float64(value) if size is None and value.ndim == 0 else \
            np.broadcast_to(value, size or value.shape).copy()

    def np_randint(self, low, high=None, size=None, dtype=int):
        low, high = (np.asarray(0), np.asarray(low)) if high is None else (np.asarray(low), np.asarray(high))
        n = np.maximum(high - low, 1)
        q = self.profile.q
        value = low if q is None else low + np.minimum((q * n).astype(np.int64), n - 1)
        if size is None and np.ndim(value) == 0:
            return np.dtype(dtype).type(value)
        return np.broadcast_to(value, size or np.shape(value)).astype(dtype)

    def _pick(self, n: int, p=None) -> int:
        if p is None or self.profile.q is None:
            return self.profile.index(n) if p is None else int(np.argmax(p))
        cum = np.cumsum(p) / np.sum(p)
        return int(min(np.searchsorted(cum, max(self.profile.q, 1e-12)), n - 1))

    def np_choice(self, a, size=None, replace=True, p=None):
        pool = np.arange(a) if np.ndim(a) == 0 else np.asarray(a)
        at = self._pick(len(pool), p)
        if size is None:
            return pool[at]
        count = int(np.prod(size))
        if not replace and count > len(pool):
            raise ValueError("Cannot take a larger sample than population when replace is False")
        index = np.full(count, at) if replace else (at + np.arange(count)) % len(pool)
        return pool[index].reshape(size)

    def _order(self, n: int) -> np.ndarray:
        """A permutation of n: the reversal (a row mix by a drawn order stays a mix), rolled by the profile's index
        so that each position takes other rows across the profiles (review 60: `permutation(4)[0] == 0` never held)."""
        return np.roll(np.arange(n)[::-1], self.profile.index(n))

    def np_permutation(self, x):
        if np.ndim(x) == 0:
            return self._order(int(x))
        x = np.asarray(x)
        return x[self._order(len(x))]

    def np_shuffle(self, x):
        order = self._order(len(x))
        if isinstance(x, np.ndarray):
            x[:] = x[order]
        elif hasattr(x, "flip"):  # a torch tensor
            x.copy_(x[torch_index(order)])
        else:
            x[:] = [x[i] for i in order]


def torch_index(order: np.ndarray):
    import torch

    return torch.as_tensor(order.copy())


def host_states():
    return random.getstate(), np.random.get_state()
