"""Python's `random` and numpy's global random functions answered with fixed values while no_randomness is on, as
torch's operators are there (one profile: its centre, range ends or a decile).

A forward drawing from them (`if random.random() < 0.1: mix the batch`, timm's Mixup `np.random.rand() < prob`,
`random.choice`, a per-row flip with `random.random()`) was replayed from one saved state at most: the check saw one
step's coin (a batch mixed on 10% of steps passed on 15-17 of 20 seeds), and per-row draws shifted when a row was
removed, refusing sound augmentation (review 58). Patched here: Python's module functions through its hidden
instance (`random()` and `getrandbits()`, which uniform, gauss, randint, choice, sample and shuffle call), and
numpy's rand, random, random_sample, uniform, randn, standard_normal, normal, randint, choice, permutation and
shuffle on `numpy.random`. Not reached: functions imported by name before (`from random import random`), a
`random.Random` or numpy `Generator` of the model's own; the check's replayed states and its refusal of a forward
that still differs cover those.

    with HostDraws(profile, counter):   # counter.varied += 1 at each patched call
        ...
"""
from __future__ import annotations

import random

import numpy as np

NUMPY = ("rand", "random", "random_sample", "uniform", "randn", "standard_normal", "normal", "randint", "choice",
         "permutation", "shuffle")


class HostDraws:
    def __init__(self, profile, counter):
        self.profile, self.counter = profile, counter
        self.saved: list[tuple[object, str, object, bool]] = []

    def __enter__(self):
        pr, counted = self.profile, self._counted
        inst = random._inst
        self._set(inst, "random", counted(lambda: pr.uniform(0.0, 1.0, None)))
        self._set(inst, "getrandbits", counted(lambda k: pr.index(1 << max(k - 1, 0))))  # < 2^(k-1) <= n: no rejection
        self._set(random, "random", inst.random)
        self._set(random, "getrandbits", inst.getrandbits)
        for name in NUMPY:
            if hasattr(np.random, name):
                self._set(np.random, name, counted(getattr(self, "np_" + name)))
        return self

    def __exit__(self, *exc):
        for owner, name, value, had in reversed(self.saved):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        self.saved.clear()
        return False

    def _set(self, owner, name: str, value) -> None:
        had = name in vars(owner) if hasattr(owner, "__dict__") else True
        self.saved.append((owner, name, getattr(owner, name, None), had))
        setattr(owner, name, value)

    def _counted(self, fn):
        def call(*args, **kwargs):
            self.counter.varied += 1
            return fn(*args, **kwargs)
        return call

    # numpy's global functions, each a constant of its profile, shaped as numpy would shape it
    def _full(self, size, value, dtype=float):
        return value if size is None else np.full(size, value, dtype=dtype)

    def _z(self) -> float:
        return self.profile.z or 0.0

    def np_rand(self, *dims):
        return self._full(dims or None, self.profile.uniform(0.0, 1.0, None))

    def np_random(self, size=None):
        return self._full(size, self.profile.uniform(0.0, 1.0, None))

    np_random_sample = np_random

    def np_uniform(self, low=0.0, high=1.0, size=None):
        low, high = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
        q = 0.5 if self.profile.q is None else min(self.profile.q, 1 - 1e-12)
        value = low + q * (high - low)
        return float(value) if size is None and value.ndim == 0 else np.broadcast_to(value, size or value.shape).copy()

    def np_randn(self, *dims):
        return self._full(dims or None, self._z())

    def np_standard_normal(self, size=None):
        return self._full(size, self._z())

    def np_normal(self, loc=0.0, scale=1.0, size=None):
        value = np.asarray(loc, dtype=float) + self._z() * np.asarray(scale, dtype=float)
        return float(value) if size is None and value.ndim == 0 else np.broadcast_to(value, size or value.shape).copy()

    def np_randint(self, low, high=None, size=None, dtype=int):
        low, high = (0, low) if high is None else (low, high)
        return self._full(size, int(low) + self.profile.index(int(high) - int(low)), dtype)

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
        index = np.full(count, at) if replace else (at + np.arange(count)) % len(pool)
        return pool[index].reshape(size)

    def np_permutation(self, x):
        return np.arange(x)[::-1].copy() if np.ndim(x) == 0 else np.asarray(x)[::-1].copy()

    def np_shuffle(self, x):
        x[:] = x[::-1].copy() if isinstance(x, np.ndarray) else x[::-1]
