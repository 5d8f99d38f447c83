"""The step's one designed read (runner/norms/certify.py read_started / every_record_kept): on CUDA keep.all() is sent
to the host behind an event BEFORE the clipped sums are launched, and the host waits for that event only. The CUDA
calls themselves run on a GPU (make device-check); here, on the CPU, the wiring: which value the step acts on, that
the wait is the event's, and that a "not all kept" answer from the event makes book-keeping mask, exactly."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from runner.bench.common import loss_fn
from runner.methods import METHODS
from runner.norms import certify


class FakeEvent:
    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def test_the_cpu_and_the_meta_device_read_the_value_itself():
    assert certify.read_started(torch.ones(3, dtype=torch.bool)) is None
    assert certify.read_started(torch.ones(3, dtype=torch.bool, device="meta")) is None
    assert certify.every_record_kept(torch.tensor([True, False])) is False
    assert certify.every_record_kept(torch.tensor([True, True])) is True


def test_a_started_read_waits_for_its_event_and_answers_its_value(monkeypatch):
    """The answer is the value sent before the sums (host), after the event's wait; not a new read of keep."""
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    done = FakeEvent()
    assert certify.every_record_kept(torch.ones(4, dtype=torch.bool), (torch.tensor(False), done)) is False
    assert done.waits == 1
    assert certify.every_record_kept(torch.zeros(4, dtype=torch.bool), (torch.tensor(True), done)) is True
    assert done.waits == 2


def test_the_event_wait_is_counted_under_sync_debug_mode(monkeypatch):
    """An event wait raises no sync-debug warning of torch's own: bench-syncs would miss the step's one read."""
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        certify.every_record_kept(torch.ones(2, dtype=torch.bool), (torch.tensor(True), FakeEvent()))
    assert any("the step's one read" in str(w.message) for w in seen)


@pytest.mark.parametrize("recorder", ["lean", "full"])
def test_book_keeping_acts_on_the_started_read(monkeypatch, recorder):
    """With read_started's handle answering "not all kept", book-keeping forms its sums again, masked: one wait a
    step, and the released sum still equals nxBP's (every record here is finite: masked = unmasked)."""
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    events, passes = [], []
    monkeypatch.setattr(certify, "read_started", lambda keep: (torch.tensor(False), events.append(FakeEvent())
                                                              or events[-1]))
    real = certify.clipped_sums_of

    def counted(nu, keep, all_kept):
        passes.append(all_kept)
        return real(nu, keep, all_kept)

    from runner.methods import reweight

    monkeypatch.setattr(reweight, "clipped_sums_of", counted)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    oracle = METHODS.build("nxbp", clip=0.3, sigma=0.0)
    oracle.privacy_check = False
    ref = oracle.attach(copy.deepcopy(model))
    expected = oracle.privatize(ref, loss_fn, x, y)
    method = METHODS.build("reweight", cfg={"mode": "bk", "recorder": recorder}, clip=0.3, sigma=0.0)
    method.privacy_check = False
    m = method.attach(copy.deepcopy(model))
    out = method.privatize(m, loss_fn, x, y)
    assert len(events) == 1 and events[0].waits == 1
    assert passes == [True, False]  # unmasked first, then masked because the started read said "not all kept"
    torch.testing.assert_close(out.norms, expected.norms, rtol=1e-6, atol=0)
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)
