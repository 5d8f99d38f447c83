"""jl releases the backward of sum_i nu_i loss_i: sum_i nu_i grad_i only where every backward is linear in its
incoming gradient. A custom autograd.Function whose backward lifts a small output-gradient to a floor is the identity
at the probe's factors of 1, and released 15.5 C (reweight twopass and recompute, which released such a backward then)
and 14.7 C (jl) for a heavily clipped record (review 14); the oracle comparison then tried small factors too
(measured.py SMALL_FACTORS), and one lifting only in a band of norms between them released 66-74 C (review 16). So a
graph running a user's autograd.Function is refused by jl (first_step.py check_no_user_function); the small factors
stay as a second line for torch's own Functions. reweight, in every mode, sums the recorded output-gradients of the
unweighted loss (twopass and recompute since review 25: runner/norms/released.py): linear by construction.
"""
import functools

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


def first_step(name, cfg, fn, build=None):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    method = METHODS.build(name, cfg=dict(cfg), clip=1.0, sigma=0.0)
    model = method.attach((build or Net)(fn), torch.utils.data.TensorDataset(x, y))
    method.clipped_sum(model, loss_fn, x[:16], y[:16])
    return method


NOT_LINEAR = [("jl", {"r": 2, "jvp": "forward"}), ("jl", {"r": 2, "jvp": "double_vjp"})]


class BandLift(Lift):
    """Lifts a row only when its norm lies in (1e-5, 1e-3): between the small factors the oracle comparison tries."""
    @staticmethod
    def backward(ctx, g):
        n = g.norm(dim=1, keepdim=True)
        return torch.where((n > 1e-5) & (n < 1e-3), g * 1e-3 / n.clamp_min(1e-30), g)


@pytest.mark.parametrize("fn", [Lift, BandLift, Linear], ids=lambda f: f.__name__)
@pytest.mark.parametrize("name,cfg", NOT_LINEAR)
def test_a_users_autograd_function_is_refused_where_the_release_is_a_reweighted_backward(name, cfg, fn):
    with pytest.raises(DprunError, match=r"backward runs code of its own that need not be \(test_release_linearity\."):
        first_step(name, cfg, fn)


class TorchsLift(Lift):
    """The lift claiming to be torch's: its code is not in torch's files, so it is refused all the same (review 17)."""


TorchsLift.__module__ = "torch.test_only"


@pytest.mark.parametrize("name,cfg", NOT_LINEAR)
def test_a_function_claiming_to_be_torchs_is_refused(name, cfg):
    with pytest.raises(DprunError, match=r"need not be \(torch.test_only.TorchsLift"):
        first_step(name, cfg, TorchsLift)


def band(g):  # (B, classes): a row lifted to norm 1e-3 when its norm lies in (1e-5, 1e-3)
    n = g.norm(dim=1, keepdim=True)
    return torch.where((n > 1e-5) & (n < 1e-3), g * 1e-3 / n.clamp_min(1e-30), g)


class HookNet(Net):
    """The band lift as a tensor hook on the output (review 17: 66 C twopass, 65 C jl)."""
    def forward(self, x):
        out = self.fc2(torch.relu(self.fc1(x)))
        if out.requires_grad:
            out.register_hook(band)
        return out


def module_hooked(fn):
    net = Net(Linear)
    net.fc2.register_full_backward_hook(lambda module, grad_in, grad_out: (band(grad_in[0]),))
    return net


def parameter_hooked(fn):
    net = Net(Linear)
    net.fc2.weight.register_hook(lambda g: g * (1 + g.norm()))
    return net


@pytest.mark.parametrize("build", [lambda fn: HookNet(fn), module_hooked, parameter_hooked],
                         ids=["tensor_hook", "module_backward_hook", "parameter_hook"])
@pytest.mark.parametrize("name,cfg", NOT_LINEAR)
def test_a_gradient_hook_is_refused_where_the_release_is_a_reweighted_backward(name, cfg, build):
    with pytest.raises(DprunError, match=r"need not be \(a "):
        first_step(name, cfg, Linear, build=build)


@pytest.mark.parametrize("name,cfg", NOT_LINEAR)
def test_a_backward_not_linear_in_the_clip_factors_is_refused_at_small_factors(name, cfg, monkeypatch):
    """The second line: a lift past the structural rule (as if torch's own code) is seen at small factors."""
    from runner.methods.privacy_check import first_step as module

    monkeypatch.setattr(module, "user_functions", lambda losses: [])
    with pytest.raises(DprunError, match="not linear in the clip factors"):
        first_step(name, cfg, Lift)


@pytest.mark.parametrize("mode", ["bk", "twopass", "recompute"])
@pytest.mark.parametrize("fn", [Lift, BandLift, Linear], ids=lambda f: f.__name__)
def test_reweight_is_linear_by_construction_and_accepts_them(fn, mode):
    """reweight forms the sum from the recorded output-gradients of the unweighted loss (twopass and recompute in a
    second pass of that same backward): the lift never sees a factor, and each of the 16 examples adds at most C."""
    method = first_step("reweight", {"mode": mode}, fn)
    assert method._privacy_checked is not None
    released = float(torch.sqrt(sum(p.grad.double().square().sum() for p in method.model.parameters())))
    assert released <= 16 * (1 + 1e-6)


def test_torchs_own_functions_are_accepted_and_the_clip_restored():
    """torch.utils.checkpoint (non-reentrant) around a layer: torch's own code, accepted."""
    class Checkpointed(Net):
        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(self.fc1, x, use_reentrant=False)
            return self.fc2(torch.relu(h))
    assert first_step("reweight", {"mode": "twopass"}, Linear, build=Checkpointed).clip == 1.0


class PartialLift(MixGrad):
    """A backward without code of its own (a functools.partial): not trusted (review 18: 66 C)."""
    backward = staticmethod(functools.partial(lambda ctx, g, floor: band(g) + 0 * floor, floor=0.0))


@torch.library.custom_op("dprun_test::lift", mutates_args=())
def custom_lift(h: torch.Tensor) -> torch.Tensor:
    return h.clone()


@custom_lift.register_fake
def _(h):
    return torch.empty_like(h)


custom_lift.register_autograd(lambda ctx, g: band(g))  # torch generates the Function; the backward is ours (review 18)


class CustomOpNet(Net):
    def forward(self, x):
        return custom_lift(self.fc2(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("build", [lambda fn: Net(PartialLift), lambda fn: CustomOpNet(fn)],
                         ids=["partial_backward", "custom_op"])
@pytest.mark.parametrize("name,cfg", NOT_LINEAR[:2] + NOT_LINEAR[3:])
def test_a_backward_torch_runs_for_the_user_is_refused(name, cfg, build):
    with pytest.raises(DprunError, match=r"need not be \("):
        first_step(name, cfg, Linear, build=build)
