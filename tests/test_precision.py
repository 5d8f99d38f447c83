"""precision=bf16: the forward and backward under autocast; norms, clipping, sums, noise and update in float32.

Tolerances against the float64 oracle (nxBP on a float64 copy of the same weights), stated and why:
  per-example norms   rtol 2e-2   bfloat16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3); a norm is a sum of
                                  squares whose roundings average out, but the forward and the backward through a
                                  few layers each round: measured <= 5.5e-3 on every family, so 2e-2 is ~4x that.
  clipped sum         5e-2        relative, over all parameters (||got - want|| / ||want||): the sum over examples
                                  cancels, which magnifies the relative error; measured <= 1.2e-2 (bu_cnn).
The guarantee does not rest on these: each example's contribution (what a one-example step releases, which is
exactly what was summed) has float64 norm <= C, for every method and mode that accepts bf16.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import compose_config
from runner.errors import DprunError
from runner.methods.features import Feature
from runner.methods import METHODS
from runner.models import MODELS
from tests.test_exact_methods import KNOWN_WRONG, TOYS, VARIANTS, ZOO, batch

OPTIONS = {**VARIANTS, "opacus": [{"grad_sample_mode": m} for m in ("hooks", "functorch", "ghost")],
           "jl": [{"r": 2}]}
ALL = [(name, cfg) for name, cls in METHODS.items() if cls.private for cfg in OPTIONS.get(name, [{}])]


def accepts_bf16(name, cfg) -> bool:
    return METHODS.build(name, cfg=cfg).why_not(Feature.BF16) is None


BF16 = [c for c in ALL if accepts_bf16(*c)]
FAMILIES = {**TOYS, **{k: ((lambda info, k=k, kw=kw: MODELS.build(k, info, **kw)), info) for k, (info, kw) in ZOO.items()}}


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def case_id(name, cfg):
    return "-".join([name, *map(str, cfg.values())])


def test_the_methods_that_refuse_bf16_say_why_in_one_line():
    refused = {case_id(*c) for c in ALL if not accepts_bf16(*c)}
    assert refused == {"reweight-twopass", "reweight-recompute", "opacus-ghost", "jl-2", "sbcd"}
    for name, cfg in ALL:
        if not accepts_bf16(name, cfg):
            with pytest.raises(DprunError, match=rf"^method={name} cannot run with precision=bf16: [^\n]+$"):
                METHODS.build(name, cfg=cfg).configure(precision="bf16")


@pytest.mark.parametrize("bad,message", [
    (["precision=fp16"], r"^precision='fp16' is not valid: precision must be one of: fp32, bf16, tf32"),
    (["precision=bf16", "dtype=float64"], r"^precision=bf16 needs dtype=float32"),
])
def test_fp16_and_bf16_on_float64_are_refused_before_any_data(bad, message):
    from runner.validate import validate_config

    with pytest.raises(DprunError, match=message):
        validate_config(compose_config(bad))


def bf16_step(name, cfg, model, x, y, clip):
    method = METHODS.build(name, cfg=cfg, clip=clip, sigma=0.0).configure(precision="bf16")
    model = method.attach(model)
    for p in model.parameters():
        p.grad = None
    out = method.privatize(model, loss_fn, x, y)
    return out, [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name,cfg", BF16, ids=[case_id(*c) for c in BF16])
def test_bf16_norms_and_clipped_sums_against_the_float64_oracle(name, cfg, family):
    if (name, family) in KNOWN_WRONG:
        pytest.skip(KNOWN_WRONG[(name, family)])  # the peer's own wrong numbers, in any precision
    build, info = FAMILIES[family]
    torch.manual_seed(0)
    model32 = build(info).float()
    model64 = copy.deepcopy(model32).double()
    x, y = batch(info, 6, seed=1)
    x32 = x.float() if x.is_floating_point() else x
    oracle = METHODS.build("nxbp", clip=1e9, sigma=0.0)
    model64 = oracle.attach(model64)
    free = oracle.privatize(model64, loss_fn, x.double() if x.is_floating_point() else x, y)
    clip = 0.5 * float(free.norms.median())  # most examples clipped
    for p in model64.parameters():
        p.grad = None
    want = METHODS.build("nxbp", clip=clip, sigma=0.0)
    want.attach(model64)
    want_out = want.privatize(model64, loss_fn, x.double() if x.is_floating_point() else x, y)
    want_sum = torch.cat([p.grad.flatten() for p in model64.parameters() if p.requires_grad])
    try:
        got_out, got = bf16_step(name, cfg, model32, x32, y, clip)
    except DprunError as e:
        pytest.skip(f"method={name} declares this model unsupported: {e}")
    assert got_out.norms.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got)
    torch.testing.assert_close(got_out.norms.double(), want_out.norms, rtol=2e-2, atol=1e-6)
    got_sum = torch.cat([g.double().flatten() for g in got])
    assert float((got_sum - want_sum).norm() / want_sum.norm()) < 5e-2


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name,cfg", BF16, ids=[case_id(*c) for c in BF16])
def test_each_examples_contribution_is_at_most_c_under_bf16(name, cfg, family):
    """One example per step, so the released sum IS that example's contribution, exactly as summed (float32);
    its float64 norm is at most C for 6 random examples, every one clipped (C far below the norms)."""
    build, info = FAMILIES[family]
    C = 1e-3
    for seed in range(6):
        torch.manual_seed(0)
        model = build(info).float()
        x, y = batch(info, 1, seed=100 + seed)
        x = x.float() if x.is_floating_point() else x
        try:
            out, grads = bf16_step(name, cfg, model, x, y, C)
        except DprunError as e:
            pytest.skip(f"method={name} declares this model unsupported: {e}")
        assert float(out.norms[0]) > 10 * C  # clipped
        contribution = torch.sqrt(sum(g.double().pow(2).sum() for g in grads))
        assert float(contribution) <= C, f"{name} {cfg} {family}: {float(contribution) / C:.8f} C"


def test_a_bf16_digits_run_reaches_the_fp32_accuracy_within_a_point(tmp_path):
    from runner.train import train

    base = ["method=reweight", "epochs=10", "progress=false", "accountant=none"]  # accuracy only: no epsilon needed
    fp32 = train(compose_config(base), tmp_path / "fp32")
    bf16 = train(compose_config(base + ["precision=bf16"]), tmp_path / "bf16")
    assert bf16["config"]["precision"] == "bf16"
    assert bf16["final"]["train_loss"] != fp32["final"]["train_loss"]  # autocast really ran
    assert abs(bf16["final"]["test_acc"] - fp32["final"]["test_acc"]) <= 0.01
    assert fp32["final"]["test_acc"] >= 0.9
