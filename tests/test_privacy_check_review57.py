"""Review 57 (stop 65), the privacy check's randomness and cost:

- a forward drawing a coin from Python's `random` (or numpy) made two forwards of the same rows differ, the train-mode
  removal was skipped, and a model reading its batch's size behind it passed on 6 of 40 seeds, 7.31 C for one
  example; the same forward without the size read (sound) was refused on 34 of 40. The check replays Python's and
  numpy's states with torch's now, and refuses a forward still random after that;
- nn.RReLU (a slope drawn for the non-positive entries only: replacing example 0 shifted every later row's draws) was
  refused as mixing the batch;
- the fixed draws' limit counted every forward of a probe, so 1,500 draws a forward were refused;
- compile='s padded probe removed every row of a whole-batch prefix: B^2 forwards (528 s at B = 256)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from tests.test_independence_review55 import first_step, images
from tests.test_padding import first_step as padded_first_step


class Flip(nn.Module):
    """A batch-level flip drawn from Python's random or numpy; with `size_read`, review 53's sign read off the batch's
    size in train mode."""

    def __init__(self, source: str = "python", size_read: bool = False):
        super().__init__()
        self.source, self.size_read = source, size_read
        self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        x = x.flatten(1)
        if self.training:
            coin = random.random() if self.source == "python" else float(np.random.rand())
            if coin < 0.5:
                x = x.flip(-1)
        h = torch.tanh(self.a(x))
        if self.training and self.size_read and len(h) % 2:
            h = -h
        return self.b(h)


@pytest.mark.parametrize("source", ["python", "numpy"])
def test_a_size_read_behind_a_python_or_numpy_coin_is_refused(source):
    x, y = images(16)
    for seed in range(8):
        random.seed(seed)
        np.random.seed(seed)
        with pytest.raises(DprunError, match="depend on the other examples"):
            first_step(Flip(source, size_read=True), x, y)


@pytest.mark.parametrize("source", ["python", "numpy"])
def test_a_python_or_numpy_coin_per_batch_is_accepted(source):
    x, y = images(16)
    for seed in range(8):
        random.seed(seed)
        np.random.seed(seed)
        first_step(Flip(source), x, y)


class Outside(nn.Module):
    """Randomness the check can neither fix nor replay: noise from a private numpy Generator."""

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng()
        self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x.flatten(1)))
        if self.training:
            h = h + 0.01 * torch.as_tensor(self.rng.standard_normal(h.shape), dtype=h.dtype)
        return self.b(h)


def test_a_forward_random_outside_what_the_check_replays_is_refused():
    x, y = images(16)
    with pytest.raises(DprunError, match="depend on the other examples|cannot be checked"):
        first_step(Outside(), x, y)


@pytest.mark.parametrize("inplace", [False, True])
def test_rrelu_is_accepted(inplace):
    x, y = images(16)
    torch.manual_seed(0)
    first_step(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.RReLU(inplace=inplace), nn.Linear(16, 10)), x, y)


class ManyDraws(nn.Module):
    """1,500 dropout draws a forward (a recurrent cell's dropout over 1,500 steps): sound."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 8), nn.Linear(8, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x.flatten(1)))
        for _ in range(1500):
            h = F.dropout(h, 0.001, training=self.training)
        return self.b(h)


def test_many_draws_a_forward_are_accepted():
    x, y = images(8)
    torch.manual_seed(0)
    first_step(ManyDraws(), x, y)


class Counted(nn.Module):
    calls = 0

    def forward(self, h):
        Counted.calls += 1
        return h


def test_the_padded_probe_does_not_remove_every_row_of_a_whole_batch():
    """n = 40 rows padded to 48: before, every row of each padded prefix was removed in eval and train mode (~430
    forwards of the layer); three rows each now."""
    Counted.calls = 0
    padded_first_step(Counted(), physical=48, n=40)
    assert Counted.calls < 200, Counted.calls
