"""The contract every registered method passes, used as a library (no runner/train.py): attach validates and
prepares, step handles the empty batch and reports a mechanism the method's default accountant supports."""
from pathlib import Path

import pytest
import torch
from torch import nn

from runner import accountants
from runner.accountants.mechanisms import NoPrivacy
from runner.data.base import DataInfo, Dataset
from runner.errors import DprunError
from runner.methods import METHODS
from runner.models import MODELS
from runner.train import per_example_cross_entropy as loss_fn

CONF = Path(__file__).resolve().parents[1] / "conf" / "method"
INFO = DataInfo("tiny", (1, 2, 3), 3, train_size=24, test_size=24)
B = 6


def tiny():
    """A small MLP (every method trains it; DP-SBCD only trains model=mlp) and its dataset."""
    torch.manual_seed(0)
    x, y = torch.randn(24, 1, 2, 3), torch.randint(0, 3, (24,))
    return MODELS.build("mlp", INFO, depth=1, widths=(5,)), Dataset(INFO, x, y, x, y)


def build(name):
    if name == "opacus":
        pytest.importorskip("opacus")
    return METHODS.build(name, cfg={}, clip=1.0, sigma=1.0)


def step(method, model, x, y, idx):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return method.step(model, loss_fn, x, y, opt, sample_rate=B / 24, expected_batch_size=float(B), indices=idx)


def test_every_config_is_a_registered_method_and_back():
    assert {p.stem for p in CONF.glob("*.yaml")} == set(METHODS.names())


@pytest.mark.parametrize("name", METHODS.names())
def test_shapes_and_the_default_accountant(name):
    model, data = tiny()
    method = build(name)
    model = method.attach(model, data)
    idx = torch.arange(B)
    out = step(method, model, data.train_x[idx], data.train_y[idx], idx)
    assert out.losses.shape == (B,) and out.outputs.shape == (B, 3)
    assert out.norms is None or out.norms.shape == (B,)
    assert (out.norms is not None) == (method.private and name != "sbcd")  # sbcd clips no per-example gradient
    if not method.private:
        assert isinstance(out.mechanism, NoPrivacy) and method.default_accountant == "none"
        return
    acc = accountants.build(method.default_accountant)
    assert acc.supports(out.mechanism) and acc.supports(method.mechanism(B / 24))
    acc.step(out.mechanism)
    assert acc.epsilon(1e-5) > 0


@pytest.mark.parametrize("name", METHODS.names())
def test_empty_batch(name):
    model, data = tiny()
    method = build(name)
    model = method.attach(model, data)
    before = [p.detach().clone() for p in model.parameters()]
    x, y, idx = data.train_x[:0], data.train_y[:0], torch.arange(0)
    if method.sampling is not None:  # a sampling that never yields an empty batch (sbcd: fixed batches)
        with pytest.raises(DprunError, match="empty batch"):
            step(method, model, x, y, idx)
        return
    out = step(method, model, x, y, idx)
    assert out.losses.shape == (0,) and out.outputs is None
    assert out.norms is None if not method.private else out.norms.shape == (0,)
    moved = any(not torch.equal(p0, p.detach()) for p0, p in zip(before, model.parameters()))
    assert moved == method.private  # private: the noisy update still happens; non-private: nothing to do


@pytest.mark.parametrize("name", [n for n in METHODS.names() if METHODS.get(n).private])
def test_batchnorm_refused_in_one_line(name):
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    method = build(name)
    with pytest.raises(DprunError, match=r"^2 \(BatchNorm1d\).*GroupNorm") as e:
        method.attach(model, tiny()[1])
    assert "\n" not in str(e.value)
    with pytest.raises(DprunError, match="method.attach") as e:  # stepping a model attach never saw: refused too
        step(method, model, torch.randn(B, 1, 2, 3), torch.zeros(B, dtype=torch.long), torch.arange(B))
    assert "\n" not in str(e.value)


def test_batchnorm_is_fine_without_privacy():
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    assert METHODS.build("nonprivate").attach(model) is model


@pytest.mark.parametrize("name", METHODS.names())
def test_unknown_constructor_arguments_are_refused_not_dropped(name):
    """r= (now method.r) or any misspelt knob given to the constructor must not be silently ignored."""
    with pytest.raises(DprunError, match="unknown argument"):
        METHODS.build(name, cfg={}, clip=1.0, sigma=1.0, r=4)


@pytest.mark.parametrize("name,key", [("reweight", "mode"), ("reweight", "norm"), ("jl", "jvp"),
                                      ("opacus", "grad_sample_mode"), ("sbcd", "reg"), ("sbcd", "normalisation")])
def test_an_unknown_option_value_is_one_line_naming_the_valid_ones(name, key):
    """Method.choice: every option with fixed values says the same thing, from the constructor or attach."""
    if name == "opacus":
        pytest.importorskip("opacus")
    model, data = tiny()
    with pytest.raises(DprunError, match=rf"^unknown method\.{key} 'bogus' for method={name}; valid: \w+(, \w+)+$"):
        METHODS.build(name, cfg={key: "bogus"}, clip=1.0, sigma=1.0).attach(model, data)


@pytest.mark.parametrize("name", [n for n in METHODS.names() if METHODS.get(n).private])
def test_an_uninitialised_lazy_module_is_refused_in_one_line(name):
    """nn.LazyLinear before its first forward raised torch's ValueError at attach (opacus) or at the step
    (multiloss, jl); reweight said it had no norm rule. Once a forward has set its shapes it is a Linear."""
    model = nn.Sequential(nn.Flatten(), nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 3))
    with pytest.raises(DprunError, match=rf"^1 \(LazyLinear\) cannot be trained with method={name}: its parameters "
                                         rf"are not initialised yet \(a lazy module\); run one forward first") as e:
        build(name).attach(model, tiny()[1])
    assert "\n" not in str(e.value)
    model(torch.zeros(1, 1, 2, 3))  # initialised: the module is now an nn.Linear
    if name == "sbcd":
        return  # (it trains only its own MLP)
    method = build(name)
    model = method.attach(model, tiny()[1])
    out = step(method, model, torch.randn(B, 1, 2, 3), torch.zeros(B, dtype=torch.long), torch.arange(B))
    assert out.losses.shape == (B,)


def test_nonprivate_takes_an_uninitialised_lazy_module():
    """No norm to form: the first forward sets the shapes."""
    model = nn.Sequential(nn.Flatten(), nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 3))
    method = METHODS.build("nonprivate")
    model = method.attach(model, tiny()[1])
    step(method, model, torch.randn(B, 1, 2, 3), torch.zeros(B, dtype=torch.long), torch.arange(B))
    assert model[1].weight.shape == (4, 6)
