"""Masked padding (runner/methods/padding.py) changes nothing: a Poisson batch padded to a fixed physical size with
masked losses releases the same gradient as the unpadded batch. Oracle: nxBP on the unpadded batch (exact methods);
jl against itself unpadded with the same projection seed; non-private against itself unpadded. float64, CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.padding import bucket, pad_batch, padded_step
from tests.test_exact_methods import ConvGroupNormNet, SharedEmbeddingNet

DT = torch.float64
PHYSICAL = 5


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))


FAMILIES = {  # name -> (model builder, inputs of n rows)
    "mlp": (mlp, lambda n, g: torch.randn(n, 2, 4, generator=g, dtype=DT)),
    "conv_groupnorm": (ConvGroupNormNet, lambda n, g: torch.randn(n, 2, 6, 6, generator=g, dtype=DT)),
    "embedding_recurrent": (SharedEmbeddingNet, lambda n, g: torch.randint(0, 5, (n, 6), generator=g)),
}
CASES = [("nonprivate", {}), ("reweight", {"mode": "bk"}), ("reweight", {"mode": "twopass"}),
         ("reweight", {"mode": "recompute"}), ("jl", {"jvp": "forward"}), ("jl", {"jvp": "double_vjp"})]


def test_the_cases_are_every_method_that_compiles():
    """Method.compiles (padded, compiled steps) is checked here for every method that sets it."""
    assert {name for name, _ in CASES} == {name for name, m in METHODS.items() if m.compiles}


def run(method_name, cfg, family, n, padded, sigma=0.0, clip=0.5, r=3, physical=PHYSICAL):
    build, inputs = FAMILIES[family]
    torch.manual_seed(0)
    model = build().to(DT)
    g = torch.Generator().manual_seed(1)
    x, y = inputs(n, g), torch.randint(0, 3, (n,), generator=g)
    method = METHODS.build(method_name, cfg={**cfg, "r": r}, clip=clip, sigma=sigma)
    model = method.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves the released gradient in .grad
    kw = dict(sample_rate=0.01, expected_batch_size=4.0, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(123)  # jl's projection directions: the same draw padded or not
    if padded:
        out = padded_step(method, model, loss_fn, x, y, opt, physical=physical, **kw)
    else:
        out = method.step(model, loss_fn, x, y, opt, **kw)
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return out, grads


def assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("method_name,cfg", CASES, ids=lambda c: c if isinstance(c, str) else "-".join(c.values()))
@pytest.mark.parametrize("n", [0, 1, 3])
def test_padded_masked_step_equals_the_unpadded_batch(method_name, cfg, family, n):
    oracle = "nxbp" if method_name == "reweight" else method_name  # jl, nonprivate: themselves unpadded
    ref_out, ref = run(oracle, {} if oracle == "nxbp" else cfg, family, n, padded=False)
    out, got = run(method_name, cfg, family, n, padded=True)
    assert_same(got, ref)
    assert out.losses.shape == (n,)
    if n:  # (an unpadded empty batch returns default-dtype zeros)
        torch.testing.assert_close(out.losses, ref_out.losses, rtol=1e-9, atol=1e-12)
    if method_name != "nonprivate":
        assert out.norms.shape == (n,)
        if n:
            torch.testing.assert_close(out.norms, ref_out.norms, rtol=1e-9, atol=1e-12)


def test_padding_leaves_the_noise_and_expected_batch_scaling_unchanged():
    """With noise (same generator), the padded release equals the unpadded one: same noise, same division."""
    _, ref = run("reweight", {"mode": "bk"}, "mlp", 3, padded=False, sigma=1.3)
    _, got = run("reweight", {"mode": "bk"}, "mlp", 3, padded=True, sigma=1.3)
    assert_same(got, ref)


@pytest.mark.parametrize("n", [1, 3, 6])
def test_several_sizes_pad_to_the_smallest_that_holds_the_chunk(n, monkeypatch):
    """compile='s buckets: a chunk of n rows runs at the smallest size >= n (n itself above them all) and releases
    what nxBP releases on the unpadded chunk."""
    sizes, seen = (2, 4, 5), []
    original = METHODS.get("reweight").privatize
    monkeypatch.setattr(METHODS.get("reweight"), "privatize",
                        lambda self, model, lf, x, y: seen.append(len(y)) or original(self, model, lf, x, y))
    _, ref = run("nxbp", {}, "mlp", n, padded=False)
    out, got = run("reweight", {"mode": "bk"}, "mlp", n, padded=True, physical=sizes)
    assert_same(got, ref)
    assert seen[-1] == bucket(n, sizes) == {1: 2, 3: 4, 6: 6}[n] and out.losses.shape == (n,)


def test_pad_batch_shapes_and_mask():
    x, y = torch.randn(3, 2), torch.tensor([0, 1, 2])
    xp, yp, mask = pad_batch(x, y, 5)
    assert xp.shape == (5, 2) and yp.shape == (5,) and mask.tolist() == [True] * 3 + [False] * 2
    assert torch.equal(xp[3], x[0])  # padding repeats a real row: finite losses, masked to zero
    xp, yp, mask = pad_batch(x, y, 2)  # larger than the physical size: not truncated
    assert xp.shape == (3, 2) and bool(mask.all())
    xp, yp, mask = pad_batch(x[:0], y[:0], 4)
    assert xp.shape == (4, 2) and not bool(mask.any())


class CountsTwins(nn.Module):
    """Rows repeated 3 or more times pool their features (h + many * (same @ h - h)): unpadded batches (the
    first-step check's probe holds one twin of row 0) never show it, a padded chunk (copies of row 0) does."""

    def forward(self, h):  # (n, d)
        same = (h.detach()[:, None, :] == h.detach()[None, :, :]).all(-1).to(h.dtype)  # (n, n)
        many = (same.sum(1, keepdim=True) >= 3).to(h.dtype)
        return h + many * (same @ h - h)


@pytest.mark.parametrize("mode", ["bk", "twopass"])
def test_a_model_carrying_row_0s_loss_into_its_padded_copies_is_refused(mode):
    """Review 50: each padded copy of row 0 got a gradient from row 0's loss, clipped to C on its own: one example
    released 4.79 C at P = 16 (2.53 C through CompiledStep). The padded rows' norms must be ~0: refused in one line
    before the noise, and no sum left in p.grad for a caught error's optimizer.step()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), CountsTwins(), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    method = METHODS.build("reweight", cfg={"mode": mode}, clip=1.0, sigma=0.0)
    model = method.attach(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 8, generator=g, dtype=DT), torch.tensor([0, 1, 2])
    kw = dict(sample_rate=0.01, expected_batch_size=4.0, generator=torch.Generator().manual_seed(7))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    method.step(model, loss_fn, x, y, opt, **kw)  # unpadded: accepted (the first step's check passes it)
    with pytest.raises(DprunError, match=r"^a padded row .* got a non-zero per-example gradient"):
        padded_step(method, model, loss_fn, x, y, opt, physical=16, **kw)
    assert all(p.grad is None for p in model.parameters())


class ParityOfTwins(nn.Module):
    """Row i times (-1)^(copies of it) where it has 3 or more copies: no row's loss reaches another row (the padded
    rows' gradients stay 0), but row 0's own output depends on how many copies the padding adds, P - n + 1, hence on
    n: on whether any other example is in the batch."""

    def forward(self, h):  # (n, d)
        same = (h.detach()[:, None, :] == h.detach()[None, :, :]).all(-1)
        c = same.sum(1, keepdim=True)
        return h * torch.where(c >= 3, 1.0 - 2.0 * (c % 2).to(h.dtype), torch.ones_like(h[:, :1]))


@pytest.mark.parametrize("method_name,cfg", [("reweight", {"mode": "bk"}), ("reweight", {"mode": "twopass"}),
                                             ("jl", {"jvp": "forward"})])
def test_a_model_reading_its_padding_is_refused_at_the_first_step(method_name, cfg):
    """Review 51: removing any example flipped example 0's padded output, so its clipped gradient moved too (1.7-1.9
    C under reweight, 1.8-2.0 C under jl at P = 16), with no gradient on the padded rows for check_fillers to see.
    The first step's independence check runs through the step's padding now (padding.PaddedRows): refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), ParityOfTwins(), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    method = METHODS.build(method_name, cfg={**cfg, "r": 3}, clip=0.01, sigma=0.0)
    model = method.attach(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 8, generator=g, dtype=DT), torch.tensor([0, 1, 2])
    kw = dict(sample_rate=0.01, expected_batch_size=4.0, generator=torch.Generator().manual_seed(7))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(DprunError, match=r"the examples' losses depend on the other examples of the batch"):
        padded_step(method, model, loss_fn, x, y, opt, physical=16, **kw)


class TrainParity(nn.Module):
    """ParityOfTwins only in train mode; or, unpadded, a sign read off the batch's size in train mode only."""

    def __init__(self, by_size: bool = False):
        super().__init__()
        self.by_size = by_size

    def forward(self, h):
        if not self.training:
            return h
        if self.by_size:
            return -h if len(h) % 2 else h
        return ParityOfTwins()(h)


class AutocastParity(nn.Module):
    """ParityOfTwins only under autocast (precision="bf16"'s forward)."""

    def forward(self, h):
        return ParityOfTwins()(h) if torch.is_autocast_enabled("cpu") else h


def first_step(layer, *, physical=16, chunk=None, n=3, precision="fp32", compiled=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 5), layer, nn.Tanh(), nn.Linear(5, 3)).to(DT)
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=0.01, sigma=0.0)
    method.configure(physical_batch_size=chunk, precision=precision)
    model = method.attach(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 8, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    kw = dict(sample_rate=0.01, expected_batch_size=4.0, generator=torch.Generator().manual_seed(7))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if compiled:
        from runner.methods.compiled import CompiledStep

        return CompiledStep(method, "default", torch.device("cpu"), physical=physical, backend="eager")(
            model, loss_fn, x, y, opt, **kw)
    if physical is None:
        return method.step(model, loss_fn, x, y, opt, **kw)
    return padded_step(method, model, loss_fn, x, y, opt, physical=physical, **kw)


@pytest.mark.parametrize("case", ["chunks", "train_mode", "train_mode_unpadded", "autocast"])
def test_models_reading_the_padding_where_review_51s_probe_did_not_look_are_refused(case):
    """Review 53 got review 51's padded probe passed four ways: with chunks (physical_batch_size below the batch: the
    whole batch was not padded, its chunks are; 1.9-2.3 C), reading the padding in train mode only (the removal probe
    ran in eval mode; 1.96 C, and 5.34 C unpadded for a sign read off len(h)), and under bf16's autocast only (2.36 C).
    The padded probe now runs on prefixes a chunk holds, both parities of the copies' count, under the method's
    autocast, and a removal is probed in train mode too (where the forward is deterministic): each refused."""
    run = {"chunks": lambda: first_step(ParityOfTwins(), physical=4, chunk=4, n=6, compiled=True),
           "train_mode": lambda: first_step(TrainParity()),
           "train_mode_unpadded": lambda: first_step(TrainParity(by_size=True), physical=None, n=17),
           "autocast": lambda: first_step(AutocastParity(), n=5, precision="bf16")}[case]
    with pytest.raises(DprunError, match=r"the examples' losses depend on the other examples of the batch"):
        run()
