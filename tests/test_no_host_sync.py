"""Issue 12: nothing inside a private step reads a value back from the device (.item(), torch.unique's size,
Python branching on a tensor): on a GPU each is a sync that stalls the queue and keeps CUDA graphs from capturing
the step. Proof on the CPU: the whole step -- forward, per-example norms, clipping, backward, noise, optimizer --
runs on the meta device, where tensors have shapes but no values, so any op that needs a value raises. One read is
by design since stop 28 (reweight's clipped sums ask once a step whether every record is finite, in an eager step
only; jl, twopass and recompute once a chunk, runner/methods/dropped.py): it is answered here "no", which also runs their
second pass, and counted separately."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.data.base import DataInfo
from runner.methods import METHODS
from runner.models import MODELS

TEXT = DataInfo("imdb", (12,), 2, "text", 50)
MODELS_ = {
    "bu_cnn": (DataInfo("mnist", (1, 28, 28), 10), {}),
    "bilstm": (TEXT, {}),
    "bilstm_masked": (TEXT, {"mask_padding": True}),
    "transformer": (TEXT, {}),
    "resnet18": (DataInfo("cifar10", (3, 32, 32), 10), {}),
}
METHODS_ = [("nonprivate", {}), ("reweight", {"mode": "bk"}), ("reweight", {"mode": "twopass"}),
            ("reweight", {"mode": "recompute"}),
            ("jl", {"r": 2, "jvp": "forward"}), ("jl", {"r": 2, "jvp": "double_vjp"})]


def loss_fn(outputs, y):
    return F.cross_entropy(outputs, y, reduction="none")


@pytest.fixture(autouse=True)
def the_one_designed_read_answers_no(monkeypatch):
    """The one value an eager step reads by design (runner/norms/certify.py every_record_kept: are all records finite,
    so that no layer's records need masking) answers "no" here, as a compiled step does without asking: every other
    read still raises on the meta device. test_the_designed_read_is_one_per_step counts it."""
    from runner.norms import certify

    monkeypatch.setattr(certify, "every_record_kept", lambda keep, started=None: False)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("name,cfg", METHODS_, ids=lambda v: v if isinstance(v, str) else "-".join(map(str, v.values())))
@pytest.mark.parametrize("model_name", list(MODELS_))
def test_whole_step_runs_without_reading_a_value(model_name, name, cfg, optimizer):
    info, kwargs = MODELS_[model_name]
    model = MODELS.build(model_name.split("_")[0] if model_name != "bu_cnn" else "bu_cnn", info, **kwargs)
    method = METHODS.build(name, cfg=cfg, clip=1.0, sigma=1.0)
    model = method.attach(model).to("meta")
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, foreach=True) if optimizer == "sgd"
           else torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True))
    dtype = torch.long if info.kind == "text" else torch.float32
    x = torch.empty(4, *info.input_shape, device="meta", dtype=dtype)
    y = torch.empty(4, device="meta", dtype=torch.long)
    out = method.step(model, loss_fn, x, y, opt, sample_rate=0.01, expected_batch_size=4.0)
    assert out.losses.shape == (4,) and out.losses.device.type == "meta"
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_value_read_in_a_step_would_be_caught(monkeypatch):
    """The check can fail: a clip-factor function that reads the largest norm back (a typical "if norms.max() > C"
    shortcut) makes the same step raise on the meta device."""
    from runner.methods.base import Method, clip_factors

    def reads_a_value(self, norms):
        if float(norms.max()) <= self.clip:  # a host sync on a GPU
            return torch.ones_like(norms)
        return clip_factors(norms, self.clip)

    monkeypatch.setattr(Method, "clip_factors", reads_a_value)
    with pytest.raises((NotImplementedError, RuntimeError)):
        test_whole_step_runs_without_reading_a_value("bu_cnn", "reweight", {"mode": "bk"}, "sgd")


@pytest.mark.parametrize("model_name", ["bu_cnn", "transformer"])
def test_the_designed_read_is_one_per_step(monkeypatch, model_name):
    """reweight bk reads one value a step (every_record_kept), not one per layer: on the CPU, counted over 3 steps."""
    from runner.norms import certify

    reads = []
    monkeypatch.setattr(certify, "every_record_kept", lambda keep, started=None: reads.append(1) or bool(keep.all()))
    info, kwargs = MODELS_[model_name]
    model = MODELS.build(model_name, info, **kwargs)
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=1.0)
    method.privacy_check = False
    model = method.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = (torch.randint(1, 50, (4, *info.input_shape)) if info.kind == "text" else torch.randn(4, *info.input_shape))
    y = torch.randint(0, 2, (4,))
    for _ in range(3):
        method.step(model, loss_fn, x, y, opt, sample_rate=0.01, expected_batch_size=4.0)
    assert len(reads) == 3
