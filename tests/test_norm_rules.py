"""Each per-layer norm rule against a brute-force per-example oracle (one autograd call per example), float64.

For a layer, inputs x (B, ...) and random output-gradients G (B, ...): the oracle's per-example gradients are
autograd.grad(layer(x[i:i+1]), params, G[i:i+1]); the rule must give their squared norms (every `how`) and the
nu-weighted sum sum_i nu_i grad_i (book-keeping).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.errors import DprunError
from runner.norms import HOW, RULES, Recorder, outer, plan_model, rule_for

DT = torch.float64


def oracle(layer, x, G):
    """Per-example squared norms (B,) and {name: sum_i nu_i grad_i} for nu = 1/(i+1)."""
    params = {n: p for n, p in layer.named_parameters() if p.requires_grad}
    norms, sums = [], {n: torch.zeros_like(p) for n, p in params.items()}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(layer(x[i:i + 1]), list(params.values()), G[i:i + 1])
        norms.append(sum(g.pow(2).sum() for g in grads))
        for n, g in zip(params, grads):
            sums[n] += g / (i + 1)
    return torch.stack(norms), sums


def check_rule(layer, x, hows=HOW):
    layer = layer.to(DT)
    G = torch.randn_like(layer(x), dtype=DT)
    want_norms, want_sums = oracle(layer, x, G)
    rule = rule_for(layer)
    a, g = rule.sequence(layer, x, G)
    nu = 1.0 / torch.arange(1, x.shape[0] + 1, dtype=DT)
    for how in hows:
        for stash in (None, {}):  # two-pass (norms only) and book-keeping (per-example grads may be kept)
            got_norms = rule.norm_sq(layer, a, g, how, stash)
            torch.testing.assert_close(got_norms, want_norms, rtol=1e-9, atol=1e-10, msg=how)
            got = rule.clipped_sums(layer, a, g, nu, stash)
            assert set(got) == set(want_sums)
            for n in want_sums:
                torch.testing.assert_close(got[n], want_sums[n], rtol=1e-9, atol=1e-10, msg=f"{how} {n}")


def test_every_layer_family_is_registered():
    for t in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm):
        assert t in RULES


def test_lookup_is_by_exact_type():
    class MyLinear(nn.Linear):  # may override forward: must not silently inherit the Linear rule
        pass

    assert rule_for(MyLinear(2, 2)) is None
    with pytest.raises(DprunError, match=r"lin \(MyLinear\).*method=jl or method=multiloss"):
        plan_model(nn.ModuleDict({"lin": MyLinear(2, 2)}))


@pytest.mark.parametrize("shape", [(5, 4), (5, 3, 4), (5, 2, 3, 4), (1, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(shape, bias):
    check_rule(nn.Linear(4, 6, bias=bias), torch.randn(*shape, dtype=DT))


def test_linear_frozen_weight_covers_only_the_bias():
    lin = nn.Linear(4, 3)
    lin.weight.requires_grad_(False)
    check_rule(lin, torch.randn(4, 7, 4, dtype=DT))


CONV2D = [
    dict(),
    dict(stride=2, padding=1),
    dict(stride=(2, 1), padding=(0, 2), dilation=(2, 1)),
    dict(groups=2),
    dict(groups=2, stride=2, dilation=2, padding=2, bias=False),
    dict(padding="same", dilation=2),
    dict(padding=1, padding_mode="reflect"),
    dict(padding=1, padding_mode="circular", groups=2),
]


@pytest.mark.parametrize("kw", CONV2D, ids=str)
def test_conv2d(kw):
    check_rule(nn.Conv2d(4, 6, 3, **kw), torch.randn(3, 4, 9, 8, dtype=DT))


@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=2, dilation=2), dict(groups=3, padding="same"),
                                dict(padding=1, padding_mode="replicate", bias=False)], ids=str)
def test_conv1d(kw):
    check_rule(nn.Conv1d(3, 6, 3, **kw), torch.randn(4, 3, 11, dtype=DT))


def test_conv_picks_ghost_when_positions_are_few():
    assert outer.use_ghost(T=4, k=288, o=64, how="auto")  # deep layer, small feature map
    assert not outer.use_ghost(T=784, k=9, o=32, how="auto")  # first layer, large feature map
    assert outer.use_ghost(T=784, k=9, o=32, how="ghost") and not outer.use_ghost(4, 288, 64, "direct")
    # book-keeping (stash): direct also serves the clipped sum, ghost only when T^2 is small against k*o
    assert outer.use_ghost(T=28, k=128, o=512, how="auto", stash=True)  # an LSTM's h_proj
    assert not outer.use_ghost(T=256, k=200, o=800, how="auto", stash=True)  # a transformer's feed-forward


def test_embedding_repeated_tokens_and_padding():
    emb = nn.Embedding(6, 5, padding_idx=0)
    ids = torch.tensor([[1, 1, 2, 0, 0, 1], [3, 4, 5, 3, 0, 2], [0, 0, 0, 0, 0, 0], [5, 5, 5, 5, 5, 5]])
    check_rule(emb, ids)
    check_rule(nn.Embedding(6, 5), ids)  # no padding_idx: token 0 is a normal row


def test_embedding_sum_over_repeats_is_not_sum_of_norms():
    emb = nn.Embedding(3, 2).to(DT)
    ids = torch.tensor([[1, 1]])
    g = torch.ones(1, 2, 2, dtype=DT)
    a, gs = rule_for(emb).sequence(emb, ids, g)
    # one row gets gradient (1,1)+(1,1) = (2,2): squared norm 8 (summing norms would give 4)
    assert rule_for(emb).norm_sq(emb, a, gs, "auto").item() == pytest.approx(8.0)


def test_embedding_options_that_break_exactness_raise():
    """(sparse=True is refused for every private method: tests/test_privacy_validator.py)"""
    with pytest.raises(DprunError, match="emb"):
        plan_model(nn.ModuleDict({"emb": nn.Embedding(4, 2, scale_grad_by_freq=True)}))


@pytest.mark.parametrize("layer,shape", [
    (nn.LayerNorm(6), (4, 6)),
    (nn.LayerNorm(6), (4, 5, 6)),
    (nn.LayerNorm((3, 4)), (4, 2, 3, 4)),
    (nn.LayerNorm(6, bias=False), (4, 5, 6)),
    (nn.GroupNorm(2, 6), (4, 6, 3, 5)),
    (nn.GroupNorm(3, 6), (4, 6, 7)),
    (nn.RMSNorm(6), (4, 5, 6)),
], ids=lambda v: str(v) if isinstance(v, nn.Module) else str(v))
def test_normalization(layer, shape):
    with torch.no_grad():  # non-trivial affine parameters
        for p in layer.parameters():
            p.normal_()
    check_rule(layer, torch.randn(*shape, dtype=DT))


def test_ghost_equals_direct_on_random_sequences():
    a, g = torch.randn(5, 9, 7, dtype=DT), torch.randn(5, 9, 3, dtype=DT)
    torch.testing.assert_close(outer.norm_sq(a, g, "ghost"), outer.norm_sq(a, g, "direct"))


class Cell(nn.Module):
    """A tanh RNN whose h_proj is called once per step, forwards or backwards in time."""

    def __init__(self, reverse=False):
        super().__init__()
        self.x_proj, self.h_proj, self.reverse = nn.Linear(3, 4), nn.Linear(4, 4), reverse

    def forward(self, x):  # (B, T, 3)
        gx, h = self.x_proj(x), x.new_zeros(x.shape[0], 4)
        for t in (range(x.shape[1] - 1, -1, -1) if self.reverse else range(x.shape[1])):
            h = torch.tanh(gx[:, t] + self.h_proj(h))
        return h


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("how", HOW)
def test_module_called_per_time_step_has_one_gradient_summed_over_calls(reverse, how):
    cell = Cell(reverse).to(DT)
    x = torch.randn(4, 5, 3, dtype=DT)
    G = torch.randn(4, 4, dtype=DT)
    want = {}
    for path, module in (("x_proj", cell.x_proj), ("h_proj", cell.h_proj)):
        per = [torch.autograd.grad(cell(x[i:i + 1]), list(module.parameters()), G[i:i + 1]) for i in range(4)]
        want[path] = torch.stack([sum(g.pow(2).sum() for g in gs) for gs in per])
    with Recorder(plan_model(cell)) as rec:
        out = cell(x)
    rec.backprops((out * G).sum(), retain_graph=False)
    got = {path: rule.norm_sq(m, a, g, how) for path, m, rule, a, g in rec.layers()}
    assert rec.calls[id(cell.h_proj)].__len__() == 5
    for path in want:
        torch.testing.assert_close(got[path], want[path], rtol=1e-9, atol=1e-12)


def test_in_place_change_of_a_recorded_output_raises():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    with Recorder(plan_model(model)) as rec:
        out = model(torch.randn(2, 3))
    rec.backprops(out.sum(), retain_graph=False)
    with pytest.raises(DprunError, match=r"0 \(Linear\).*in place"):
        list(rec.layers())


def test_embedding_norm_has_fixed_shapes_so_nothing_is_read_back_from_the_device():
    """torch.unique has a data-dependent output size (a host sync on CUDA, which keeps CUDA graphs from capturing
    the step); the rule's segment sum uses a sort instead. Proof: it runs on the meta device, where tensors have
    shapes but no values, so no op can depend on a value."""
    layer = nn.Embedding(7, 3, padding_idx=0).to(DT)
    rule = rule_for(layer)
    x = torch.tensor([[1, 2, 2, 0], [3, 3, 3, 6]])
    G = torch.randn(2, 4, 3, dtype=DT)
    a, g = rule.sequence(layer, x, G)
    want, _ = oracle(layer, x, G)
    torch.testing.assert_close(rule.norm_sq(layer, a, g, "direct"), want)
    meta = rule.norm_sq(layer.to("meta"), a.to("meta"), g.to("meta"), "direct")
    assert meta.device.type == "meta" and meta.shape == (2,)
