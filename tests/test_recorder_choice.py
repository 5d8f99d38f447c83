"""method.recorder=auto: Recorder (full) on CUDA, where an H200 measured it faster than the lean recorder on every
GPU bench workload (stop 62), the lean recorder elsewhere and wherever one of its own settings (method.defer,
method.late, method.keep, method.keep_mb) is asked for. The choice is made per step from the step's device (ReweightGP.lean_on); no CUDA is needed to check it."""
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
    ({"keep": 0}, True, True),  # keep=0's least memory needs lean's records freed inside the backward (review 34)
    ({"keep_mb": 100}, True, True),
    ({"keep": 1.1}, True, False),  # the default ratio, written out: no memory asked for
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


def cuda_choice(method):
    """method.lean_on as on CUDA (the CPU's device type aside): Recorder under auto until it ran out of memory."""
    original = type(method).lean_on
    return lambda device: original(method, torch.device("cuda"))


@pytest.mark.parametrize("where", ["backward", "sums"])
def test_recorder_out_of_memory_falls_back_to_lean_for_this_step_and_the_next(where, monkeypatch, caplog):
    """Under auto on CUDA, Recorder holds every output-gradient at once (more memory than the lean recorder, which
    was the default before stop 62): where that runs out of memory, in its backward or in its clipped sums, the step
    starts again with the lean recorder (same random state: the same dropout masks; nothing summed twice), after the
    failed attempt's records are freed (review 35: they met the retry), says so in one log line, and the method keeps
    lean; an explicit method.recorder=full still raises."""
    import logging
    import weakref

    from runner.norms import hooks

    attempts, recorders = [], []
    backprops, clipped_sums, lean_recorder = hooks.Recorder.backprops, reweight.ReweightGP.clipped_sums, \
        reweight.LeanRecorder

    def failing_backprops(self, *args, **kwargs):
        recorders.append(weakref.ref(self))
        if where == "backward":
            attempts.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (emulated)")
        return backprops(self, *args, **kwargs)

    def failing_sums(rec, *args, **kwargs):
        if where == "sums" and isinstance(rec, hooks.Recorder):
            attempts.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (emulated)")
        return clipped_sums(rec, *args, **kwargs)

    def lean_after_the_failed_attempt(*args, **kwargs):
        assert all(r() is None for r in recorders), "the failed attempt's records are still held"
        return lean_recorder(*args, **kwargs)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    loss = lambda out, t: F.cross_entropy(out, t, reduction="none")  # noqa: E731

    def run(cfg, fail):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))
        method = METHODS.build("reweight", cfg={"mode": "bk", **cfg}, clip=0.5, sigma=0.0)
        method.privacy_check = False
        monkeypatch.setattr(method, "lean_on", cuda_choice(method))
        monkeypatch.setattr(hooks.Recorder, "backprops", failing_backprops if fail else backprops)
        monkeypatch.setattr(reweight.ReweightGP, "clipped_sums", staticmethod(failing_sums if fail else clipped_sums))
        monkeypatch.setattr(reweight, "LeanRecorder", lean_after_the_failed_attempt if fail else lean_recorder)
        model = method.attach(model)
        steps = []
        for _ in range(2):
            torch.manual_seed(1)  # each step's dropout masks
            method.clipped_sum(model, loss, x, y)
            steps.append([p.grad.clone() for p in model.parameters()])
        return steps

    lean = run({"recorder": "lean"}, fail=False)
    with caplog.at_level(logging.WARNING, logger="dprun"):
        fell_back = run({}, fail=True)
    assert len(attempts) == 1  # Recorder failed once; the second step went lean at once
    assert sum("out of memory with Recorder" in r.getMessage() for r in caplog.records) == 1
    for want, got in zip(lean, fell_back):
        for a, b in zip(want, got):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same step as lean's, dropout masks included
    with pytest.raises(torch.OutOfMemoryError):
        run({"recorder": "full"}, fail=True)
