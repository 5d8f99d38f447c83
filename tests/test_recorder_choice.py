"""method.recorder=auto: Recorder (full) on CUDA, where an H200 measured it faster than the lean recorder on every
GPU bench workload (stop 62), the lean recorder elsewhere and wherever a lean-only setting (method.defer, method.late)
is set. The choice is made per step from the step's device (ReweightGP.lean_on); no CUDA is needed to check it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.methods import METHODS
from runner.methods import reweight

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("cfg, on_cpu, on_cuda", [
    ({}, True, False),  # auto: lean on the CPU, Recorder on CUDA
    ({"late": "on"}, True, True),  # a lean-only setting asked for: lean everywhere
    ({"defer": "all"}, True, True),
    ({"recorder": "lean"}, True, True),
    ({"recorder": "full"}, False, False),
    ({"recorder": "full", "late": "on"}, False, False),  # an explicit choice is kept
])
def test_auto_picks_recorder_on_cuda_and_lean_elsewhere(cfg, on_cpu, on_cuda):
    method = METHODS.build("reweight", cfg={"mode": "bk", **cfg}, clip=1.0, sigma=0.0)
    assert (method.lean_on(CPU), method.lean_on(CUDA)) == (on_cpu, on_cuda)


def test_the_step_takes_the_recorder_lean_on_names(monkeypatch):
    """A bk step makes a LeanRecorder only where lean_on says so (CUDA's choice emulated on the CPU), and both
    recorders release the same clipped sum."""
    made = []
    original = reweight.LeanRecorder

    def counting(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(reweight, "LeanRecorder", counting)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    sums = []
    for lean in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=0.5, sigma=0.0)
        monkeypatch.setattr(method, "lean_on", lambda device, lean=lean: lean)
        model = method.attach(model)
        made.clear()
        method.clipped_sum(model, lambda out, t: F.cross_entropy(out, t, reduction="none"), x, y)
        assert bool(made) == lean  # (the first step's privacy check steps too: several recorders where lean)
        sums.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*sums):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
