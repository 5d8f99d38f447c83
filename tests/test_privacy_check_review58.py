"""Review 58 (stop 65): a batch mixed behind a draw that the fixed draws' centre and ends never take, or behind
Python's or numpy's coin, and per-row Python or numpy augmentation.

Before: a mix (`x = 0.5 x + 0.5 x.flip(0)`, which moves the release by 3.73 C when one example leaves) behind
`0.3 < torch.rand(()) < 0.4`, `torch.bernoulli(0.9) == 0`, `torch.randint(0, 10, ()) == 3`, a multinomial's rare
category, an exponential or Poisson tail, a band of randn was accepted on 20 of 20 seeds, and the replaced probe's
own sighting of the mix was cleared by the fixed draws added for RReLU; behind `random.random() < 0.1`,
`np.random.rand() < 0.1` or `random.choice(range(10)) == 3` on 15-17 of 20 (the check saw one step's coin). Per-row
Python or numpy augmentation was refused as mixing the batch (removing a row shifted the replayed draws). Now every
draw with a range is probed at its ends and deciles (no_randomness's profiles), Python's and numpy's global functions
too (host_draws.py), and the replaced probe is re-run under fixed draws only where its two forwards drew differently."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from tests.test_independence_review55 import first_step, images

COINS = {
    "band": lambda: bool(0.3 < torch.rand(()) < 0.4),
    "bernoulli0": lambda: bool(torch.bernoulli(torch.tensor(0.9)) == 0),
    "randint3": lambda: bool(torch.randint(0, 10, ()) == 3),
    "multinomial": lambda: bool(torch.multinomial(torch.tensor([0.9, 0.1]), 1)[0] == 1),
    "exponential": lambda: bool(torch.empty(()).exponential_() > 2.3026),
    "poisson": lambda: bool(torch.poisson(torch.tensor(0.1054)) >= 1),
    "randn_band": lambda: bool(1.0 < torch.randn(()) < 1.5),
    "python": lambda: random.random() < 0.1,
    "numpy": lambda: bool(np.random.rand() < 0.1),
    "python_choice": lambda: random.choice(range(10)) == 3,
}


class Mix(nn.Module):
    """The batch mixed where coin() says so."""

    def __init__(self, coin):
        super().__init__()
        self.coin, self.a, self.b = coin, nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        x = x.flatten(1)
        if self.training and self.coin():
            x = 0.5 * x + 0.5 * x.flip(0)  # mixup with a fixed partner, on ~10% of the steps
        return self.b(torch.tanh(self.a(x)))


def seeded(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.mark.parametrize("coin", sorted(COINS))
def test_a_batch_mixed_behind_a_rare_draw_is_refused(coin):
    x, y = images(16)
    for seed in range(4):
        seeded(seed)
        with pytest.raises(DprunError, match="depend on the other examples"):
            first_step(Mix(COINS[coin]), x, y)


def per_row(kind: str, x: torch.Tensor) -> torch.Tensor:
    """Sound: each row's own augmentation, drawn from Python's random or numpy. x (n, 64)."""
    n = len(x)
    if kind == "python_flip":
        return torch.stack([r.view(8, 8).flip(-1).flatten() if random.random() < 0.5 else r for r in x])
    if kind == "python_crop":
        out = []
        for r in x:
            img = F.pad(r.view(1, 8, 8), (1, 1, 1, 1))
            i, j = random.randint(0, 2), random.randint(0, 2)
            out.append(img[0, i:i + 8, j:j + 8].flatten())
        return torch.stack(out)
    if kind == "numpy_noise":
        return x + 0.1 * torch.as_tensor(np.random.randn(*x.shape), dtype=x.dtype)
    mask = torch.as_tensor(np.random.rand(n) < 0.5)[:, None]  # numpy_flip
    return torch.where(mask, x.view(n, 8, 8).flip(-1).reshape(n, 64), x)


class Augmented(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind, self.a, self.b = kind, nn.Linear(64, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = x.flatten(1)
        if self.training:
            x = per_row(self.kind, x)
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("kind", ["python_flip", "python_crop", "numpy_noise", "numpy_flip"])
def test_per_row_python_or_numpy_augmentation_is_accepted(kind):
    x, y = images(16)
    for seed in range(3):
        seeded(seed)
        first_step(Augmented(kind), x, y)


def test_the_patched_draws_are_put_back():
    from runner.methods.privacy_check.no_randomness import no_randomness

    functions = (random.random, random.getrandbits, np.random.rand, np.random.choice)
    with no_randomness(0.35):
        assert random.random() == 0.35 and np.random.rand() == 0.35 and np.random.randint(10) == 3
    assert (random.random, random.getrandbits, np.random.rand, np.random.choice) == functions
    random.seed(1)
    first = random.random()
    random.seed(1)
    with no_randomness("low"):
        pass
    assert random.random() == first  # the hidden instance's own method again
