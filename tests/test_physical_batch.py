"""physical_batch_size: a logical batch processed in chunks is the same private step as the unchunked one.

For every method that clips per example (and non-private), on every model family of the exactness suite
(tests/test_exact_methods.py: its test modules with every method variant, its zoo with each method's default), a
Poisson batch of 5 processed in chunks of 2 (2 + 2 + 1) gives the same clipped sum, the same noise and the same
update as one pass: float64, the oracle's tolerance. Also: the empty batch and a chunk larger than the batch,
compile= with chunks padded to P, the library API's max_physical_batch_size, resume, and the CLI run of the issue.
"""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from conftest import compose_config, dprun_in_process
from runner.errors import DprunError
from runner.methods.features import Feature
from runner.methods import METHODS
from runner.models import MODELS
from tests.test_exact_methods import TOYS, VARIANTS, ZOO, batch

DT = torch.float64
OPTIONS = {**VARIANTS, "opacus": [{"grad_sample_mode": m} for m in ("hooks", "functorch", "ghost")],
           "jl": [{"r": 3, "jvp": "forward"}, {"r": 3, "jvp": "double_vjp"}]}
CHUNKED = [(name, cfg) for name, cls in METHODS.items() if cls.why_not(cls.__new__(cls), Feature.PHYSICAL_BATCH)
           is None for cfg in OPTIONS.get(name, [{}])]


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def case_id(name, cfg):
    return "-".join([name, *map(str, cfg.values())])


def step_once(name, cfg, build, info, physical, B=5, sigma=0.7):
    """One logical step (noise on, lr 0.1) from the same model, batch and random state; the updated parameters,
    the per-example losses and norms."""
    torch.manual_seed(0)
    model = build(info).to(DT)
    method = METHODS.build(name, cfg=cfg, clip=0.5, sigma=sigma).configure(physical_batch_size=physical)
    try:
        model = method.attach(model)
    except DprunError as e:
        pytest.skip(f"method={name} declares this model unsupported: {e}")
    x, y = batch(info, B, seed=B)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(11)  # jl's directions: drawn once per logical step from torch's RNG
    try:
        out = method.step(model, loss_fn, x, y, opt, sample_rate=0.05, expected_batch_size=4.0,
                          generator=torch.Generator().manual_seed(3))
    except DprunError as e:  # e.g. Opacus ghost on a shared embedding: refused at the first step, one line
        pytest.skip(f"method={name} refuses this model: {e}")
    return [p.detach().clone() for p in model.parameters()], out


def assert_same_step(name, cfg, build, info, B=5):
    want_params, want = step_once(name, cfg, build, info, None, B)
    got_params, got = step_once(name, cfg, build, info, 2, B)
    for a, b in zip(got_params, want_params):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got.losses, want.losses, rtol=1e-9, atol=1e-12)
    if want.norms is not None:
        torch.testing.assert_close(got.norms, want.norms, rtol=1e-9, atol=1e-12)
    assert got.mechanism == want.mechanism


def test_every_method_but_sbcd_takes_physical_batches():
    assert {n for n, _ in CHUNKED} == set(METHODS.names()) - {"sbcd"}
    with pytest.raises(DprunError, match=r"^method=sbcd cannot run with physical_batch_size: its block updates"):
        METHODS.build("sbcd").configure(physical_batch_size=8)


@pytest.mark.parametrize("toy", list(TOYS))
@pytest.mark.parametrize("name,cfg", CHUNKED, ids=[case_id(*c) for c in CHUNKED])
def test_chunked_step_equals_one_pass_on_test_modules(name, cfg, toy):
    build, info = TOYS[toy]
    assert_same_step(name, cfg, build, info)


ZOO_CASES = [(n, c) for n, c in CHUNKED if c == OPTIONS.get(n, [{}])[0]]


@pytest.mark.parametrize("model_name", list(ZOO))
@pytest.mark.parametrize("name,cfg", ZOO_CASES, ids=[case_id(*c) for c in ZOO_CASES])
def test_chunked_step_equals_one_pass_on_the_zoo(name, cfg, model_name):
    info, kw = ZOO[model_name]
    assert_same_step(name, cfg, lambda i: MODELS.build(model_name, i, **kw), info)


@pytest.mark.parametrize("name", ["nonprivate", "reweight", "jl", "multiloss"])
def test_an_empty_batch_and_a_chunk_larger_than_the_batch(name):
    """B=0: no chunk runs, the released gradient is the noise alone (/ expected B); non-private takes no step.
    B=1 with P=2: one partial chunk, the same as one pass."""
    build, info = TOYS["toy_frozen_mlp"]
    params_before, _ = step_once(name, {}, build, info, None, B=0, sigma=0.0)
    got_params, out = step_once(name, {}, build, info, 2, B=0)
    assert out.losses.shape == (0,)
    torch.manual_seed(0)
    initial = [p.detach() for p in build(info).to(DT).parameters()]
    moved = [not torch.equal(a, b) for a, b in zip(got_params, initial)]
    if name == "nonprivate":
        assert not any(moved)  # nothing to average
    else:  # the noise alone moved every trainable parameter
        assert moved == [p.requires_grad for p in build(info).parameters()]
        assert all(torch.equal(a, b) for a, b in zip(params_before, initial))  # sigma=0, B=0: nothing at all
    assert_same_step(name, {}, build, info, B=1)


def test_the_compiled_step_pads_each_chunk_to_p(monkeypatch):
    """compile= with physical_batch_size: after the first (eager, validating) step every chunk is padded to P (one
    graph); two steps give the eager unchunked steps' parameters."""
    from runner.methods.compiled import CompiledStep

    build, info = TOYS["toy_frozen_mlp"]
    x, y = batch(info, 5, seed=5)

    def two_steps(physical, compiled):
        torch.manual_seed(0)
        model = build(info).to(DT)
        method = METHODS.build("reweight", clip=0.5, sigma=0.7).configure(physical_batch_size=physical)
        model = method.attach(model)
        sizes, original = [], method.privatize
        monkeypatch.setattr(method, "privatize", lambda m, lf, xc, yc: sizes.append(len(yc)) or original(m, lf, xc, yc))
        step = CompiledStep(method, "default", torch.device("cpu"), physical=2, backend="eager") if compiled \
            else method.step
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        noise = torch.Generator().manual_seed(3)
        for _ in range(2):
            step(model, loss_fn, x, y, opt, sample_rate=0.05, expected_batch_size=4.0, generator=noise)
        return [p.detach() for p in model.parameters()], sizes

    want, _ = two_steps(None, compiled=False)
    got, sizes = two_steps(2, compiled=True)
    # the first step's privacy check (runner/methods/privacy_check/, on 4 examples or every one with an extreme key,
    # as drawn and reversed, each at the run's clip and two small ones: measured.py SMALL_FACTORS), step 1 eager;
    # step 2 compiled: its last chunk of 1 padded to 2
    assert sizes[0] >= 4 and sizes[:6] == [sizes[0]] * 6 and sizes[6:] == [2, 2, 1, 2, 2, 2], sizes
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_the_library_api_takes_max_physical_batch_size():
    import dprun

    def trained(**kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(DT)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(200, 4, generator=g, dtype=DT), torch.randint(0, 3, (200,), generator=g)
        private = dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.2), (x, y), method="reweight",
                                     batch_size=64, seed=1, **kw)
        for xb, yb in private.batches():
            private.step(xb, yb, loss_fn)
        return [p.detach() for p in private.model.parameters()], private.get_epsilon()

    (a, eps_a), (b, eps_b) = trained(), trained(max_physical_batch_size=16)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-9, atol=1e-12)
    assert eps_a == eps_b


def test_a_chunked_run_resumes_to_the_straight_run(tmp_path):
    from runner.train import train

    base = ["method=reweight", "epochs=2", "progress=false", "max_steps_per_epoch=4", "dtype=float64",
            "physical_batch_size=16"]
    straight = train(compose_config(base), tmp_path / "straight")
    train(compose_config(base[:1] + ["epochs=1"] + base[2:]), tmp_path / "cut")
    resumed = train(compose_config(base + [f"resume={tmp_path / 'cut'}"]), tmp_path / "cut")
    assert resumed["final"]["train_loss"] == pytest.approx(straight["final"]["train_loss"], rel=1e-12)
    assert resumed["final"]["epsilon"] == straight["final"]["epsilon"]


def test_the_cli_run_with_physical_batches_equals_the_run_without(tmp_path):
    """The issue's command: `dprun method=reweight dataset=digits batch_size=512 physical_batch_size=64
    dtype=float64 epochs=1` ends with the same weights, loss and epsilon as the same run without chunks."""
    base = ["method=reweight", "dataset=digits", "batch_size=512", "dtype=float64", "epochs=1", "progress=false"]
    for name, extra in (("one_pass", []), ("chunked", ["physical_batch_size=64"])):
        proc = dprun_in_process(*base, *extra, f"out_dir={tmp_path / name}", cwd=tmp_path)  # the CLI, in this process
        assert proc.returncode == 0, proc.stderr
    one, chunked = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("one_pass", "chunked"))
    assert chunked["config"]["physical_batch_size"] == 64 and one["config"]["physical_batch_size"] is None
    assert chunked["final"]["train_loss"] == pytest.approx(one["final"]["train_loss"], rel=1e-12)
    assert chunked["final"]["test_acc"] == one["final"]["test_acc"]
    assert chunked["final"]["epsilon"] == one["final"]["epsilon"]
    w_one, w_chunked = (torch.load(tmp_path / n / "checkpoint.pt", weights_only=True)["model"]
                        for n in ("one_pass", "chunked"))
    for k in w_one:
        torch.testing.assert_close(w_chunked[k], w_one[k], rtol=1e-10, atol=1e-12)
    assert pd.read_csv(tmp_path / "chunked" / "metrics.csv").steps.tolist() == [3]  # logical steps: round(1437 / 512)


@pytest.mark.parametrize("bad", ["physical_batch_size=0", "physical_batch_size=abc"])
def test_a_bad_physical_batch_size_is_one_line(bad):
    from runner.validate import validate_config

    with pytest.raises(DprunError, match=r"^physical_batch_size=.* is not valid: physical_batch_size must be null or "
                                         r"an integer >= 1"):
        validate_config(compose_config([bad]))
