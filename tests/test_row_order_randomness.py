"""The privacy check on forwards that draw random values outside dropout modules (stop 65): a coin per batch is
accepted on every seed, and a mix or a sort hidden behind randomness is refused.

- A per-batch coin (stochastic depth that drops a whole residual branch for the batch) drew the same value in the
  row-order check's two test forwards about half the time; the forward was then taken for deterministic, the two
  orders (which drew different coins) differed, and a sound model was refused on ~13 of 20 seeds.
- no_randomness fixed randperm at the identity, so mixup inside a forward (x mixed with x[randperm(n)]) became x
  alone and passed the removal probe: every loss row depends on two examples (2 C per example). It is the reversal now.
- A sort done in train mode only, behind F.dropout, was compared in eval mode only and passed; the two orders are
  compared in train mode with every draw fixed now."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods.privacy_check.no_randomness import counted_draws, no_randomness
from tests.test_independence_review55 import first_step, images


class BatchDepth(nn.Module):
    """A residual branch dropped for the whole batch with probability 0.5 in train mode (one coin per batch)."""

    def __init__(self):
        super().__init__()
        self.a, self.branch, self.b = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x.flatten(1)))
        if not self.training or bool(torch.rand(()) < 0.5):
            h = h + torch.tanh(self.branch(h))
        return self.b(h)


class Mixup(nn.Module):
    """Mixup inside the forward in train mode: each row mixed with another example of the batch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        x = x.flatten(1)
        if self.training:
            lam = torch.distributions.Beta(0.4, 0.4).sample()
            x = lam * x + (1 - lam) * x[torch.randperm(len(x))]
        return self.b(torch.tanh(self.a(x)))


class TrainSort(nn.Module):
    """Train mode only: F.dropout, then the rows sorted by a feature before a layer and put back after it."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 16), nn.Linear(16, 16), nn.Linear(16, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x.flatten(1)))
        if self.training:
            h = F.dropout(h, 0.1, training=True)
            order = h[:, 0].argsort()
            h = self.b(h[order])[order.argsort()]
        else:
            h = self.b(h)
        return self.c(torch.tanh(h))


@pytest.mark.parametrize("seed", range(20))
def test_a_coin_per_batch_is_accepted_on_every_seed(seed):
    x, y = images(12)
    torch.manual_seed(seed)
    model = BatchDepth()
    torch.manual_seed(seed)
    first_step(model, x, y)


def test_mixup_inside_the_forward_is_refused():
    x, y = images(16)
    torch.manual_seed(0)
    with pytest.raises(DprunError, match=r"removed \(train mode\)"):
        first_step(Mixup(), x, y)


def test_a_sort_in_train_mode_behind_dropout_is_refused():
    x, y = images(16)
    torch.manual_seed(0)
    with pytest.raises(DprunError, match="in another order than the batch's"):
        first_step(TrainSort(), x, y)


def test_counted_draws_sees_a_draw_without_changing_it():
    torch.manual_seed(3)
    expected = torch.rand(5)
    torch.manual_seed(3)
    with counted_draws() as seen:
        got = torch.rand(5)
        torch.zeros(3).add_(1)
    assert seen.draws == 1 and torch.equal(got, expected)
    with no_randomness():
        assert torch.equal(torch.randperm(5), torch.arange(4, -1, -1))


class CoinMix(nn.Module):
    """Mixup inside the forward on some batches only: a branch on a draw, never taken at the draw's centre."""

    def __init__(self, draw: str):
        super().__init__()
        self.draw, self.a, self.b = draw, nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        x = x.flatten(1)
        coin = {"rand_below": lambda: torch.rand(()) < 0.1, "rand_above": lambda: torch.rand(()) > 0.95,
                "randn": lambda: torch.randn(()) > 1.5, "randint": lambda: torch.randint(0, 10, ()) == 9}[self.draw]
        if self.training and bool(coin()):
            x = 0.5 * x + 0.5 * x.roll(1, 0)
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("draw", ["rand_below", "rand_above", "randn", "randint"])
def test_a_batch_mixed_on_a_few_steps_is_refused(draw):
    """Before stop 65: accepted on 10 of 10 seeds at 10% of the steps (the replaced probe draws one coin)."""
    x, y = images(16)
    for seed in range(3):
        torch.manual_seed(seed)
        with pytest.raises(DprunError, match="depend on the other examples of the batch"):
            first_step(CoinMix(draw), x, y)


class CoinNoise(nn.Module):
    """Sound: noise on a few batches only, each row its own."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x.flatten(1)))
        if self.training and bool(torch.rand(()) < 0.1):
            h = h + 0.1 * torch.randn_like(h)
        return self.b(h)


def test_noise_on_a_few_steps_is_accepted():
    x, y = images(16)
    for seed in range(3):
        torch.manual_seed(seed)
        first_step(CoinNoise(), x, y)


def test_no_randomness_ends():
    from runner.methods.privacy_check.no_randomness import no_randomness as fixed

    with fixed("low") as mode:
        assert float(torch.rand(())) == 0.0 and float(torch.randn(())) == -2.0 and int(torch.randint(3, 7, ())) == 3
        assert float(torch.empty(()).uniform_(-1, 1)) == -1.0
    assert mode.varied == 4
    with fixed("high"):
        assert 0.9999 < float(torch.rand(())) < 1.0 and float(torch.randn(())) == 2.0
        assert int(torch.randint(3, 7, ())) == 6 and float(torch.empty(()).uniform_(-1, 1)) < 1.0
    with fixed("centre") as mode:
        assert float(torch.rand(())) == 0.5 and torch.equal(torch.ones(3).bernoulli_(0.5), torch.ones(3))
    assert mode.varied == 1
