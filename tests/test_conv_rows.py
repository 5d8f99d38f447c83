"""runner/norms/conv.py per_example_by_rows: book-keeping's kept per-example conv gradients formed row by row, without
the unfolded input (CPU). They equal autograd's per-example weight gradients for strides, padding modes, 'same',
rectangular kernels, Conv1d and channels-last records; ConvRule.records_norm_sq takes the route only where the kept
route applies (one group, no dilation, float32/64, a kept G_i, T > 1, not ghost) and its bound is that of what the
clipped sums add; the lean recorder uses it (no unfolded input in the step) and the step equals the nxbp oracle."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.methods import METHODS
from runner.norms import conv, outer
from runner.norms.certify import add_sqnorm_, upper_sqnorm
from runner.norms.keep_budget import KeepBudget
from runner.norms.outer import Stash

CASES = [  # (layer, input shape): the routes' shapes, one group, no dilation
    (nn.Conv2d(1, 16, 8, stride=2), (5, 1, 34, 34)),  # bu_cnn's conv1 after its padding layer
    (nn.Conv2d(3, 4, 3, padding=1), (3, 3, 9, 11)),
    (nn.Conv2d(2, 5, (2, 3), stride=(2, 1), padding=2, padding_mode="reflect"), (2, 2, 7, 6)),
    (nn.Conv2d(2, 3, 4, padding="same", padding_mode="circular"), (3, 2, 6, 5)),
    (nn.Conv2d(4, 3, 5, stride=3, padding=(1, 2), bias=False), (2, 4, 11, 9)),
    (nn.Conv1d(3, 5, 4, stride=3, padding=1, padding_mode="replicate"), (4, 3, 20)),
    (nn.Conv1d(2, 3, 3, padding="same"), (3, 2, 7)),
]


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """The route at these small sizes (on a step it starts above conv.ROWS_FLOOR_BYTES of unfolded input)."""
    monkeypatch.setattr(conv, "ROWS_FLOOR_BYTES", 0)


def per_example_autograd(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(B, *weight.shape) each example's weight gradient of sum(layer(x_i) * g_i), one backward per example."""
    out = []
    for i in range(len(x)):
        (gw,) = torch.autograd.grad((layer(x[i:i + 1]) * g[i:i + 1]).sum(), layer.weight)
        out.append(gw)
    return torch.stack(out)


def records(layer: nn.Module, shape: tuple, channels_last: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    layer = layer.double()
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        g = torch.randn_like(layer(x))
    if channels_last:
        layer = layer.to(memory_format=torch.channels_last)
        x, g = x.contiguous(memory_format=torch.channels_last), g.contiguous(memory_format=torch.channels_last)
    return layer, x, g


LAYOUTS = [(i, False) for i in range(len(CASES))] + [(i, True) for i, (_, s) in enumerate(CASES) if len(s) == 4]


@pytest.mark.parametrize("case,channels_last", LAYOUTS, ids=[f"{i}-{'cl' if c else 'nchw'}" for i, c in LAYOUTS])
def test_rows_give_autograds_per_example_gradients(case, channels_last):
    layer, shape = CASES[case]
    layer, x, g = records(layer, shape, channels_last)
    assert conv.by_rows(layer, x)
    G = conv.per_example_by_rows(layer, x, g)  # (B, C_out, k) in (kh, kw, c) order
    assert G.shape == (len(x), layer.out_channels, layer.weight[0].numel())
    ours = torch.stack([conv.weight_order(layer, G[i]) for i in range(len(x))])
    torch.testing.assert_close(ours, per_example_autograd(layer, x, g), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layer,shape", CASES, ids=range(len(CASES)))
def test_records_norm_sq_keeps_what_it_measured(layer, shape):
    """The bound is the kept tensors' own (upper_sqnorm, plus the bias's per-example sums), and the stash holds them
    for the clipped sums: the weight's per example (B, C_out, k), the bias's (B, C_out)."""
    layer, x, g = records(layer, shape)
    stash = Stash(1e9)
    bound = conv.ConvRule().records_norm_sq(layer, x, g, "auto", stash)
    T, k, o = g[0, 0].numel(), layer.weight[0].numel(), layer.out_channels
    if outer.use_ghost(T, k, o, "auto", stash=True):  # the Gram route is cheaper there: sequence, then norm_sq
        assert bound is None and not stash
        bound = conv.ConvRule().records_norm_sq(layer, x, g, "direct", stash)  # method.norm=direct
    assert bound is not None
    expected = upper_sqnorm(stash["weight"])
    torch.testing.assert_close(stash["weight"], conv.per_example_by_rows(layer, x, g), rtol=0, atol=0)
    if layer.bias is not None:
        torch.testing.assert_close(stash["bias"], g.flatten(2).sum(2), rtol=0, atol=0)
        expected = add_sqnorm_(expected, stash["bias"])
    else:
        assert "bias" not in stash
    torch.testing.assert_close(bound, expected, rtol=0, atol=0)
    true = per_example_autograd(layer, x, g).flatten(1).square().sum(1)
    if layer.bias is not None:
        true = true + g.flatten(2).sum(2).square().sum(1)
    assert (bound >= true).all()


def test_records_norm_sq_declines_where_the_kept_route_does_not_apply(monkeypatch):
    rule = conv.ConvRule()
    layer, x, g = records(nn.Conv2d(3, 4, 3, padding=1), (3, 3, 9, 11))
    assert rule.records_norm_sq(layer, x, g, "auto", Stash(1e9)) is not None
    assert rule.records_norm_sq(layer, x, g, "auto", None) is None  # two-pass: nothing kept
    assert rule.records_norm_sq(layer, x, g, "auto", Stash(0)) is None  # method.keep=0
    assert rule.records_norm_sq(layer, x, g, "ghost", Stash(1e9)) is None  # method.norm=ghost
    assert rule.records_norm_sq(layer.float(), x.float().bfloat16(), g.float().bfloat16(), "auto",
                                Stash(1e9)) is None  # bf16 records: the tensor-core or upcast route
    grouped, xg, gg = records(nn.Conv2d(4, 4, 3, groups=2), (2, 4, 7, 7))
    assert rule.records_norm_sq(grouped, xg, gg, "auto", Stash(1e9)) is None
    dilated, xd, gd = records(nn.Conv2d(2, 3, 3, dilation=2), (2, 2, 9, 9))
    assert rule.records_norm_sq(dilated, xd, gd, "auto", Stash(1e9)) is None
    one_position, x1, g1 = records(nn.Conv2d(2, 3, 5), (2, 2, 5, 5))  # T = 1: the rank-one rule
    assert rule.records_norm_sq(one_position, x1, g1, "auto", Stash(1e9)) is None
    monkeypatch.setattr(conv, "ROWS_FLOOR_BYTES", 3 * 99 * 27 * 8)  # the unfolded input's bytes: at the floor, not above
    assert rule.records_norm_sq(layer, x, g, "auto", Stash(1e9)) is None
    monkeypatch.setattr(conv, "ROWS_FLOOR_BYTES", 3 * 99 * 27 * 8 - 1)
    assert rule.records_norm_sq(layer, x, g, "auto", Stash(1e9)) is not None
    # a method.keep_mb budget is asked once per layer: not by a route that then declines (norm_sq asks next)
    budget = KeepBudget(megabytes=100)
    budget.begin_step()
    monkeypatch.setattr(conv, "ROWS_FLOOR_BYTES", 2**40)
    big = nn.Conv2d(3, 40, 3, padding=1).double()  # T = 16: o*k = 1080 > T*(k+o) = 1072, a cost the budget counts
    xb, gb = records(big, (3, 3, 4, 4))[1:]
    budgeted = Stash(budget, key="big")
    assert rule.records_norm_sq(big, xb, gb, "direct", budgeted) is None and budget.used == 0
    monkeypatch.setattr(conv, "ROWS_FLOOR_BYTES", 0)
    frozen, xf, gf = records(nn.Conv2d(3, 4, 3), (2, 3, 6, 6))
    frozen.weight.requires_grad_(False)
    assert rule.records_norm_sq(frozen, xf, gf, "auto", Stash(1e9)) is None
    # the keep rule decides as on norm_sq's route: bu_cnn's conv2 (ratio 1.138) is not kept at keep=1.1
    conv2, x2, g2 = records(nn.Conv2d(16, 32, 4, stride=2), (2, 16, 13, 13))
    assert not outer.keeps(25, 256, 32) and rule.records_norm_sq(conv2, x2, g2, "auto", Stash()) is None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 6, 3, stride=2, padding=1)  # T = 9, k = 18, o = 6: kept, direct
        self.head = nn.Linear(6 * 9, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.stem(x)).flatten(1))


def test_the_bk_step_takes_the_rows_route_and_equals_the_oracle(monkeypatch):
    """No unfolded input for the stem in book-keeping's step (ConvRule.sequence is never called), and its clipped sum
    equals the per-example oracle's (nxbp), norms and gradients."""
    torch.manual_seed(0)
    model = Net().double()
    x, y = torch.randn(7, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
    x[3] *= 40  # a clipped example beside unclipped ones

    def loss_fn(out, target):
        return nn.functional.cross_entropy(out, target, reduction="none")

    def step(method):
        model.zero_grad()
        method.prepare(model)
        result = method.clipped_sum(model, loss_fn, x, y)
        return result.norms, [p.grad.clone() for p in model.parameters()]

    oracle = step(METHODS.build("nxbp", clip=1.0, sigma=0.0))
    calls = []
    sequence = conv.ConvRule.sequence
    monkeypatch.setattr(conv.ConvRule, "sequence", lambda self, *a: calls.append(1) or sequence(self, *a))
    norms, grads = step(METHODS.build("reweight", clip=1.0, sigma=0.0))
    assert calls == []
    torch.testing.assert_close(norms, oracle[0], rtol=1e-6, atol=0)
    for ours, theirs in zip(grads, oracle[1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12)
