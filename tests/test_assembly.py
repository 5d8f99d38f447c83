"""One assembly of a private run (runner/assembly.py) for the CLI and the API: both go through it, with the same
request for the same knobs, so they cannot drift apart; and its errors speak the caller's words."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dprun
from conftest import compose_config
from runner import assembly
from runner.errors import DprunError
from runner.train import set_up
from runner.distributed import World


def blobs(n=200):
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.randn(n, 64, generator=g) + 3 * F.one_hot(y, 64).float(), y


@pytest.fixture
def seen(monkeypatch):
    """Every Request that reached assembly.assemble (the real one still runs)."""
    requests = []
    real = assembly.assemble

    def spy(request, *args, **kwargs):
        requests.append(request)
        return real(request, *args, **kwargs)

    monkeypatch.setattr(assembly, "assemble", spy)
    for module in ("runner.train", "runner.api"):  # the name each caller looked up at import
        monkeypatch.setattr(f"{module}.assemble", spy)
    return requests


def test_cli_and_api_assemble_the_same_private_run(seen, tmp_path):
    cfg = compose_config(["dataset=digits", "model=mlp", "method=reweight", "clip=0.7", "sigma=1.3", "delta=1e-5",
                          "epochs=2", "batch_size=20", "accountant=rdp", "physical_batch_size=8", "progress=false"])
    cli = set_up(cfg, tmp_path, World())
    x, y = blobs()
    model = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 3))
    api = dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), method="reweight",
                             max_grad_norm=0.7, noise_multiplier=1.3, delta=1e-5, epochs=2, batch_size=20, seed=0,
                             accountant="rdp", max_physical_batch_size=8)
    assert len(seen) == 2, "the CLI's set_up and the API's make_private must both call runner.assembly.assemble"
    cli_request, api_request = seen
    for key in ("method", "clip", "sigma", "sampling", "accountant", "physical_batch_size", "precision", "epochs",
                "target_epsilon", "delta"):
        assert getattr(cli_request, key) == getattr(api_request, key), key
    # what it assembled is what each caller runs
    assert type(cli.method) is type(api.method) and cli.accountant.name == api.accountant.name == "rdp"
    assert cli.method.physical_batch_size == api.method.physical_batch_size == 8


def test_a_cpu_run_keeps_its_freed_heap_for_the_cli_and_the_api_alike(monkeypatch, tmp_path):
    """runner/heap.py's retain_freed_memory, asked for by the assembly both callers share (a CPU model: no page
    faults from one step's freed blocks in the next), not by the CLI alone."""
    calls = []
    monkeypatch.setattr(assembly, "retain_freed_memory", lambda: calls.append(1) or True)
    x, y = blobs()
    model = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 3))
    dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), batch_size=20, seed=0)
    assert calls == [1]
    set_up(compose_config(["dataset=digits", "model=mlp", "epochs=1", "progress=false"]), tmp_path, World())
    assert calls == [1, 1]


def test_errors_speak_the_callers_words():
    x, y = blobs()
    model = nn.Sequential(nn.Linear(64, 3))
    with pytest.raises(DprunError, match=r"^max_physical_batch_size=0 must be an integer >= 1") as e:
        dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), batch_size=20,
                           max_physical_batch_size=0)
    assert "\n" not in str(e.value)
    with pytest.raises(DprunError, match=r"target_epsilon needs poisson=True"):
        dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), batch_size=20,
                           poisson=False, target_epsilon=2.0, epochs=1)
    request = assembly.Request(method="reweight", method_options={}, clip=1.0, sigma=1.0, physical_batch_size=0)
    with pytest.raises(DprunError, match=r"^physical_batch_size=0 must"):
        assembly.build_method(request, World())
