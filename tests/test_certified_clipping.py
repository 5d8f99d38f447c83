"""The certified-clipping contract (issue 26): for ANY input, each example's contribution to the release is <= C.

Not sampled on ordinary data: built to break it. Each registered norm rule has a construction (CONSTRUCTIONS; a new
rule cannot be registered without one, test_every_rule_has_an_adversarial_construction) in which the layer's
per-position gradients cancel: the layer applied at T positions to a near-constant input a0 + eps * noise, then a
fixed +-1 pattern over the positions (a buffer) and a fixed read-out, so the exact per-example gradient is O(eps)
while every term of a float32 ghost Gram is O(1). Before the fix the float32 ghost norm of the 512->512 case came
out ~0, the clip factor was 1 and the example released 100 C.

ONE example per step, sigma = 0, expected_batch_size = 1 and an optimizer that moves nothing: the gradient the step
leaves IS that example's contribution, measured in float64. C = 1% (and 90%) of the example's exact gradient norm
(nxBP in float64), so every example is clipped. Every private method that promises the bound (jl clips by
estimates, sbcd is another mechanism: tests/test_clip_contribution.py EXCUSED) x every mode x norm choice x
precision must give ||released|| <= C (1 + 1e-6), or refuse the model in one line (the Opacus peer's ghost mode).

Then a search, not only constructions: random restarts over (eps, a0, pattern) and a gradient-guided search that
drives the input towards cancellation (it maximises S^2 / ||G||^2, the ratio that float32 rounding of a Gram sum
multiplies), each iterate checked. And records that are not ordinary numbers: one example of a batch with inputs
1e19 (squares overflow float32), 1e38 through a ReLU (the forward overflows), inf or nan must not turn the release
into nan: it contributes nothing (or at most C), the others exactly what they contribute without it.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS, jl, opacus_peer, reweight
from runner.norms import RULES, streaming
from runner.bench.adversarial import (CONSTRUCTIONS, UNDERFLOW, Cancelling, exact_norm, measured, near_constant,
                                     released, seq)
from runner.norms.base import HOW

# VALIDATOR: these tests measure clipping alone, so the first-step privacy validator is off here: its comparison with
# one backward per example is not robust to a crafted first batch (issue 26 note: bf16 or non-finite records).
TOL = 1e-6  # the contract: ||contribution|| <= C (1 + TOL)
EXCUSED = ("jl", "sbcd")  # see tests/test_clip_contribution.py: estimates / another mechanism

# bk's other recorders (method.recorder: Recorder from the start, auto's choice on CUDA) beside the lean one (auto's on
# the CPU), and the lean one with
# method.defer=on (the record-keeping layers' norms after the backward, from the second step on: adversarial.released
# measures that step), every norm choice
OTHER_RECORDERS = ([{"mode": "bk", "norm": h, "recorder": "full"} for h in HOW]  # (auto is lean on the CPU)
                   + [{"mode": "bk", "norm": h, "defer": d} for h in HOW for d in ("on", "all")]  # deferral on the CPU
                   # every layer's clipped sum from its records (nu scales the smaller side), or from a kept G_i
                   + [{"mode": "bk", "keep": keep} for keep in (0, 1000)])
VARIANTS = {"reweight": [{"mode": m, "norm": h} for m in reweight.MODES for h in HOW] + OTHER_RECORDERS,
            "opacus": [{"grad_sample_mode": g} for g in opacus_peer.MODES]}
CASES = [(name, cfg) for name, cls in METHODS.items() if cls.private and name not in EXCUSED
         for cfg in VARIANTS.get(name, [{}])]
BF16 = ([("reweight", {"mode": "bk", "norm": h}) for h in HOW] + [("reweight", cfg) for cfg in OTHER_RECORDERS]
        + [("nxbp", {}), ("multiloss", {})])


@pytest.fixture(autouse=True)
def deferral_captures(request, monkeypatch):
    """With method.defer=on or all, no layer is captured for its small size (CAPTURE_BYTES 0: these constructions' outputs
    are all small), so that every layer keeping its records is captured because it is deferred (lean.py)."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if isinstance(params.get("cfg"), dict) and params["cfg"].get("defer") in ("on", "all"):
        monkeypatch.setattr(streaming, "CAPTURE_BYTES", 0)


def case_id(name, cfg):
    return "-".join([name, *map(str, cfg.values())])


ALL = [(kind, *c) for kind, cs in CONSTRUCTIONS.items() for c in cs]
EPS = 1e-4


def contribution(name, cfg, model, x, fraction=0.01, precision="fp32"):
    """||released|| / C with C = fraction * the exact norm; None when the method refuses the model (one line)."""
    try:
        return measured(name, cfg, model, x, fraction, precision)
    except DprunError as e:
        assert "\n" not in str(e)
        assert name == "opacus" and cfg["grad_sample_mode"] == "ghost" and "not certified" in str(e), str(e)
        return None


def test_every_rule_has_an_adversarial_construction():
    """A norm rule registered without an adversarial construction here fails the contract by default."""
    missing = sorted(t.__name__ for t in RULES if t not in CONSTRUCTIONS)
    assert not missing, f"norm rules without an adversarial construction in {__file__}: {missing}"


@pytest.mark.parametrize("kind,case,build,example", ALL, ids=[c[1] for c in ALL])
@pytest.mark.parametrize("name,cfg", CASES, ids=[case_id(*c) for c in CASES])
def test_crafted_example_contributes_at_most_C(name, cfg, kind, case, build, example):
    if name == "opacus":
        pytest.importorskip("opacus")
    torch.manual_seed(0)
    model = build(0)
    x = example(torch.Generator().manual_seed(1), EPS)
    worst = 0.0
    for fraction in (0.01, 0.9):
        ratio = contribution(name, cfg, model, x, fraction)
        if ratio is None:
            return  # refused in one line (checked in contribution)
        worst = max(worst, ratio)
    assert worst <= 1 + TOL, f"{case}: an example contributed {worst:.6g} x C"


@pytest.mark.parametrize("kind,case,build,example", ALL, ids=[c[1] for c in ALL])
@pytest.mark.parametrize("how", HOW)
def test_crafted_example_contributes_at_most_C_through_hooks(monkeypatch, how, kind, case, build, example):
    """Book-keeping's lean recorder hands small layers' output-gradients over after the backward (no hook,
    streaming.CAPTURE_BYTES) and large layers' through tensor hooks inside it; the constructions are small, so the
    test above covers the first route and this one, capture off, the second."""
    monkeypatch.setattr(streaming, "CAPTURE_BYTES", 0)
    torch.manual_seed(0)
    model = build(0)
    x = example(torch.Generator().manual_seed(1), EPS)
    worst = max(contribution("reweight", {"mode": "bk", "norm": how}, model, x, fraction) for fraction in (0.01, 0.9))
    assert worst <= 1 + TOL, f"{case}: an example contributed {worst:.6g} x C through hooks"


@pytest.mark.parametrize("kind,case,build,example", ALL, ids=[c[1] for c in ALL])
@pytest.mark.parametrize("name,cfg", BF16, ids=[case_id(*c) for c in BF16])
def test_crafted_example_contributes_at_most_C_in_bf16(name, cfg, kind, case, build, example):
    torch.manual_seed(0)
    model = build(0)
    x = example(torch.Generator().manual_seed(1), EPS)
    ratio = contribution(name, cfg, model, x, 0.01, precision="bf16")
    assert ratio <= 1 + TOL, f"{case}: an example contributed {ratio:.6g} x C under bf16"


UNDER = [(kind, *c) for kind, cs in UNDERFLOW.items() for c in cs]
UNDER_CASES = [(n, c, "fp32") for n, c in CASES] + [(n, c, "bf16") for n, c in BF16]


@pytest.mark.parametrize("kind,case,build,example", UNDER, ids=[c[1] for c in UNDER])
@pytest.mark.parametrize("name,cfg,precision", UNDER_CASES, ids=[f"{case_id(n, c)}-{p}" for n, c, p in UNDER_CASES])
def test_an_underflowing_record_contributes_at_most_C(name, cfg, precision, kind, case, build, example):
    """One record ~1e17, the other ~1e-23 (its squares underflow float32 and bf16 alike), their products ~1e-6
    (runner/bench/adversarial.py UNDERFLOW). Failed before certify.underflow_floor: 100 x C with the defaults on the
    conv constructions, 4 x C on a Linear at one position (docs/privacy.md, stop 35)."""
    if name == "opacus":
        pytest.importorskip("opacus")
    torch.manual_seed(0)
    model = build(0)
    x = example(torch.Generator().manual_seed(1), EPS)
    ratio = contribution(name, cfg, model, x, 0.01, precision=precision)
    if ratio is None:
        return  # refused in one line (checked in contribution)
    assert ratio <= 1 + TOL, f"{case}: an example contributed {ratio:.6g} x C ({precision})"


def compiled_contribution(how, build, example, backend):
    """(compiled, eager) ||released|| / C of one crafted example, C = 1% of its exact norm, reweight bk."""
    torch.manual_seed(0)
    torch._dynamo.reset()  # each construction's own graph (C and the shapes are constants of it)
    model = build(0)
    x = example(torch.Generator().manual_seed(1), EPS)
    cfg = {"mode": "bk", "norm": how}
    return (measured("reweight", cfg, model, x, 0.01, compile_backend=backend),
            measured("reweight", cfg, model, x, 0.01))


@pytest.mark.parametrize("kind,case,build,example", ALL, ids=[c[1] for c in ALL])
@pytest.mark.parametrize("how", ["auto", "ghost"])
def test_crafted_example_contributes_at_most_C_when_compiled(how, kind, case, build, example):
    """compile=...: the traced book-keeping route (Recorder, one graph, the non-finite rows masked in the graph where
    the eager step asks once: runner/norms/certify.py) keeps the bound, and gives the eager step's contribution.
    Dynamo traces the step with aot_eager (AOTAutograd, functionalised, no code generation: a few seconds each);
    Inductor's fused kernels in the slow test below."""
    compiled, eager = compiled_contribution(how, build, example, "aot_eager")
    assert compiled <= 1 + TOL, f"{case}: an example contributed {compiled:.6g} x C in a compiled step"
    assert compiled == pytest.approx(eager, rel=1e-4), (compiled, eager)


UNDER_CONV_LINEAR = [c for c in UNDER if c[0] in (nn.Linear, nn.Conv2d, nn.Conv1d)]


@pytest.mark.parametrize("kind,case,build,example", UNDER_CONV_LINEAR, ids=[c[1] for c in UNDER_CONV_LINEAR])
def test_an_underflowing_record_contributes_at_most_C_when_compiled(kind, case, build, example):
    """The underflow constructions of the rules with a floor (rank one, mass, Grams) through the traced route."""
    compiled, eager = compiled_contribution("auto", build, example, "aot_eager")
    assert compiled <= 1 + TOL, f"{case}: an example contributed {compiled:.6g} x C in a compiled step"
    assert compiled == pytest.approx(eager, rel=1e-4), (compiled, eager)


@pytest.mark.slow
@pytest.mark.parametrize("kind,case,build,example", UNDER, ids=[c[1] for c in UNDER])
def test_an_underflowing_record_contributes_at_most_C_under_inductor(kind, case, build, example):
    """The underflow constructions through Inductor's generated kernels: <= C. Not compared with the eager step: on
    the two conv tiny-input cases the bias's gradient sum_t s_t r (read-out r ~1e17, signs summing to 0) is an exact
    0 in the eager step, but Inductor's kernels round the 1e17-scale output-gradients in another order and its sum
    comes out ~2e11 (checked with C = 1e30: bias grad 0 vs 2.06e11, weight grads equal). The certificate bounds what
    is summed, so the release stays <= C (0.99999 C) where the eager step's floors give ~5e-7 C."""
    compiled, _ = compiled_contribution("auto", build, example, "inductor")
    assert compiled <= 1 + TOL, f"{case}: an example contributed {compiled:.6g} x C under Inductor"


@pytest.mark.slow
@pytest.mark.parametrize("kind,case,build,example", ALL, ids=[c[1] for c in ALL])
def test_crafted_example_contributes_at_most_C_under_inductor(kind, case, build, example):
    """The same through Inductor's generated kernels (other summation orders: the bounds hold for any)."""
    compiled, eager = compiled_contribution("auto", build, example, "inductor")
    assert compiled <= 1 + TOL, f"{case}: an example contributed {compiled:.6g} x C under Inductor"
    assert compiled == pytest.approx(eager, rel=1e-3), (compiled, eager)


@pytest.mark.parametrize("recorder", ["auto", "full"])  # auto is lean on the CPU; full is auto's choice on CUDA
@pytest.mark.parametrize("how", HOW)
def test_chunked_logical_batch_keeps_the_bound(how, recorder):
    """Three crafted examples in chunks of two (physical_batch_size): ||release|| <= 3 C (each <= C)."""
    model = CONSTRUCTIONS[nn.Linear][0][1](0)
    x = torch.cat([near_constant((16, 512), EPS, torch.Generator().manual_seed(s)) for s in range(3)])
    C = 0.01 * min(exact_norm(model, x[i:i + 1]) for i in range(3))
    method = METHODS.build("reweight", cfg={"norm": how, "recorder": recorder}, clip=C,
                           sigma=0.0).configure(physical_batch_size=2)
    method.privacy_check = False  # clipping alone (see VALIDATOR below)
    norm, out = released(method, method.attach(copy.deepcopy(model)), x)
    assert norm <= 3 * C * (1 + TOL), f"release {norm / C:.6g} C from 3 examples"


@pytest.mark.parametrize("mode", reweight.MODES)
def test_search_for_a_violation(mode):
    """Random restarts (eps from 1e-1 to 1e-6, new a0, new pattern) and a gradient-guided search on the input that
    maximises the cancellation ratio S^2 / ||G||^2 (float64): no iterate may release more than C."""
    torch.manual_seed(0)
    worst = 0.0
    for restart in range(3):
        model = Cancelling(nn.Linear(128, 256), torch.zeros(1, 24, 128), seq, restart)
        g = torch.Generator().manual_seed(100 + restart)
        for eps in (1e-1, 1e-3, 1e-5, 1e-6):
            worst = max(worst, contribution("reweight", {"mode": mode}, model, near_constant((24, 128), eps, g)))
        # gradient-guided: after the layer the model is linear, so g_t = s_t r (r the read-out) and
        # G = r (sum_t s_t x_t)^T: S^2 / ||G||^2 = (sum_t ||x_t||)^2 / ||sum_t s_t x_t||^2 (float64), ascended in x
        x = near_constant((24, 128), 1e-2, g).double().requires_grad_(True)
        signs = model.signs.double()
        for _ in range(8):
            residual = signs @ x[0]  # (k,) sum_t s_t x_t
            ratio = x[0].norm(dim=-1).sum().square() / residual.square().sum()
            (step,) = torch.autograd.grad(ratio.log(), x)
            with torch.no_grad():
                x += 0.5 * residual.norm() * step / step.norm()
            worst = max(worst, contribution("reweight", {"mode": mode}, model, x.detach().float()))
    assert worst <= 1 + TOL, f"the search found an example contributing {worst:.6g} x C"


SCALE_SEARCH = [("linear512_T16", nn.Linear), ("linear512x256_one_position", nn.Linear),
                ("conv2d_32x64_16x16_groups", nn.Conv2d)]


@pytest.mark.parametrize("name,cfg,precision", [("reweight", {"mode": m}, "fp32") for m in reweight.MODES]
                         + [("reweight", {"mode": "bk", "norm": "ghost"}, "bf16")], ids=lambda v: str(v))
def test_search_over_scales_for_an_underflow_violation(name, cfg, precision):
    """Random scales of the input (1e-30 .. 1e18) and of the read-out, their product kept in 1e-8 .. 1e2 so that the
    gradient stays well above the clip factor's 1e-6 while one record's squares fall anywhere from normal through
    subnormal to flushed: no scale may release more than C (the UNDERFLOW constructions fix two of them)."""
    torch.manual_seed(0)
    rng = torch.Generator().manual_seed(7)
    by_name = {case: (build, example) for kind, cases in CONSTRUCTIONS.items() for case, build, example in cases}
    worst, where = 0.0, None
    for case, _ in SCALE_SEARCH:
        build, example = by_name[case]
        for _ in range(4):
            log_in = float(torch.empty(()).uniform_(-30, 18, generator=rng))
            log_out = float(torch.empty(()).uniform_(-8, 2, generator=rng)) - log_in
            model = build(0)
            model.readout.mul_(10.0 ** log_out)
            x = example(torch.Generator().manual_seed(1), 1.0) * 10.0 ** log_in
            ratio = contribution(name, cfg, model, x, 0.01, precision=precision)
            if ratio is not None and ratio > worst:
                worst, where = ratio, (case, round(log_in, 1), round(log_out, 1))
    assert worst <= 1 + TOL, f"the scale search found {worst:.6g} x C at {where}"


class Mlp(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.a, self.act, self.b = nn.Linear(8, 16), act, nn.Linear(16, 3)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


def ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


class Square(nn.Module):
    def forward(self, h):
        return h * h  # a finite input of 1e20 overflows here: inf activations inside the forward's graph


RECORDS = [("1e19_tanh", nn.Tanh, 1e19), ("1e38_relu", nn.ReLU, 1e38), ("1e20_square", Square, 1e20),
           ("inf", nn.Tanh, float("inf")), ("nan", nn.Tanh, float("nan"))]
# every private method that releases a clipped gradient sum, jl too: its estimates are not a bound on C (EXCUSED
# above), but a record that is not finite must add nothing to its release as to any other's (runner/methods/dropped.py)
POISON_CASES = CASES + [("jl", {"r": 2, "jvp": m}) for m in jl.MODES if m != "auto"]


@pytest.mark.parametrize("record,act,value", RECORDS, ids=[r[0] for r in RECORDS])
@pytest.mark.parametrize("name,cfg", POISON_CASES, ids=[case_id(*c) for c in POISON_CASES])
def test_a_non_finite_record_cannot_poison_the_release(name, cfg, record, act, value):
    """One of four examples holds `value` everywhere: the release stays finite; where the record's norm (or loss) is
    not finite it adds exactly nothing, every other example what it adds without it; else it contributes at most C.
    Before runner/methods/dropped.py, jl (both jvp modes) released nan for everyone with an inf, nan or 1e20_square
    record, and twopass with 1e20_square (0 * inf in the graph its second backward runs through)."""
    if name == "opacus":
        pytest.importorskip("opacus")
    if name == "opacus" and cfg["grad_sample_mode"] == "ghost":
        with pytest.raises(DprunError, match="^method=opacus grad_sample_mode=ghost cannot train a .*not certified"):
            METHODS.build(name, cfg=cfg, clip=1.0, sigma=0.0).attach(Mlp(act()))
        return
    torch.manual_seed(0)
    model = Mlp(act())
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    x[2] = value
    dropped = record_adds_nothing_or_at_most_c(name, cfg, model, x, y, record=2, C=0.5)
    if record in ("inf", "nan", "1e20_square"):
        assert dropped, f"{record}: the record's norm and loss came out finite"


def record_adds_nothing_or_at_most_c(name, cfg, model, x, y, record: int, C: float) -> bool:
    """One step of `name` on (x, y) and on the batch without row `record` (sigma 0, nothing moves): the release is
    finite; if the record's norm or loss is not finite (dropped, returned True) it adds exactly nothing, every other
    example what it adds without it; else it adds at most C (not checked for jl, which clips by estimates: its
    accountant analyses that)."""

    def release(xs, ys):
        method = METHODS.build(name, cfg=cfg, clip=C, sigma=0.0)
        method.privacy_check = False  # clipping alone (see VALIDATOR below)
        m = method.attach(copy.deepcopy(model))
        torch.manual_seed(1)  # jl: the same directions with and without the record
        out = method.step(m, ce, xs, ys, torch.optim.SGD(m.parameters(), lr=0.0), sample_rate=1.0,
                          expected_batch_size=1.0)
        return torch.cat([p.grad.double().flatten() for p in m.parameters()]), out

    keep = torch.tensor([i for i in range(len(y)) if i != record])
    (with_record, out), (without, _) = release(x, y), release(x[keep], y[keep])
    assert torch.isfinite(with_record).all(), "one record turned the release into nan/inf"
    dropped = not (bool(torch.isfinite(out.norms[record])) and bool(torch.isfinite(out.losses[record])))
    if dropped:
        torch.testing.assert_close(with_record, without, rtol=1e-5, atol=1e-7)
    elif name != "jl":
        assert float((with_record - without).norm()) <= C * (1 + 1e-4)
    return dropped


TRANSFORMER_POISON = [("reweight", {"mode": m}) for m in reweight.MODES] + [
    ("nxbp", {}), ("multiloss", {}), ("jl", {"r": 2, "jvp": "forward"}), ("jl", {"r": 2, "jvp": "double_vjp"})]


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e30], ids=["inf", "nan", "1e30"])
@pytest.mark.parametrize("name,cfg", TRANSFORMER_POISON, ids=[case_id(*c) for c in TRANSFORMER_POISON])
def test_a_non_finite_record_through_the_fused_attention_adds_nothing(name, cfg, value):
    """The zoo's transformer (one token per image row) runs F.scaled_dot_product_attention without dropout, and jl
    and multiloss its math backend: one record of four holding inf or nan leaves the release finite, adds exactly
    nothing, and every other example adds what it adds without it; a huge finite one (1e30) adds nothing or at most
    C."""
    from runner.data.base import DataInfo
    from runner.models import MODELS

    info = DataInfo("img", (1, 4, 6), 3, "image", None, 100, 10)
    torch.manual_seed(0)
    model = MODELS.build("transformer", info, d_model=8, heads=2, ff=8, dropout=0.0)  # float32, as trained
    x, y = torch.randn(4, 1, 4, 6), torch.tensor([0, 1, 2, 0])
    x[2] = value
    dropped = record_adds_nothing_or_at_most_c(name, cfg, model, x, y, record=2, C=0.5)
    assert dropped or value == 1e30  # a finite 1e30 record may be tamed by the LayerNorms: then at most C


def test_the_dropped_record_rerun_costs_nothing_when_every_record_is_finite(monkeypatch):
    """jl and twopass ask once per chunk whether every record was finite; only a no forms the chunk again (on the kept
    records' rows)."""
    from runner.methods import dropped

    calls, kept_rows = [], dropped.kept_rows
    monkeypatch.setattr(dropped, "kept_rows", lambda t, keep: calls.append(keep) or kept_rows(t, keep))
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    for name, cfg in [("jl", {"r": 2}), ("reweight", {"mode": "twopass"})]:
        method = METHODS.build(name, cfg=cfg, clip=0.5, sigma=0.0)
        method.privacy_check = False
        m = method.attach(Mlp(nn.Tanh()))
        method.step(m, ce, x, y, torch.optim.SGD(m.parameters(), lr=0.0), sample_rate=1.0, expected_batch_size=1.0)
    assert calls == []
    x[1] = float("nan")
    method.step(m, ce, x, y, torch.optim.SGD(m.parameters(), lr=0.0), sample_rate=1.0, expected_batch_size=1.0)
    assert len(calls) == 2 and calls[0].tolist() == [True, False, True, True]  # x's rows and y's, once


class SeqMlp(nn.Module):
    """A Linear over 32 positions whose per-example gradient book-keeping keeps (4 x 4 <= 1.1 x 32 x 8; direct, not
    ghost: the stash alone gives its clipped sum and its records are freed), then a mean and a Linear."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):  # x (B, 32, 4)
        return self.b(torch.tanh(self.a(x)).mean(1))


class ConvNormNet(nn.Module):
    """Conv2d (its clipped sum from a kept per-example gradient or the weight-gradient kernel), GroupNorm and
    LayerNorm (theirs from kept per-example sums): the other rules' masked second pass."""

    def __init__(self):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.ln, self.fc = nn.LayerNorm(4), nn.Linear(4, 3)

    def forward(self, x):  # x (B, 2, 6, 6)
        h = torch.tanh(self.gn(self.conv(x))).mean((2, 3))
        return self.fc(self.ln(h))


FAMILIES = {"seq_linear": (SeqMlp, (32, 4), (3,)), "conv_norms": (ConvNormNet, (2, 6, 6), (1, 2, 3))}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("mode", ["bk", "twopass", "recompute"])
def test_a_non_finite_record_adds_nothing_and_the_others_everything(mode, value, family):
    """One of four examples not finite: it adds exactly nothing and the other three all of their clipped gradients,
    in every layer, those whose clipped sum comes from a kept per-example gradient too (book-keeping sums unmasked
    first and, the one read saying an example was dropped, again with its rows masked: the second pass needs every
    layer's stash as it was)."""
    build, shape, bad = FAMILIES[family]
    torch.manual_seed(0)
    model = build()
    x, y = torch.randn(4, *shape), torch.tensor([0, 1, 2, 0])
    x[(2, *bad)] = value

    def release(xs, ys):
        method = METHODS.build("reweight", cfg={"mode": mode}, clip=0.5, sigma=0.0)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))
        method.step(m, ce, xs, ys, torch.optim.SGD(m.parameters(), lr=0.0), sample_rate=1.0, expected_batch_size=1.0)
        return torch.cat([p.grad.double().flatten() for p in m.parameters()])

    keep = torch.tensor([0, 1, 3])
    without = release(x[keep], y[keep])
    assert float(without.norm()) > 0.1  # the others do contribute
    torch.testing.assert_close(release(x, y), without, rtol=1e-5, atol=1e-7)


def test_row_norms_of_a_strided_view_and_finite_rows():
    """certify.vector_norms on a conv output-gradient's (B, L, o) view (the CPU's fast route: squares summed)
    equals torch's norm, overflows alike; finite_rows zeroes exactly the dropped rows, and on the CPU returns the
    tensor itself when every row is kept."""
    from runner.norms.certify import finite_rows, vector_norms

    grad_out = torch.randn(5, 16, 49)  # (B, C_out, L)
    g = grad_out.permute(0, 2, 1)  # (B, L, C_out), feature dim strided
    torch.testing.assert_close(vector_norms(g, -1), torch.linalg.vector_norm(g, dim=-1), rtol=1e-6, atol=0)
    grad_out[2, 3, 4] = 3e19  # its square overflows float32: the row's norm must not come out finite
    assert torch.isinf(vector_norms(grad_out.permute(0, 2, 1), -1)[2, 4])
    t = torch.randn(4, 3)
    assert finite_rows(t, torch.ones(4, dtype=torch.bool)) is t
    t[1] = float("nan")
    kept = finite_rows(t, torch.tensor([True, False, True, True]))
    assert torch.equal(kept[1], torch.zeros(3)) and torch.equal(kept[[0, 2, 3]], t[[0, 2, 3]])


def test_a_grouped_convs_group_bounds_are_summed_for_any_order(monkeypatch):
    """A grouped conv adds its G groups' certified bounds per example. A reduction in the worst order (sequential,
    the large term first) lands up to (G - 1) u under their exact sum, more than a layer's own margins cover; the rule
    sums them through certify.summed_bounds, whose 1 + gamma_{G+2} covers any order."""
    from runner.norms import conv as conv_rules
    from runner.norms.certify import gamma, summed_bounds

    G = 64
    row = torch.full((G,), 0.49 * 2.0**-23)  # each just under half an ulp of 1.0
    row[0] = 1.0
    exact = float(row.double().sum())
    worst = torch.zeros((), dtype=torch.float32)
    for v in row:  # one float32 addition after another: every small term rounds away
        worst = worst + v
    assert float(worst) == 1.0 < exact  # 62u under the exact sum
    assert float(worst * torch.tensor(1 + gamma(G + 2, 2.0**-24), dtype=torch.float32)) >= exact
    assert float(summed_bounds(row.view(1, G))[0]) >= exact
    seen = []
    monkeypatch.setattr(conv_rules, "summed_bounds", lambda parts: seen.append(tuple(parts.shape)) or parts.sum(1))
    layer = nn.Conv2d(4, 8, 3, groups=4)
    x = torch.randn(2, 4, 6, 6)
    rule = conv_rules.ConvRule()
    a, g = rule.sequence(layer, x, torch.randn_like(layer(x)))
    rule.norm_sq(layer, a, g, "auto")
    assert seen == [(2, 4)]  # (B, G): the groups' bounds go through it


def test_a_bias_bound_is_added_to_the_weights_in_one_kernel_and_stays_an_upper_bound():
    """Book-keeping's bias bound (its kept per-example sums' squared norm, upper_sqnorm's factor) is added to the
    weight's in one addcmul: the same roundings as square, multiply and add, so the same certified value within an
    ulp, never under the float64 truth, and two kernels fewer per layer with a bias (a GPU step is launch-bound)."""
    from runner.bench.opcount import kernels
    from runner.norms.certify import add_sqnorm_, upper_sqnorm
    from runner.norms.linear import LinearRule
    from runner.norms.outer import Stash

    torch.manual_seed(0)
    sums = torch.randn(64, 200) * torch.logspace(-20, 15, 64).unsqueeze(1)  # rows across 35 decades
    acc = torch.rand(64)
    before = acc.clone()
    got = add_sqnorm_(acc, sums)
    assert got is acc  # in place
    torch.testing.assert_close(got, before + upper_sqnorm(sums), rtol=3e-7, atol=0)
    # over the truth but for the add's own rounding (one u, which certified_norms' gamma_L covers, as for every
    # layer's weight + bias): a bias bound of 1e-38 beside 0.5 is lost in float32 whatever adds it
    truth = before.double() + sums.double().square().sum(1)
    assert bool((got.double() >= truth * (1 - 2.0**-24)).all())
    long_rows = torch.randn(8, 2048)  # past one level: through upper_sqnorm itself
    torch.testing.assert_close(add_sqnorm_(torch.zeros(8), long_rows), upper_sqnorm(long_rows), rtol=0, atol=0)

    layer = nn.Linear(32, 16)
    a, g = torch.randn(4, 8, 32), torch.randn(4, 8, 16)  # 8 positions: the weight's bound by ghost or kept G
    rule = LinearRule()
    with_bias = kernels(lambda: rule.norm_sq(layer, a, g, "auto", Stash()))
    layer.bias.requires_grad_(False)
    weight_only = kernels(lambda: rule.norm_sq(layer, a, g, "auto", Stash()))
    assert with_bias - weight_only == 3  # the sums, their norm, one addcmul (was 5: + square, multiply, add)


CONV = [c for c in ALL if c[0] is nn.Conv2d]
REWEIGHT = [c for c in CASES if c[0] == "reweight"]


@pytest.mark.parametrize("kind,case,build,example", CONV, ids=[c[1] for c in CONV])
@pytest.mark.parametrize("name,cfg", REWEIGHT, ids=[case_id(*c) for c in REWEIGHT])
def test_crafted_conv_example_contributes_at_most_C_in_channels_last(name, cfg, kind, case, build, example):
    """memory_format=auto runs a CPU CNN channels-last (runner/memory_format.py): the conv rule's unfold is then a
    view of a channels-last input, its output-gradient channels-last. The same bound on the same crafted inputs."""
    torch.manual_seed(0)
    model = build(0).to(memory_format=torch.channels_last)
    x = example(torch.Generator().manual_seed(1), EPS).contiguous(memory_format=torch.channels_last)
    assert any(p.dim() == 4 and not p.is_contiguous() for p in model.parameters())  # really channels-last
    worst = max(contribution(name, cfg, model, x, fraction) for fraction in (0.01, 0.9))
    assert worst <= 1 + TOL, f"{case}: an example contributed {worst:.6g} x C in channels-last"


BK_KEEPS = [("reweight", {"mode": "bk"}), ("reweight", {"mode": "bk", "keep": 1000})]


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("kind,case,build,example", CONV, ids=[c[1] for c in CONV])
@pytest.mark.parametrize("name,cfg", BK_KEEPS, ids=[case_id(*c) for c in BK_KEEPS])
def test_crafted_conv_example_contributes_at_most_C_by_rows(monkeypatch, name, cfg, kind, case, build, example,
                                                             layout):
    """Book-keeping on the CPU forms a kept conv G_i by output rows, without the unfolded input, above
    conv.ROWS_FLOOR_BYTES (runner/norms/conv.py): the route at these small sizes, the same bound on the same
    crafted inputs, and the route really taken (ConvRule.records_norm_sq answered)."""
    from runner.norms import conv

    monkeypatch.setattr(conv, "ROWS_FLOOR_BYTES", 0)
    answered = []
    real = conv.ConvRule.records_norm_sq
    monkeypatch.setattr(conv.ConvRule, "records_norm_sq",
                        lambda self, *a: (lambda r: (answered.append(r is not None), r)[1])(real(self, *a)))
    torch.manual_seed(0)
    model, x = build(0), example(torch.Generator().manual_seed(1), EPS)
    if layout == "channels_last":
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    worst = max(contribution(name, cfg, model, x, fraction) for fraction in (0.01, 0.9))
    assert worst <= 1 + TOL, f"{case}: an example contributed {worst:.6g} x C by rows"
    if cfg.get("keep") == 1000:  # every G_i kept: the rows route wherever a conv allows it (one group, no dilation)
        convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
        if all(m.groups == 1 and all(d == 1 for d in m.dilation) for m in convs):
            assert answered and any(answered), f"{case}: the rows route was not taken"


def test_a_non_finite_record_adds_nothing_by_rows(monkeypatch):
    """The same with the conv's kept G_i formed by rows: the record with inf/nan adds nothing, the others all."""
    from runner.norms import conv

    monkeypatch.setattr(conv, "ROWS_FLOOR_BYTES", 0)
    for value in (float("inf"), float("nan")):
        test_a_non_finite_record_adds_nothing_and_the_others_everything("bk", value, "conv_norms")


@pytest.mark.parametrize("route", ["chunks", "compiled"])
@pytest.mark.parametrize("name,cfg", [("jl", {"r": 2}), ("reweight", {"mode": "twopass"})], ids=["jl", "twopass"])
def test_a_dropped_record_adds_nothing_in_chunks_and_compiled(name, cfg, route):
    """The same through physical_batch_size (the record in the second of two chunks) and through compile= (its
    padded, traced chunk; the check and the second pass run eager after it): exactly the release without it."""
    from runner.methods.compiled import CompiledStep

    torch.manual_seed(0)
    model = Mlp(Square())
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    x[2] = 1e20

    def release(xs, ys):
        method = METHODS.build(name, cfg=cfg, clip=0.5, sigma=0.0)
        method.configure(physical_batch_size=2 if route == "chunks" else None)
        method.privacy_check = False
        m = method.attach(copy.deepcopy(model))
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        step = CompiledStep(method, "default", x.device, physical=8, backend="eager") if route == "compiled" \
            else method.step
        for _ in range(2 if route == "compiled" else 1):  # a compiled step's first call runs eager
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            step(m, ce, xs, ys, opt, sample_rate=1.0, expected_batch_size=1.0)
        if route == "compiled":
            assert step.compiled is not None
        return torch.cat([p.grad.double().flatten() for p in m.parameters()])

    with_record = release(x, y)
    assert torch.isfinite(with_record).all()
    # without it (chunks 0, 1 | 3; jl's directions drawn once per logical step, the same): the three others' sum
    torch.testing.assert_close(with_record, release(x[[0, 1, 3]], y[[0, 1, 3]]), rtol=1e-5, atol=1e-7)
