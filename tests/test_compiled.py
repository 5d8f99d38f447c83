"""compile= (runner/methods/compiled.py): the compiled step equals the eager step to float tolerance on CPU, and
every fallback is taken with one logged line, never silently.

Default suite: Dynamo traces the whole step (backend="eager": graph capture and graph breaks, eager kernels), for
nonprivate, reweight and jl. -m slow: TorchInductor (compile=default) itself, minutes of compilation on a small CPU.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.compiled import CompiledStep, build_step, check_mode, physical_batch

CPU = torch.device("cpu")
CASES = [("nonprivate", {}), ("reweight", {"mode": "bk"}), ("reweight-twopass", {"mode": "twopass"}),
         ("reweight-recompute", {"mode": "recompute"}),
         ("jl", {"jvp": "forward"})]


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def setup(method_name, cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    method = METHODS.build(method_name.split("-")[0], cfg={**cfg, "r": 2}, clip=0.5, sigma=1.0)  # "reweight-twopass"
    model = method.attach(model)
    return model, method, torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)


def train(method_name, cfg, make_step, steps=3):
    """Three steps on Poisson-like batches of 4, 5, 6 rows (one physical size, 8); the final parameters."""
    model, method, opt = setup(method_name, cfg)
    step = make_step(method)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
    torch.manual_seed(5)
    noise = torch.Generator().manual_seed(3)
    outs = [step(model, loss_fn, x[:4 + i], y[:4 + i], opt, sample_rate=0.01, expected_batch_size=5.0,
                 generator=noise) for i in range(steps)]
    return [p.detach().clone() for p in model.parameters()], outs, step


def assert_close_params(a, b):
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


def check_equal(method_name, cfg, **compile_kwargs):
    ref, ref_outs, _ = train(method_name, cfg, lambda m: m.step)
    got, outs, step = train(method_name, cfg, lambda m: CompiledStep(m, "default", CPU, physical=8, **compile_kwargs))
    assert step.compiled is not None, "the step fell back to eager"
    assert_close_params(got, ref)
    for o, r in zip(outs, ref_outs):
        assert o.losses.shape == r.losses.shape
        torch.testing.assert_close(o.losses, r.losses, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method_name,cfg", CASES, ids=[c[0] for c in CASES])
def test_traced_step_equals_eager_step(method_name, cfg):
    torch._dynamo.reset()
    check_equal(method_name, cfg, backend="eager")


@pytest.mark.slow
@pytest.mark.parametrize("method_name,cfg", CASES, ids=[c[0] for c in CASES])
def test_inductor_compiled_step_equals_eager_step(method_name, cfg):
    torch._dynamo.reset()
    check_equal(method_name, cfg)


def one_line(caplog, text):
    lines = [r.getMessage() for r in caplog.records if text in r.getMessage()]
    assert len(lines) == 1, lines


@pytest.mark.parametrize("mode", ["reduce-overhead", "cudagraphs"])
def test_cuda_only_modes_fall_back_to_default_on_cpu(mode, caplog):
    _, method, _ = setup("nonprivate", {})
    with caplog.at_level(logging.WARNING, logger="dprun"):
        step = CompiledStep(method, mode, CPU, physical=8)
    assert step.mode == "default" and step.compiled is not None
    one_line(caplog, f"compile={mode} needs CUDA")


def test_method_not_compiled_runs_eager_with_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="dprun"):
        ref, _, _ = train("nxbp", {}, lambda m: m.step)
        got, _, step = train("nxbp", {}, lambda m: CompiledStep(m, "default", CPU, physical=8))
    assert step.mode == "off" and step.compiled is None
    one_line(caplog, "method=nxbp is not compiled")
    assert_close_params(got, ref)


def test_a_failing_compilation_falls_back_to_eager_once(caplog):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("backend exploded\nsecond line")

    def make(m):
        s = CompiledStep(m, "default", CPU, physical=8)
        s.compiled = broken
        return s

    ref, _, _ = train("reweight", {"mode": "bk"}, lambda m: m.step)
    with caplog.at_level(logging.WARNING, logger="dprun"):
        got, outs, step = train("reweight", {"mode": "bk"}, make)
    assert calls == [1] and step.compiled is None and step.mode == "off"
    one_line(caplog, "compile=default failed for method=reweight (RuntimeError: backend exploded)")
    assert_close_params(got, ref)
    assert [len(o.losses) for o in outs] == [4, 5, 6]


def test_modes_and_physical_batch():
    assert check_mode(False) == "off" and check_mode("default") == "default"
    with pytest.raises(DprunError, match="unknown compile"):
        check_mode("max-autotune-ish")
    _, method, _ = setup("nonprivate", {})
    assert build_step(method, "off", CPU) == method.step
    assert physical_batch(256) == 320 and physical_batch(64) % 8 == 0 and physical_batch(64) >= 64 + 4 * 8
