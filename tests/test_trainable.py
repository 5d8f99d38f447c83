"""runner/trainable.py: the same list as [p for p in model.parameters() if p.requires_grad], same order, for every
model dprun builds and for the cases a walk of its own could get wrong (tied weights, a module in two places, None
entries, frozen parameters, a class that overrides parameters())."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.bench.common import CIFAR10, IMDB, MNIST
from runner.models import MODELS
from runner.trainable import trainable, trainable_ids


def reference(model: nn.Module) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def same(model: nn.Module) -> None:
    got, want = trainable(model), reference(model)
    assert [id(p) for p in got] == [id(p) for p in want]
    assert trainable_ids(model) == frozenset(id(p) for p in want)


@pytest.mark.parametrize("name,info", [("cnn", MNIST), ("bu_cnn", MNIST), ("mlp", MNIST), ("lstm", MNIST),
                                       ("transformer", IMDB), ("resnet18", CIFAR10), ("vgg11", CIFAR10)])
def test_every_built_model_lists_the_same_parameters_in_the_same_order(name, info):
    torch.manual_seed(0)
    same(MODELS.build(name, info))


class Awkward(nn.Module):
    """Tied weights, one module registered twice, a None parameter and a None submodule, a frozen layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.again = self.block  # the same module under two names
        self.head = nn.Linear(4, 10)
        self.head.weight = self.embed.weight  # tied
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.register_parameter("nothing", None)
        self.register_module("absent", None)
        self.scale = nn.Parameter(torch.ones(()))


def test_tied_weights_shared_modules_none_entries_and_frozen_layers():
    model = Awkward()
    same(model)
    model.block[0].bias.requires_grad_(False)
    same(model)
    # scale (own), embed (tied with head.weight), the Linear weight (its bias frozen now), LayerNorm weight and bias,
    # head bias: 6
    assert len(trainable(model)) == len(reference(model)) == 6


class OwnParameters(nn.Module):
    """A class that decides its own parameters(): its answer is kept."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def parameters(self, recurse: bool = True):
        return iter([self.b.weight])


def test_a_class_overriding_parameters_keeps_its_own_answer():
    model = OwnParameters()
    assert [id(p) for p in trainable(model)] == [id(model.b.weight)]


class HidesItsChild(nn.Module):
    """A submodule whose named_modules() leaves out its child: parameters() (which asks it) does not list the child's
    weight, and neither may trainable()."""

    def __init__(self):
        super().__init__()
        self.kept, self.hidden = nn.Linear(2, 2), nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self
        yield from self.kept.named_modules(memo, prefix + ".kept", remove_duplicate)


def test_a_submodule_overriding_named_modules_keeps_its_answer():
    model = nn.Sequential(nn.Linear(2, 2), HidesItsChild())
    same(model)
    assert len(trainable(model)) == 4  # the first Linear's and `kept`'s weight and bias, not `hidden`'s


def test_a_step_walks_the_modules_twice_and_a_frozen_layer_between_steps_is_seen(monkeypatch):
    """Method.trainable: a reweight step walks the model once at its start (clipped sum, coverage check and noise
    share it) and once at its end (the check that nothing changed midway): a host-bound small step paid ~12 us a
    walk, five a step. The memo lives for one step only: a layer frozen between steps is refused at the next one
    (its parameters leave the covered set: the plan is rebuilt) and its parameter gets no noise."""
    import torch.nn.functional as F

    import runner.methods.base as base
    import runner.methods.noise as noise
    import runner.norms.coverage as coverage
    import runner.trainable as walk
    from runner.methods import METHODS

    walks, original = [], walk.trainable
    counted = lambda model: (walks.append(1), original(model))[1]  # noqa: E731
    for module in (base, noise, walk):
        monkeypatch.setattr(module, "trainable", counted)
    monkeypatch.setattr(coverage, "trainable_ids", lambda model: frozenset(id(p) for p in counted(model)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=1.0)
    model = method.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    step = lambda: method.step(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y, opt,  # noqa: E731
                               sample_rate=0.1, expected_batch_size=5.0)
    step()
    walks.clear()
    step()
    assert len(walks) == 2, len(walks)
    assert method._walked is None
    model[0].weight.requires_grad_(False)
    before = model[0].weight.detach().clone()
    step()
    assert model[0].weight.grad is None and torch.equal(model[0].weight, before)
    assert model[2].weight.grad is not None
