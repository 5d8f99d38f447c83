"""runner/backward_thread.py: on CUDA an eager step's backward runs in the calling thread (book-keeping's Python norm
hooks off autograd's device thread). No GPU here: the context is checked for a CUDA device object (it needs none),
and the wiring through Method.clipped_sum by pretending the CPU step's device is CUDA's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import runner.methods.base as base
from runner.backward_thread import backward_in_this_thread
from runner.methods import METHODS
from runner.methods.padding import padded_step


def test_cuda_eager_backward_runs_in_this_thread_and_the_setting_comes_back():
    assert torch.autograd.is_multithreading_enabled()
    with backward_in_this_thread(torch.device("cuda")):
        assert not torch.autograd.is_multithreading_enabled()
    assert torch.autograd.is_multithreading_enabled()


@pytest.mark.parametrize("device, compiled", [("cpu", False), ("cuda", True), ("meta", False)])
def test_cpu_other_devices_and_compiled_steps_keep_autograds_threads(device, compiled):
    with backward_in_this_thread(torch.device(device), compiled=compiled):
        assert torch.autograd.is_multithreading_enabled()


def seen_during_backward(monkeypatch, method_name, cfg, padded=False):
    """Whether autograd's multithreading was on inside the step's backward (a tensor hook on the model's output reads
    it), with clipped_sum believing its device is CUDA."""
    real = base.backward_in_this_thread
    monkeypatch.setattr(base, "backward_in_this_thread",
                        lambda device, compiled=False: real(torch.device("cuda"), compiled))
    seen = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            out = self.fc(x)
            if out.requires_grad:  # (not in the privacy check's no-grad forward)
                out.register_hook(lambda g: seen.append(torch.autograd.is_multithreading_enabled()))
            return out

    torch.manual_seed(0)
    method = METHODS.build(method_name, cfg=cfg, clip=1.0, sigma=0.0)
    method.privacy_check = False  # the observing hook is a gradient hook, which twopass and jl refuse
    model = method.attach(Net())
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    loss_fn = lambda out, y: F.cross_entropy(out, y, reduction="none")  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    kw = dict(sample_rate=0.01, expected_batch_size=6.0)
    for _ in range(2):  # the first step's privacy check (once per run, before the chunks) runs its own backward
        seen.clear()
        if padded:
            padded_step(method, model, loss_fn, x, y, opt, physical=8, **kw)
        else:
            method.step(model, loss_fn, x, y, opt, **kw)
    assert seen, "the hook never ran"
    assert torch.autograd.is_multithreading_enabled()  # put back after the step
    return set(seen)


@pytest.mark.parametrize("method_name, cfg", [("nonprivate", {}), ("reweight", {"mode": "bk"}),
                                              ("reweight", {"mode": "twopass"}), ("nxbp", {})])
def test_an_eager_cuda_step_runs_its_backward_in_the_calling_thread(monkeypatch, method_name, cfg):
    assert seen_during_backward(monkeypatch, method_name, cfg) == {False}


def test_a_step_given_its_own_privatize_keeps_autograds_threads(monkeypatch):
    """compile= and padding pass their own privatize: not measured with the change, so left as they were."""
    assert seen_during_backward(monkeypatch, "reweight", {"mode": "bk"}, padded=True) == {True}
