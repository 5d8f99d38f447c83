"""Review 61: a clip factor C / N below float32's smallest normal number was rounded to the nearest multiple of 2^-149
(up by as much as 100%), so an example released up to 1.96 C with a tiny C (every exact mode); and a model mixing
float32 and float64 weights crashed reweight's clipped sums instead of being refused in one line."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.base import CLIP_SLACK, clip_factors

SUBNORMAL = 2.0**-149  # float32's smallest subnormal: the spacing of every quotient below 2^-126 (clip_factors is
# called with any C here: the methods accept C >= 1e-6, runner/methods/base.py CLIP_RANGE)
QUOTIENTS = (0.51, 0.75, 1.5, 2.5, 3.5, 1000.49)  # C / N in units of that spacing: each rounds up to nearest


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("norm", [1.0, 5.692e15, 3.0e20])
def test_a_subnormal_clip_factor_is_never_above_the_exact_quotient(norm):
    norms = torch.full((len(QUOTIENTS),), norm, dtype=torch.float32)
    exact_norm = norms.double() + 1e-6  # the quotient's denominator, as clip_factors forms it (exact here)
    for q in QUOTIENTS:
        clip = q * SUBNORMAL * float(exact_norm[0])
        factor = clip_factors(norms, clip)
        # the released share of an example whose certified norm is N: factor * N, at most C in exact arithmetic
        assert (factor.double() * exact_norm <= clip).all(), (q, factor[0].item() / SUBNORMAL)
        assert (factor > 0).all() or q < 2  # rounded down by one spacing, not dropped


def test_normal_clip_factors_are_unchanged():
    norms = torch.tensor([0.0, 0.5, 2.0, 7.3, 1e30], dtype=torch.float32)
    for clip in (1.0, 1e-3, 4.2):
        before = (clip * (1 - CLIP_SLACK) / (norms + 1e-6)).clamp(max=1.0)  # without the subnormal correction
        assert torch.equal(clip_factors(norms, clip), before)


def release(cfg: dict, model: nn.Module, x, y, clip: float) -> torch.Tensor:
    method = METHODS.build("reweight", cfg=cfg, clip=clip, sigma=0.0)
    method.privacy_check = False
    m = method.attach(copy.deepcopy(model))
    method.step(m, loss_fn, x, y, torch.optim.SGD(m.parameters(), lr=0.0), sample_rate=1.0, expected_batch_size=1.0)
    return torch.cat([p.grad.double().flatten() for p in m.parameters()])


@pytest.mark.parametrize("cfg", [{}, {"mode": "twopass"}, {"norm": "ghost"}])
def test_review61s_clip_is_refused_and_an_accepted_one_gives_a_normal_factor(cfg):
    """Review 61's model: one example whose gradient norm is ~5.7e15 (its input x 1e15) and C ~ q 2^-149 N (4e-30 to
    3e-27): it released 1.96 C at q = 0.51. Such a C is refused now (review 64: C >= 1e-6), and from the smallest
    accepted C the factor C / N stays normal (N <= 2^64, else not finite): the example releases at most C."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 3))
    x, y = torch.randn(1, 8) * 1e15, torch.tensor([0])
    with pytest.raises(DprunError, match=r"clip \(max_grad_norm\)=4e-30 is outside the accepted range \[1e-6"):
        METHODS.build("reweight", cfg=cfg, clip=4e-30, sigma=0.0)
    for scale in (1e15, 1e18):
        released = release(cfg, model, x / 1e15 * scale, y, 1e-6)
        assert float(released.norm()) <= 1e-6


class Mixed(nn.Module):
    """A float32 layer, then a float64 one (each dtype accepted alone)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double()).float()


@pytest.mark.parametrize("mode", ["bk", "twopass", "recompute"])
def test_reweight_refuses_mixed_weight_dtypes_in_one_line(mode):
    method = METHODS.build("reweight", cfg={"mode": mode}, clip=1.0, sigma=0.5)
    m = method.attach(Mixed())
    with pytest.raises(DprunError, match="one dtype.*float32 and float64.*nxbp") as err:
        method.step(m, loss_fn, torch.randn(4, 6), torch.tensor([0, 1, 2, 0]), torch.optim.SGD(m.parameters(), lr=0.0),
                    sample_rate=1.0, expected_batch_size=1.0)
    assert "\n" not in str(err.value)


def test_nxbp_trains_mixed_weight_dtypes():
    method = METHODS.build("nxbp", clip=1.0, sigma=0.5)
    m = method.attach(Mixed())
    before = m.b.weight.detach().clone()
    method.step(m, loss_fn, torch.randn(4, 6), torch.tensor([0, 1, 2, 0]), torch.optim.SGD(m.parameters(), lr=0.1),
                sample_rate=1.0, expected_batch_size=4.0)
    assert not torch.equal(m.b.weight, before)
