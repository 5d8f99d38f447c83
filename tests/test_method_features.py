"""What a method can be asked to do is a typed capability (runner/methods/features.py), and each method keeps its own
World (the ranks and forward_rng's step count), never one shared by every method."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.distributed import World
from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.features import Feature


@pytest.mark.parametrize("name", METHODS.names())
def test_a_capability_is_a_feature_never_a_string(name):
    method = METHODS.build(name)
    for feature in Feature:  # every method's hook answers every Feature: a reason or None
        assert method.why_not(feature) is None or isinstance(method.why_not(feature), str)
    with pytest.raises(TypeError, match="Feature"):  # a misspelt or string key is an error, not "supported"
        method.why_not("precision=bf16")


def test_configure_refuses_by_feature_with_the_users_words():
    sbcd = METHODS.build("sbcd")
    assert all(sbcd.why_not(f) for f in Feature)  # it supports none of them
    with pytest.raises(DprunError, match=r"^method=sbcd cannot run with physical_batch_size: "):
        sbcd.configure(physical_batch_size=4)
    with pytest.raises(DprunError, match=r"^method=sbcd cannot run with precision=bf16: "):
        sbcd.configure(precision="bf16")


def test_each_method_has_its_own_world():
    a, b = METHODS.build("nxbp"), METHODS.build("nxbp")
    assert a.world is not b.world and a.world == World()
    model = a.attach(nn.Linear(3, 2))
    a.step(model, lambda out, y: F.cross_entropy(out, y, reduction="none"), torch.randn(4, 3),
           torch.tensor([0, 1, 0, 1]), torch.optim.SGD(model.parameters(), lr=0.1), sample_rate=0.5,
           expected_batch_size=4.0)
    assert a.world.steps == 1 and b.world.steps == 0 and World().steps == 0  # forward_rng counted a's step only
