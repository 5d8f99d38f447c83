"""The release of the methods that backpropagate sum_i nu_i loss_i (reweight twopass / recompute, jl) is compared with
the per-example oracle at small clip factors too (runner/methods/privacy_check/measured.py SMALL_FACTORS): a custom
autograd.Function whose backward lifts a small output-gradient to a floor is the identity at the probe's factors of 1,
and then released 15.5 C (twopass, recompute) and 14.7 C (jl) for a heavily clipped record (review 14)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS
from test_privacy_validator import MixGrad  # an identity autograd.Function: its backward is replaced


class Lift(MixGrad):
    """Identity forward (and jvp); the backward raises each row's output-gradient to a norm of at least FLOOR (not
    linear in it)."""
    FLOOR = 0.05

    @staticmethod
    def backward(ctx, g):  # g: (B, classes)
        n = g.norm(dim=1, keepdim=True)
        return g * torch.where(n > 0, (Lift.FLOOR / n.clamp_min(1e-30)).clamp(min=1.0), torch.ones_like(n))


class Linear(Lift):
    """The same Function with a linear backward: the control."""
    @staticmethod
    def backward(ctx, g):
        return g


class Net(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn, self.fc1, self.fc2 = fn, nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fn.apply(self.fc2(torch.relu(self.fc1(x))))


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def first_step(name, cfg, fn):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    method = METHODS.build(name, cfg=dict(cfg), clip=1.0, sigma=0.0)
    model = method.attach(Net(fn), torch.utils.data.TensorDataset(x, y))
    method.clipped_sum(model, loss_fn, x[:16], y[:16])
    return method


NOT_LINEAR = [("reweight", {"mode": "twopass"}), ("reweight", {"mode": "recompute"}),
              ("jl", {"r": 2, "jvp": "forward"}), ("jl", {"r": 2, "jvp": "double_vjp"})]


@pytest.mark.parametrize("name,cfg", NOT_LINEAR)
def test_a_backward_not_linear_in_the_clip_factors_is_refused(name, cfg):
    with pytest.raises(DprunError, match="not linear in the clip factors"):
        first_step(name, cfg, Lift)


@pytest.mark.parametrize("name,cfg", NOT_LINEAR + [("reweight", {"mode": "bk"})])
def test_a_linear_custom_backward_is_accepted(name, cfg):
    assert first_step(name, cfg, Linear)._privacy_checked is not None


def test_book_keeping_is_linear_by_construction_and_accepts_the_lift():
    """bk forms the sum from the recorded output-gradients of the unweighted loss: the lift never sees a factor."""
    assert first_step("reweight", {"mode": "bk"}, Lift)._privacy_checked is not None


def test_the_clip_is_restored_after_the_check():
    assert first_step("reweight", {"mode": "twopass"}, Linear).clip == 1.0
