"""precision=tf32: TF32 products in the step's forward and backward on CUDA, the norms and clipped sums still exact
float32 (runner/precision.py matmul_precision, runner/norms/certify.py exact_float32); precision=fp32 turns cuDNN's
default TF32 off for the step. No GPU is needed: the switches are torch.backends flags, set by device type."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runner.errors import DprunError
from runner.methods import METHODS
from runner.methods.features import Feature
from runner.norms.certify import exact_float32
from runner.precision import matmul_precision
from tests.test_precision import ALL, case_id

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def flags():
    """torch.backends' TF32 flags, put back after the test."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    yield lambda: (matmul.allow_tf32, cudnn.allow_tf32)
    matmul.allow_tf32, cudnn.allow_tf32 = saved


@pytest.mark.parametrize("before", [(False, True), (True, False)])
def test_the_step_context_sets_tf32_by_precision_and_the_norms_turn_it_off(flags, before):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    with matmul_precision(CUDA, "tf32"):
        assert flags() == (True, True)
        with exact_float32(CUDA):  # what every norm and clipped sum runs under
            assert flags() == (False, False)
        assert flags() == (True, True)
    assert flags() == before
    with matmul_precision(CUDA, "fp32"):
        assert flags() == (False, False)  # torch's default cuDNN TF32 is off for an fp32 step
    assert flags() == before
    with matmul_precision(CUDA, "bf16"):  # a compiled bf16 step keeps no per-layer switch: off for the step
        assert flags() == (False, False)
    assert flags() == before
    for device, precision in ((CPU, "tf32"), (CPU, "fp32")):
        with matmul_precision(device, precision):
            assert flags() == before


def test_only_reweight_bk_and_nonprivate_accept_tf32_the_others_say_why_in_one_line():
    accepted = {case_id(n, c) for n, c in ALL if METHODS.build(n, cfg=c).why_not(Feature.TF32) is None}
    assert accepted == {case_id(n, c) for n, c in ALL if n == "reweight" and c["mode"] == "bk"}  # any norm choice
    assert "reweight-bk" in accepted
    assert METHODS.build("nonprivate").why_not(Feature.TF32) is None
    for name, cfg in ALL:
        if case_id(name, cfg) not in accepted:
            with pytest.raises(DprunError, match=rf"^method={name} cannot run with precision=tf32: [^\n]+$"):
                METHODS.build(name, cfg=cfg).configure(precision="tf32")


def test_the_step_runs_its_chunks_under_the_methods_precision(monkeypatch):
    """Method.clipped_sum enters matmul_precision(device, precision) around the chunks (and the first step's privacy
    check); on the CPU tf32 changes
    nothing: the same released sum as fp32, bit for bit."""
    import runner.methods.base as base

    seen = []
    real = base.matmul_precision
    monkeypatch.setattr(base, "matmul_precision", lambda d, p: seen.append((d.type, p)) or real(d, p))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)
    sums = {}
    for precision in ("fp32", "tf32"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=0.5, sigma=0.0).configure(
            precision=precision, physical_batch_size=5)
        model = method.attach(model)
        method.clipped_sum(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y)
        sums[precision] = [p.grad.clone() for p in model.parameters()]
    assert seen == [("cpu", "fp32")] * 2 + [("cpu", "tf32")] * 2  # the first step's privacy check, then the chunks
    assert all(torch.equal(a, b) for a, b in zip(sums["fp32"], sums["tf32"]))


def test_a_compiled_graph_drops_the_tf32_switch_so_compile_with_tf32_is_refused(flags):
    """Why compile= refuses precision=tf32 for a private method: Dynamo records the TF32-off switch of exact_float32
    as a call in its graph, but AOTAutograd (what Inductor compiles) keeps aten ops only, so the norms' products would
    run under the step's TF32 setting. Found at stop 34; eager bk keeps the switch (the test above)."""
    from torch._dynamo.backends.common import aot_autograd

    from runner.methods.compiled import CompiledStep

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm.graph)
        return gm.forward

    def norm_like(a, b):  # what exact_float32(CUDA) did before it stood aside under compile: a run-time switch
        torch.backends.cuda.matmul.allow_tf32 = False  # traced on the CPU: the flags are global, not device state
        out = a @ b
        torch.backends.cuda.matmul.allow_tf32 = True
        return out

    torch.backends.cuda.matmul.allow_tf32 = True
    torch._dynamo.reset()
    torch.compile(norm_like, backend=aot_autograd(fw_compiler=keep))(torch.randn(3, 3), torch.randn(3, 3))
    targets = [str(n.target) for n in graphs[0].nodes if n.op == "call_function"]
    assert targets == ["aten.mm.default"], targets  # the switch is not in the graph Inductor compiles

    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=1.0).configure(precision="tf32")
    with pytest.raises(DprunError, match=r"compile=default cannot run with precision=tf32 .*use precision=fp32 or bf16"):
        CompiledStep(method, "default", CUDA, physical=8)
    assert CompiledStep(method, "off", CUDA, physical=8).mode == "off"  # eager keeps the switch
    assert CompiledStep(method, "default", CPU, physical=8).mode == "default"  # tf32 changes nothing on the CPU
    nonprivate = METHODS.build("nonprivate", cfg={}, clip=1.0, sigma=1.0).configure(precision="tf32")
    assert CompiledStep(nonprivate, "default", CPU, physical=8).mode == "default"  # nothing to certify
