"""make_private's user path after reviews 14 and 15: one ledger per weight, not only per module; x and y of the same
examples; the numbers named when they are not numbers."""
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dprun
from runner.errors import DprunError


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def data(n=200):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def make(model, x, y, **kw):
    return dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y),
                              **{"noise_multiplier": 1.0, "max_grad_norm": 1.0, "batch_size": 20, "seed": 1, **kw})


def test_new_modules_over_trained_parameters_keep_the_first_ledger():
    """Review 14: a new module tree holding the very Parameter objects a PrivateTraining trained got a second ledger
    at epsilon 0 (60 private steps on the weights, 30 in each ledger)."""
    x, y = data()
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    first = make(model, x, y)
    xb, yb = next(iter(first.batches()))
    first.step(xb, yb, loss_fn)
    twin = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    twin[0].weight, twin[0].bias, twin[2].weight, twin[2].bias = (model[0].weight, model[0].bias, model[2].weight,
                                                                  model[2].bias)
    with pytest.raises(DprunError, match="already trained 1 private steps"):
        make(twin, x, y)
    make(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), x, y)  # fresh weights: a ledger of their own
    make(twin, x, y, method="nonprivate")  # publishes epsilon inf: allowed


def test_x_and_y_of_different_lengths_are_refused():
    """Review 15: x of 512 rows with y of 100 trained on x's first 100 rows, the other 412 never used, silently."""
    x, y = data(512)
    with pytest.raises(DprunError, match=r"^data \(x, y\) must hold the same examples: x has 512 rows, y 100$"):
        make(nn.Linear(5, 3), x, y[:100])


BAD_NUMBERS = ([("batch_size", v, rf"^batch_size={re.escape(repr(v))} is not ")  # review 15: 2.5 trained at 2
                for v in (2.5, 0, -3, float("inf"), float("nan"), True, "abc")]
               + [(name, "abc", rf"^{name}='abc' is not a number$") for name in ("noise_multiplier", "max_grad_norm")]
               + [("delta", v, r"^delta=.* is not (valid: a probability in \(0, 1\)|a number)")  # delta=2 was taken,
                  for v in (2, 1.0, 0, -1e-5, float("nan"), "abc")])  # warned about as weak, refused at get_epsilon


@pytest.mark.parametrize("name,value,message", BAD_NUMBERS)
def test_a_bad_number_is_refused_in_one_line_at_make_private(name, value, message):
    x, y = data()
    with pytest.raises(DprunError, match=message):
        make(nn.Linear(5, 3), x, y, **{name: value})


def test_a_whole_float_batch_size_is_taken():
    x, y = data()
    assert make(nn.Linear(5, 3), x, y, batch_size=20.0).expected_batch_size == 20


def test_delta_none_is_still_allowed():
    x, y = data()
    assert make(nn.Linear(5, 3), x, y, delta=None) is not None
