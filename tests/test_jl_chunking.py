"""JL on large models (issue 12): out of memory with several directions per pass halves method.chunk (logged) and
retries with the same directions, keeping forward mode; the chunked step equals the unchunked one."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import runner.methods.jl as jl_module
from runner.methods import METHODS


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def jl_step(monkeypatch=None, max_per_pass=None, chunk=0, r=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    method = METHODS.build("jl", cfg={"jvp": "auto", "chunk": chunk, "r": r}, clip=0.3, sigma=0.0)
    model = method.attach(model)
    if max_per_pass is not None:  # a device that holds at most `max_per_pass` tangents at once
        real = jl_module.forward_projections

        def limited(model, loss_fn, x, y, directions, chunk=0):
            k = chunk if 0 < chunk < r else r
            if k > max_per_pass:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return real(model, loss_fn, x, y, directions, chunk)

        monkeypatch.setattr(jl_module, "forward_projections", limited)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    torch.manual_seed(9)
    out = method.step(model, loss_fn, x, y, opt, sample_rate=0.01, expected_batch_size=4.0)
    return method, out, [p.grad.clone() for p in model.parameters()]


def test_out_of_memory_halves_the_chunk_and_gives_the_same_step(monkeypatch, caplog):
    _, ref_out, ref = jl_step()
    with caplog.at_level(logging.WARNING, logger="dprun"):
        method, out, got = jl_step(monkeypatch, max_per_pass=2)
    assert method.chunk == 1 or method.chunk == 2  # 6 -> 3 -> 1: the first size that fits (<= 2)
    assert method.active == "forward"  # forward mode kept (no switch to double_vjp)
    assert len([r for r in caplog.records if "out of memory" in r.getMessage()]) == 2
    torch.testing.assert_close(out.norms, ref_out.norms)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_chunked_step_equals_unchunked(chunk):
    _, ref_out, ref = jl_step(chunk=0)
    _, out, got = jl_step(chunk=chunk)
    torch.testing.assert_close(out.norms, ref_out.norms)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_out_of_memory_at_one_direction_per_pass_is_raised(monkeypatch):
    with pytest.raises(torch.OutOfMemoryError):
        jl_step(monkeypatch, max_per_pass=0)
