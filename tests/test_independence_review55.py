"""The independence check's removal probes (runner/methods/privacy_check/independence.py): every probed example
removed in turn, in eval mode and in train mode with every random draw fixed (privacy_check/no_randomness.py).
Review 55 passed a model reading its batch's size in train mode only by adding F.dropout (the train-mode removal
was skipped for a random forward: 7.6 C), and a batch trimmed to its longest text (the removal probe removed only
the first example, which was not the longest: 1.10 C). Ordinary random forwards stay accepted."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.privacy_check.no_randomness import no_randomness

DT = torch.float64


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


class SizeSign(nn.Module):
    """Train mode: F.dropout or noise, and a sign read off the batch's size."""

    def __init__(self, noise: bool = False):
        super().__init__()
        self.noise, self.a, self.b = noise, nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x.flatten(1)))
        if self.training:
            h = h + 0.1 * torch.randn_like(h) if self.noise else F.dropout(h, 0.1, training=True)
            h = -h if len(h) % 2 else h
        return self.b(h)


class TrimMean(nn.Module):
    """Dynamic padding without a mask: the batch cut to its longest text, then a mean over the kept positions."""

    def __init__(self):
        super().__init__()
        self.e, self.o = nn.Embedding(50, 16), nn.Linear(16, 3)

    def forward(self, x):  # (B, T) token ids, 0 = padding
        x = x[:, :int((x != 0).sum(1).max())]
        return self.o(torch.tanh(self.e(x)).mean(1))


class Noisy(nn.Module):
    """Ordinary train-mode randomness, each row its own: noise injection, F.dropout, per-row stochastic depth."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.a, self.b = how, nn.Linear(64, 300), nn.Linear(300, 10)

    def forward(self, x):
        h = torch.relu(self.a(x.flatten(1)))
        if self.training and self.how == "noise":
            h = h + 0.1 * torch.randn_like(h)
        elif self.how == "dropout":
            h = F.dropout(h, 0.3, training=self.training)
        elif self.training:
            h = h * (torch.rand(len(h), 1) > 0.2).to(h.dtype) / 0.8
        return self.b(h)


def first_step(model, x, y):
    torch.manual_seed(0)
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=0.5, sigma=0.0)
    model = method.attach(model.to(DT))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    method.step(model, loss_fn, x, y, opt, sample_rate=0.01, expected_batch_size=4.0,
                generator=torch.Generator().manual_seed(7))


def images(n):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=g, dtype=DT), torch.randint(0, 10, (n,), generator=g)


def test_a_batch_trimmed_to_its_longest_text_is_refused_whichever_row_is_longest():
    g = torch.Generator().manual_seed(0)
    n, T = 32, 40
    lengths = torch.randint(5, 30, (n,), generator=g)
    lengths[7] = 38  # one long text, not the first
    x = torch.randint(1, 50, (n, T), generator=g) * (torch.arange(T)[None] < lengths[:, None])
    torch.manual_seed(0)
    with pytest.raises(DprunError, match=r"with probed example \d+ removed"):
        first_step(TrimMean(), x, torch.randint(0, 3, (n,), generator=g))


@pytest.mark.parametrize("how", ["noise", "dropout", "depth"])
def test_ordinary_train_mode_randomness_is_accepted(how):
    x, y = images(13)
    torch.manual_seed(0)
    first_step(Noisy(how), x, y)


def test_no_randomness_fixes_every_draw():
    x = torch.randn(4, 5)
    with no_randomness():
        assert torch.equal(F.dropout(x, 0.5, training=True), 2 * x)  # every unit kept, scaled by 1 / (1 - p)
        assert torch.equal(torch.randn_like(x), torch.zeros_like(x)) and bool((torch.rand(3) == 0.5).all())
        assert torch.equal(torch.randperm(4), torch.tensor([3, 2, 1, 0])) and bool((torch.empty(3).normal_(2.0, 1.0) == 2).all())
        assert bool((torch.empty(3).bernoulli_(0.3) == 1).all()) and bool((torch.randint(3, 7, (2,)) == 3).all())


class PoissonSize(nn.Module):
    """Review 56: a size read in train mode behind torch.poisson (or cauchy_) noise, which no_randomness did not fix:
    the train-mode removal was skipped. Those draws are fixed now (the Poisson's rate, the Cauchy's median)."""

    def __init__(self, draw: str):
        super().__init__()
        self.draw, self.a, self.b = draw, nn.Linear(64, 16), nn.Linear(16, 10)

    def forward(self, x):
        h = torch.tanh(self.a(x.flatten(1)))
        if self.training:
            noise = torch.poisson(torch.ones_like(h)) if self.draw == "poisson" else torch.empty_like(h).cauchy_()
            h = (h + 1e-3 * noise) * (len(h) / 4)
        return self.b(h)


@pytest.mark.parametrize("behind", ["dropout", "noise", "poisson", "cauchy"])
def test_a_model_reading_its_size_in_train_mode_behind_randomness_is_refused(behind):
    x, y = images(16)
    torch.manual_seed(0)
    model = SizeSign(behind == "noise") if behind in ("dropout", "noise") else PoissonSize(behind)
    with pytest.raises(DprunError, match=r"removed \(train mode\)"):
        first_step(model, x, y)


def test_no_randomness_keeps_ranges_scales_and_ends_loops():
    """Review 56: random_(5, 10) gave 0 (outside its range), native_dropout (CUDA's F.dropout) was not scaled, and a
    loop redrawing until a value changes never ended under fixed draws: refused after MAX_DRAWS draws now."""
    from runner.methods.privacy_check import no_randomness as module

    x = torch.randn(4, 5)
    with no_randomness():
        assert bool((torch.empty(3).random_(5, 10) == 5).all())
        out, mask = torch.ops.aten.native_dropout(x, 0.5, True)
        assert torch.equal(out, 2 * x) and bool(mask.all())
        assert torch.equal(torch.poisson(torch.full((3,), 2.0)), torch.full((3,), 2.0))
    with pytest.raises(DprunError, match="drew random values"), no_randomness():
        for _ in range(module.MAX_DRAWS + 1):
            torch.randint(0, 10, (3,))
