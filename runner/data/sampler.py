"""Batch samplers over example indices, on the data's device.

Poisson (the default; the accountants assume it): each example joins each batch independently with
probability q = batch_size / N, so batch sizes vary (and may be 0). An epoch is max(1, round(N / batch_size)) batches
(poisson_steps_per_epoch: the one rule, also what dprun-eps counts).
Shuffle: a random permutation cut into batches (logged with a warning: the accountants' numbers then assume a
sampling the run did not do). Fixed: one random partition into disjoint batches drawn once and reused every
epoch, each example once per epoch (what DP-SBCD's hidden-state analysis assumes).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from runner.errors import DprunError
from runner.randomness import permutation, poisson_mask
from runner.registry import unknown_name_message

SAMPLINGS = ("poisson", "shuffle", "fixed")


def poisson_steps_per_epoch(n: int, batch_size: int) -> int:
    """Steps in one Poisson epoch: the expected number of batches that cover N examples, at least one. A run takes
    this many per epoch and dprun-eps counts epochs x this many, so the two always agree."""
    return max(1, round(n / batch_size))


class Sampler:
    def __init__(self, kind: str, n: int, batch_size: int, generator, device="cpu"):
        """generator: a torch.Generator (rng=seeded) or runner/randomness.py's SecureRandom (rng=secure)."""
        if kind not in SAMPLINGS:
            raise DprunError(unknown_name_message("sampling", kind, list(SAMPLINGS)))
        if not 1 <= batch_size <= n:
            raise DprunError(f"batch_size={batch_size} must be between 1 and the training set size {n}")
        self.kind, self.n, self.batch_size, self.generator, self.device = kind, n, batch_size, generator, device
        self.sample_rate = batch_size / n
        self.steps_per_epoch = (poisson_steps_per_epoch(n, batch_size) if kind == "poisson"
                                else math.ceil(n / batch_size))
        self._fixed: list[torch.Tensor] | None = None

    def _perm(self) -> torch.Tensor:
        return permutation(self.generator, self.n).to(self.device)

    def epoch(self) -> Iterator[torch.Tensor]:
        """Yields int64 index tensors (B_t,) for one epoch."""
        if self.kind == "poisson":
            for _ in range(self.steps_per_epoch):
                mask = poisson_mask(self.generator, self.n, self.batch_size)  # (n,) bool
                yield mask.nonzero().squeeze(1).to(self.device)
        elif self.kind == "shuffle":
            yield from self._perm().split(self.batch_size)
        else:
            if self._fixed is None:
                self._fixed = list(self._perm().split(self.batch_size))
            yield from self._fixed
