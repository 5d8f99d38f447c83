"""method=jl (DP-SGD-JL / DP-Adam-JL): projections, norm-estimate distribution, clipped sum, mechanism, fallback.

The oracle is nxBP's one-backward-per-example gradient (per_example_grads below; its norms are checked against
NxBP.privatize's), in float64.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from runner import accountants, models
from runner.accountants import ACCOUNTANTS, SubsampledGaussian, SubsampledJL, UnsupportedMechanism
from runner.data.base import DataInfo
from runner.errors import DprunError
from runner.methods import METHODS, clip_factors
from runner.methods.jl import JL, double_vjp_projections, draw_directions, forward_projections, trainable_params
from runner.methods.nxbp import NxBP

PROJECTORS = {"forward": forward_projections, "double_vjp": double_vjp_projections}


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")  # (B,)


class TorchLSTM(nn.Module):
    """A stock (fused) torch.nn.LSTM classifier: no norm rule covers it, JL must not care."""

    def __init__(self, vocab=20, embed=6, hidden=5, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, x):  # (B, T) ids
        _, (h, _) = self.lstm(self.embed(x))  # h (2, B, hidden)
        return self.fc(torch.cat([h[0], h[1]], -1))  # (B, classes)


class UserSDPA(nn.Module):
    """A model of a user's own that calls F.scaled_dot_product_attention: its fused CPU kernel has no forward-mode
    or double-backward formula; jl runs it under composite_attention (runner/models/attention.py)."""

    def __init__(self, vocab=20, embed=6, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.qkv = nn.Linear(embed, 3 * embed)
        self.fc = nn.Linear(embed, classes)

    def forward(self, x):  # (B, T) ids
        q, k, v = self.qkv(self.embed(x)).unsqueeze(1).chunk(3, -1)  # each (B, 1, T, embed)
        return self.fc(F.scaled_dot_product_attention(q, k, v).mean((1, 2)))  # (B, classes)


IMAGE = DataInfo("img", (1, 8, 8), 3, "image", None, 100, 10)
CIFAR = DataInfo("cifar", (3, 32, 32), 3, "image", None, 100, 10)
TEXT = DataInfo("txt", (7,), 3, "text", 20, 100, 10)
MODELS = {
    "mlp": lambda: models.build("mlp", IMAGE, widths=(6, 5)),
    "cnn": lambda: models.build("bu_cnn", DataInfo("mn", (1, 28, 28), 3, "image", None, 100, 10), widths=(2, 3),
                                hidden=4),
    "papernot_cnn": lambda: models.build("papernot_cnn", CIFAR, last_width=8),
    "gru": lambda: models.build("gru", IMAGE, hidden=4),
    "bilstm": lambda: models.build("bilstm", TEXT, hidden=4, embed_dim=5, dense=4),
    "transformer": lambda: models.build("transformer", TEXT, d_model=8, heads=2, ff=8, dropout=0.0),
    "torch_lstm": TorchLSTM,
    "user_sdpa": UserSDPA,
}


def batch(info_or_model: str, B: int = 4):
    g = torch.Generator().manual_seed(1)
    if info_or_model in ("bilstm", "transformer", "torch_lstm", "user_sdpa"):
        x = torch.randint(0, 20, (B, 7), generator=g)
    elif info_or_model == "cnn":
        x = torch.randn(B, 1, 28, 28, generator=g, dtype=torch.float64)
    elif info_or_model == "papernot_cnn":
        x = torch.randn(B, 3, 32, 32, generator=g, dtype=torch.float64)
    else:
        x = torch.randn(B, 1, 8, 8, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (B,), generator=g)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().double()


def per_example_grads(model, x, y) -> dict[str, torch.Tensor]:
    """nxBP's per-example gradients, name -> (B, *p.shape), one backward per example."""
    params = trainable_params(model)
    rows = []
    for i in range(len(y)):
        loss = loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum()
        rows.append(torch.autograd.grad(loss, list(params.values()), allow_unused=True))
    return {n: torch.stack([torch.zeros_like(p) if r[k] is None else r[k] for r in rows])
            for k, (n, p) in enumerate(params.items())}


def flat(grads: dict[str, torch.Tensor], B: int) -> torch.Tensor:
    return torch.cat([g.reshape(B, -1) for g in grads.values()], 1)  # (B, d)


@pytest.mark.parametrize("mode", ["forward", "double_vjp"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "papernot_cnn" else n
                                  for n in MODELS])
def test_projections_equal_inner_products_with_per_example_grads(name, mode):
    from runner.methods.centred_norms import centre_spatial_norms

    model = build(name)
    centre_spatial_norms(model)  # as jl's prepare: a normalisation kernel left in the graph is refused
    x, y = batch(name)
    torch.manual_seed(3)
    V = draw_directions(trainable_params(model), 3)  # name -> (3, *p.shape)
    losses, _, P, _ = PROJECTORS[mode](model, loss_fn, x, y, V, chunk=2)  # chunks of 2 and 1 directions
    G = flat(per_example_grads(model, x, y), len(y))  # (B, d)
    Vf = torch.cat([v.reshape(3, -1) for v in V.values()], 1)  # (3, d)
    assert P.shape == (len(y), 3)
    torch.testing.assert_close(P, G @ Vf.T, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(losses, loss_fn(model(x), y))


def test_per_example_oracle_matches_nxbp_norms():
    model = build("bilstm")
    x, y = batch("bilstm")
    norms = flat(per_example_grads(model, x, y), len(y)).norm(dim=1)
    torch.testing.assert_close(norms, NxBP(clip=1.0).privatize(model, loss_fn, x, y).norms)


@pytest.mark.parametrize("mode", ["forward", "double_vjp"])
@pytest.mark.parametrize("name", ["cnn", "bilstm", "torch_lstm"])
def test_grad_is_clipped_sum_with_the_estimated_factors(name, mode):
    model = build(name)
    x, y = batch(name)
    G = per_example_grads(model, x, y)
    clip = 0.5 * float(flat(G, len(y)).norm(dim=1).median())  # some examples clipped, some not
    method = METHODS.build("jl", cfg={"jvp": mode, "r": 4}, clip=clip, sigma=1.0)
    out = method.privatize(model, loss_fn, x, y)
    nu = clip_factors(out.norms, clip)  # (B,)
    assert (nu < 1).any()
    for n, p in trainable_params(model).items():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", nu, G[n]), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("r", [1, 4])
def test_norm_estimate_follows_scaled_chi_square(r):
    """M_i^2 / ||g_i||^2 ~ chi^2_r / r: 8 examples x 300 independent draws, from one vmap call over 2400 r
    directions (example i uses only the i-th block of 300 groups of r, so all 2400 ratios are independent)."""
    model = build("mlp")
    x, y = batch("mlp", B=8)
    exact = flat(per_example_grads(model, x, y), 8).norm(dim=1)  # (B,)
    torch.manual_seed(123)
    V = draw_directions(trainable_params(model), 8 * 300 * r)
    _, _, P, _ = forward_projections(model, loss_fn, x, y, V)  # (B, 2400 r)
    M = P.reshape(8, 8, 300, r).pow(2).mean(3).sqrt()  # (B, block, 300): JL's estimate per group of r
    M = M[torch.arange(8), torch.arange(8)]  # (B, 300): example i, block i
    ratios = (M / exact[:, None]).pow(2).flatten().numpy()
    assert stats.kstest(ratios, stats.chi2(df=r, scale=1 / r).cdf).pvalue > 1e-3
    wrong = stats.chi2(df=2 * r, scale=1 / (2 * r))  # the test has power: twice the dimension is rejected
    assert stats.kstest(ratios, wrong.cdf).pvalue < 1e-6


def test_large_r_approaches_exact_clipping():
    model = build("mlp")
    x, y = batch("mlp", B=8)
    exact = flat(per_example_grads(model, x, y), 8).norm(dim=1)
    clip = float(exact.median())
    torch.manual_seed(0)
    est = {r: JL(cfg={"r": r}, clip=clip).privatize(model, loss_fn, x, y).norms for r in (1, 3000)}
    err = {r: (clip_factors(m, clip) - clip_factors(exact, clip)).abs().max().item() for r, m in est.items()}
    assert err[3000] < 0.06  # sd of sqrt(chi^2_r / r) ~ 1/sqrt(2r) = 0.013
    assert err[3000] < err[1]


def test_dropout_mask_shared_by_projections_chunks_and_backward():
    """In train mode with dropout, the coordinate directions give P = the per-example gradients under the step's
    mask; the .grad left by the backward must be their nu-weighted sum (same mask), chunked or not."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.5), nn.Tanh(), nn.Linear(4, 3)).double().train()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    params = trainable_params(model)
    d = sum(p.numel() for p in params.values())
    eye, start, V = torch.eye(d, dtype=torch.float64), 0, {}
    for n, p in params.items():  # coordinate directions: v_j = e_j
        V[n] = eye[:, start:start + p.numel()].reshape(d, *p.shape)
        start += p.numel()
    results = []
    for chunk in (0, 1, 7, 38):  # d = 39: one vmap; 39 dual passes; 6 vmaps; a vmap then a dual pass
        torch.manual_seed(42)
        losses, _, P, backward = forward_projections(model, loss_fn, x, y, V, chunk=chunk)  # P (B, d): grads
        nu = clip_factors(P.norm(dim=1), 0.3)
        got = torch.cat([g.reshape(-1) for g in backward(nu).values()])
        torch.testing.assert_close(got, nu @ P)
        results.append(P)
    for P in results[1:]:
        torch.testing.assert_close(P, results[0])


class NoForwardAD(torch.autograd.Function):
    """tanh with a backward but no forward-mode formula (like CPU nn.LSTM's mkldnn kernel in float32)."""

    @staticmethod
    def forward(ctx, x):
        out = torch.tanh(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * (1 - out * out)


class NoJvpNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(NoForwardAD.apply(self.a(x)))


def test_auto_falls_back_to_double_vjp_once(caplog):
    torch.manual_seed(0)
    model = NoJvpNet().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    with pytest.raises((NotImplementedError, RuntimeError)):
        JL(cfg={"jvp": "forward", "r": 2}).privatize(model, loss_fn, x, y)
    method = JL(cfg={"jvp": "auto", "r": 2}, clip=1e6)
    with caplog.at_level(logging.WARNING, logger="dprun"):
        for _ in range(3):
            for p in model.parameters():
                p.grad = None
            method.privatize(model, loss_fn, x, y)
    assert method.active == "double_vjp"
    assert sum("double_vjp" in rec.getMessage() for rec in caplog.records) == 1
    G = per_example_grads(model, x, y)
    for n, p in trainable_params(model).items():  # clip 1e6: nothing clipped, .grad = sum of gradients
        torch.testing.assert_close(p.grad, G[n].sum(0))


def test_stock_lstm_float32_runs_under_auto():
    torch.manual_seed(0)
    model = TorchLSTM()
    x, y = batch("torch_lstm")
    out = JL(cfg={"r": 2}, clip=1.0).privatize(model, loss_fn, x, y)
    assert out.norms.shape == (4,) and torch.isfinite(out.norms).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_step_reports_jl_mechanism_and_only_jl_accountants_accept_it():
    model = build("mlp")
    x, y = batch("mlp")
    method = METHODS.build("jl", cfg={"r": 4}, clip=1.0, sigma=0.7)
    model = method.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = method.step(model, loss_fn, x, y, opt, sample_rate=0.01, expected_batch_size=4.0)
    assert out.mechanism == SubsampledJL(sample_rate=0.01, noise_multiplier=0.7, r=4)
    assert method.default_accountant == "jl" and not method.exact
    assert accountants.resolve_name("auto", method) == "jl"
    gaussian_only = [n for n, cls in ACCOUNTANTS.items() if tuple(cls.supported) == (SubsampledGaussian,)]
    for name in gaussian_only:
        with pytest.raises(UnsupportedMechanism):
            ACCOUNTANTS.build(name).step(out.mechanism)
    if "jl" in ACCOUNTANTS:
        ACCOUNTANTS.build("jl").step(out.mechanism)  # accepted


def test_empty_batch_and_bad_options():
    model = build("mlp")
    x, y = batch("mlp")
    method = JL(cfg={"r": 2}, sigma=0.0)
    model = method.attach(model)
    out = method.step(model, loss_fn, x[:0], y[:0], torch.optim.SGD(model.parameters(), lr=0.1), sample_rate=0.01,
                      expected_batch_size=4.0)
    assert out.norms.numel() == 0 and all(float(p.grad.abs().sum()) == 0 for p in model.parameters())
    with pytest.raises(DprunError, match="r=0"):
        JL(cfg={"r": 0})
    with pytest.raises(DprunError, match="did you mean|valid: auto, forward, double_vjp"):
        JL(cfg={"jvp": "reverse", "r": 1})
    with pytest.raises(DprunError, match="BatchNorm"):
        JL(cfg={"r": 1}).attach(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))


@pytest.mark.parametrize("eps", [1e-4, 1e-6])
@pytest.mark.parametrize("project", [forward_projections, double_vjp_projections], ids=["forward", "double_vjp"])
def test_float32_estimates_on_crafted_inputs_stay_near_the_projections_of_the_release(project, eps):
    """The jl accountant assumes M_i is the JL estimate of exactly what is released for example i. In float32 the
    projections (forward mode, or a double vjp) and the released gradient (a backward) round differently; on the
    certified-clipping constructions (runner/bench/adversarial.py: per-position gradients that cancel, the inputs
    built to break a float32 norm) the estimate M stays within 2% below the estimate of the release's own
    projections (measured: >= 0.9936; deeper cancellation only over-estimates, i.e. clips harder: docs/jl.md).
    The known exception (docs/privacy.md, "Review 25"): an image constant to float32's resolution under a conv and a
    GroupNorm or a LayerNorm over positions, whose exact gradient cancels below float32's rounding, so estimate and
    release keep different residues (0.26 and 0.66-0.70 measured, with the layers centred as jl.prepare does; 4e-6
    before they were: 1e5 C released)."""
    from runner.bench.adversarial import CONSTRUCTIONS, loss_fn
    from runner.methods.centred_norms import centre_spatial_norms

    worst, residue = (float("inf"), None), (float("inf"), None)
    for cases in CONSTRUCTIONS.values():
        for case, build, example in cases:
            torch.manual_seed(0)
            model = build(0)
            centre_spatial_norms(model)  # as jl's prepare
            x = example(torch.Generator().manual_seed(1), eps)
            y = torch.zeros(len(x), dtype=torch.long)
            torch.manual_seed(3)
            v = draw_directions(trainable_params(model), 32)  # name -> (32, *p.shape)
            _, _, P, backward = project(model, loss_fn, x, y, v)  # P (1, 32)
            g = backward(torch.ones(len(x)))  # what the step sums for the example at nu = 1
            released = torch.stack([sum((g[n].double() * v[n][j].double()).sum() for n in g) for j in range(32)])
            ratio = float(P[0].double().pow(2).mean().sqrt() / released.pow(2).mean().sqrt())
            if case.startswith("conv_") and case.endswith("_large_mean_image"):
                residue = min(residue, (ratio, case))
            else:
                worst = min(worst, (ratio, case))
    # double_vjp: 0.94 on layernorm512_T64 at eps 1e-6 since jl centres LayerNorm (the kernel's rounding gave >= 0.98):
    # its weight's gradient sums 64 nearly equal terms of opposite sign to a few roundings, formed in another order
    floor = 0.98 if project is forward_projections else 0.94
    assert worst[0] >= floor, f"{worst[1]}: the estimate is {worst[0]:.4f} x the release's own"
    assert residue[0] >= 0.2, f"{residue[1]}: the estimate is {residue[0]:.4f} x the release's own"


class PaddedBag(nn.Module):
    """An embedding with padding_idx whose padding positions reach the loss (a sum over every position, no mask)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 4, padding_idx=0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):  # (B, T) ids, 0 = padding
        return self.fc(torch.tanh(self.embed(x)).sum(1))


@pytest.mark.parametrize("mode", ["forward", "double_vjp"])
def test_projections_of_an_embedding_with_padding_are_those_of_the_released_gradient(mode):
    """The backward gives padding_idx's row no gradient; forward mode's tangent V[ids] looked that row up at every
    padding position, so forward-mode estimates measured a gradient the step does not release (7.1 against a true
    norm of 1.0). The step's directions have that row zeroed (jl.padding_rows): P = G V^T again, in both modes."""
    from runner.methods.jl import padding_rows

    torch.manual_seed(0)
    model = PaddedBag().double()
    x = torch.tensor([[3, 0, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0], [5, 5, 0, 0, 0, 0], [6, 7, 8, 9, 10, 11]])
    y = torch.tensor([0, 1, 2, 0])
    assert padding_rows(model) == {"embed.weight": 0}
    torch.manual_seed(3)
    V = draw_directions(trainable_params(model), 3, padding_rows(model))
    _, _, P, _ = PROJECTORS[mode](model, loss_fn, x, y, V)
    G = flat(per_example_grads(model, x, y), len(y))  # (B, d); the padding row's columns are 0
    Vf = torch.cat([v.reshape(3, -1) for v in V.values()], 1)
    torch.testing.assert_close(P, G @ Vf.T, rtol=1e-9, atol=1e-10)
    method = METHODS.build("jl", cfg={"r": 2, "jvp": mode}, clip=1.0, sigma=0.0)
    m = method.attach(model)
    method.begin_step(m)
    assert bool((method._directions["embed.weight"][:, 0] == 0).all())  # the step's own draw
    method.end_step()
