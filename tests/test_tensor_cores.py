"""precision=bf16's tensor-core route for Linear layers (runner/norms/tensor_cores.py), run on the CPU with the same
arithmetic (tensor_cores.EMULATE: bf16 operands, exact float32 products, float32 accumulation): certified on crafted
inputs, exact against the float64 oracle within bf16's stated tolerances, and actually taken."""
from __future__ import annotations

import pytest
import torch

from runner.errors import DprunError
from runner.norms import outer
from runner.norms.coverage import plan_model
from runner.norms.lean import LeanRecorder
from runner.norms import tensor_cores as tc
from tests.test_certified_clipping import ALL, EPS, TOL, UNDER, contribution
from tests.test_precision import test_bf16_norms_and_clipped_sums_against_the_float64_oracle as oracle_check
from tests.test_precision import test_each_examples_contribution_is_at_most_c_under_bf16 as contribution_check

BK = [("reweight", {"mode": "bk", "norm": h}) for h in ("auto", "direct", "ghost")]
LINEAR_CASES = [c for c in ALL + UNDER if c[0] is torch.nn.Linear]  # UNDER: scaled for underflow (stop 35)


@pytest.fixture(params=["split", "single"])
def tensor_cores(monkeypatch, request):
    """The tensor-core route on the CPU, with each form of the clipped sum (DPRUN_TENSOR_CORES_SUM), and a count of
    its GEMMs (it must be taken, not silently skipped)."""
    monkeypatch.setattr(tc, "SUM", request.param)
    monkeypatch.setattr(tc, "EMULATE", True)
    calls = []
    real_mm, real_bmm = tc.mm, tc.bmm
    monkeypatch.setattr(tc, "mm", lambda x, y: calls.append("mm") or real_mm(x, y))
    monkeypatch.setattr(tc, "bmm", lambda x, y: calls.append("bmm") or real_bmm(x, y))
    return calls


def test_the_split_loses_at_most_2_to_the_minus_16_of_each_entry():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(10**5, generator=g) * torch.logspace(-30, 30, 10**5)
    t[:4] = torch.tensor([1 + 2**-9, -(1 + 2**-8 + 2**-20), 3.0e38, 1e-30])
    hi, lo = tc.split(t)
    assert hi.dtype == lo.dtype == torch.bfloat16
    left = (t.double() - hi.double() - lo.double()).abs()
    assert bool((left <= 2.0**-16 * t.double().abs()).all())
    assert float(left.max() / t.double().abs().max()) > 0  # not exact: the bound is what carries the certificate


@pytest.mark.parametrize("kind,case,build,example", LINEAR_CASES, ids=[c[1] for c in LINEAR_CASES])
@pytest.mark.parametrize("name,cfg", BK, ids=[c[1]["norm"] for c in BK])
def test_crafted_linear_inputs_contribute_at_most_C_on_tensor_cores(tensor_cores, name, cfg, kind, case, build,
                                                                     example):
    torch.manual_seed(0)
    model = build(0)
    x = example(torch.Generator().manual_seed(1), EPS)
    for fraction in (0.01, 0.9):
        ratio = contribution(name, cfg, model, x, fraction, precision="bf16")
        assert ratio <= 1 + TOL, f"{case}: an example contributed {ratio:.6g} x C on tensor cores"
    assert "mm" in tensor_cores  # the clipped sum went through the split bf16 GEMMs


@pytest.mark.parametrize("family", ["mlp", "transformer", "lstm", "toy_frozen_mlp"])
def test_tensor_core_norms_and_sums_against_the_float64_oracle(tensor_cores, family):
    for case in BK:
        oracle_check(*case, family)
    assert tensor_cores.count("mm") > 0


@pytest.mark.parametrize("family", ["mlp", "transformer"])
def test_each_examples_contribution_is_at_most_c_on_tensor_cores(tensor_cores, family):
    for case in BK:
        contribution_check(*case, family)
    assert tensor_cores


def worst_sum_over_c(T: int, how: str) -> float:
    """One example whose every entry of g is the same value, so nu g rounds the same way everywhere: the largest
    ||clipped sum|| / C over 400 clip norms C below its certified norm N (nu = C / N)."""
    a = torch.ones(1, T, 4, dtype=torch.bfloat16)
    g = torch.full((1, T, 3), 0.3, dtype=torch.bfloat16)
    N = float(outer.norm_sq(a, g, how).sqrt())
    worst = 0.0
    for C in torch.linspace(0.1, 0.99, 400, dtype=torch.float64) * N:
        nu = torch.tensor([float(C) / N], dtype=torch.float32)
        worst = max(worst, float(outer.clipped_sum(a, g, nu).double().norm()) / float(C))
    return worst


@pytest.mark.parametrize("T,how", [(1, "auto"), (5, "ghost"), (5, "direct")])
def test_the_sum_stays_within_C_where_one_bf16_rounding_would_not(monkeypatch, tensor_cores, T, how):
    """nu g rounded once to bf16 moves every entry the same way here (up to 2^-8): the sum exceeds C by ~0.3%. The
    split (hi + lo) and its SPLIT_LOSS term of the bound, or the single GEMM's SINGLE_LOSS term, keep it within C;
    without them this test sees the excess."""
    assert worst_sum_over_c(T, how) <= 1 + TOL
    if tc.SUM == "split":
        monkeypatch.setattr(tc, "SPLIT_LOSS", 0.0)
        monkeypatch.setattr(tc, "split", lambda t: (t.to(torch.bfloat16), torch.zeros_like(t, dtype=torch.bfloat16)))
    else:
        monkeypatch.setattr(tc, "SINGLE_LOSS", 0.0)
    assert worst_sum_over_c(T, how) > 1 + 1e-3


def test_single_sums_in_one_gemm_split_in_two_and_a_bad_mode_is_refused(monkeypatch):
    """DPRUN_TENSOR_CORES_SUM: "single" forms a Linear's clipped sum as one bf16 GEMM (the split's second one is a
    weight gradient's worth of work), with a bound 2^-8 S_i looser; anything but split/single is refused in one line."""
    monkeypatch.setattr(tc, "EMULATE", True)
    a = torch.randn(2, 5, 4).to(torch.bfloat16)
    g = torch.randn(2, 5, 3).to(torch.bfloat16)
    nu = torch.tensor([0.3, 0.7])
    gemms = {}
    for mode in ("split", "single"):
        monkeypatch.setattr(tc, "SUM", mode)
        calls = []
        with monkeypatch.context() as m:
            m.setattr(tc, "mm", lambda x, y, real=tc.mm: calls.append(1) or real(x, y))
            outer.clipped_sum(a, g, nu)
        gemms[mode] = len(calls)
        bound = outer.norm_sq(a, g, "ghost").sqrt()  # (2,)
        if mode == "split":
            split_bound = bound
    assert gemms == {"split": 2, "single": 1}
    ratio = bound / split_bound
    assert bool((ratio > 1).all() and (ratio < 1.02).all()), ratio  # looser by 2^-8 S_i: ~1% on this random data
    monkeypatch.setattr(tc, "SUM", "fast")
    with pytest.raises(DprunError, match=r"DPRUN_TENSOR_CORES_SUM='fast'.*split.*single") as err:
        outer.norm_sq(a, g, "ghost")
    assert "\n" not in str(err.value)


def test_bf16_records_outside_a_gpu_are_upcast():
    g = torch.ones(2, 3, dtype=torch.bfloat16)
    a, b = tc.records(torch.ones(2, 4), g, tensor_cores=True)  # the CPU: no tensor cores (EMULATE off)
    assert a.dtype == b.dtype == torch.float32
    assert outer.use_ghost(128, 768, 768, "auto") and not outer.use_ghost(512, 768, 768, "auto")


def test_the_route_is_taken_in_compiled_steps_by_default(monkeypatch):
    """DPRUN_TENSOR_CORES: auto (unset) takes the route in a compiled step only (an eager step is bound by launching
    the route's extra operators; a replayed graph is not: 1.55x vs 3.29x the compiled non-private step, see the
    module), 1 always, 0 never; anything else refused in one line naming the value and the modes."""
    monkeypatch.delenv("DPRUN_TENSOR_CORES", raising=False)
    assert tc.mode() == "auto" and not tc.enabled() and tc.enabled(compiled=True) and not tc.enabled(compiled=False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # what a step being traced sees
    assert tc.enabled()
    monkeypatch.setenv("DPRUN_TENSOR_CORES", "0")
    assert not tc.enabled() and not tc.enabled(compiled=True)
    monkeypatch.setenv("DPRUN_TENSOR_CORES", "1")
    assert tc.enabled(compiled=False)
    g = torch.ones(2, 3, dtype=torch.bfloat16)
    assert tc.records(torch.ones(2, 4), g, tensor_cores=True)[0].dtype == torch.float32  # still no CUDA here
    monkeypatch.setenv("DPRUN_TENSOR_CORES", "yes")
    with pytest.raises(DprunError, match=r"DPRUN_TENSOR_CORES='yes'.*auto.*1.*0") as err:
        tc.enabled()
    assert "\n" not in str(err.value)


def test_a_steps_route_is_fixed_when_its_recorder_is_made(monkeypatch):
    """The route is decided once per step (CallHooks.tensor_cores): a recorder made while the step was traced keeps
    it for every layer's norm and clipped sum, though the code after a graph break runs eagerly (a norm from bf16
    records and a clipped sum from float32 ones would not be the same tensor: up to ~2^-8 of S_i apart)."""
    monkeypatch.setattr(tc, "used_for", lambda g: g.dtype == torch.bfloat16)  # as a bf16 record on CUDA
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x, y = torch.randn(4, 6), torch.tensor([0, 1, 2, 1])
    plan = plan_model(model)
    for traced, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: traced)
            rec = LeanRecorder(plan, "auto", {}, capture_bytes=0)
        assert rec.tensor_cores is traced  # is_compiling() is False again from here on
        with rec, torch.autocast("cpu", dtype=torch.bfloat16):
            losses = torch.nn.functional.cross_entropy(model(x).float(), y, reduction="none")
        assert rec.backward(losses.sum(), len(y)) is not None
        kept = [calls for _, _, _, calls in rec.raw_layers()]
        assert kept and all(t.dtype == dtype for calls in kept for call in calls for t in call)


def test_the_summary_says_whether_the_route_was_used(tmp_path, monkeypatch):
    """summary.json's `tensor_cores`: on only for precision=bf16 on CUDA where the route is on (DPRUN_TENSOR_CORES=1, or
    auto with compile=); here a CPU run that asked for it records False, the route it did not take."""
    from conftest import compose_config
    from runner.train import train

    monkeypatch.setenv("DPRUN_TENSOR_CORES", "1")
    summary = train(compose_config(["progress=false", "method=reweight", "epochs=1", "max_steps_per_epoch=2",
                                    "precision=bf16", "max_eval_batches=1", "eval_batch_size=64"]), tmp_path)
    assert summary["tensor_cores"] is False and summary["config"]["precision"] == "bf16"
    assert summary["tensor_cores_sum"] is None  # the form of the sum only where the route ran


def test_a_run_with_a_bad_sum_form_stops_before_it_starts(tmp_path, monkeypatch):
    from conftest import compose_config
    from runner.train import train

    monkeypatch.setattr(tc, "SUM", "double")  # DPRUN_TENSOR_CORES_SUM=double when dprun started
    with pytest.raises(DprunError, match="DPRUN_TENSOR_CORES_SUM='double' is not a mode"):
        train(compose_config(["progress=false", "method=reweight", "epochs=1", "max_steps_per_epoch=1"]), tmp_path)
    assert not list(tmp_path.glob("**/summary.json"))
