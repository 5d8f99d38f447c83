"""Issue 31: a compiled chunk (runner/methods/compiled.py) must be one that Inductor can capture in a CUDA graph under
compile=reduce-overhead. Inductor skips the capture (and then launches every kernel from the host) when the graph
holds a CPU tensor (a constant such as the 0 of `w[pad] = 0`, turned into a CPU tensor by tracing: stop 32's
compiled bk GPT-2-small step was not replayed, 3.1x the replayed non-private step), an op its CUDA-graph check
rejects, a data-dependent shape, or a mutation of an input that is not a parameter or buffer. The same checks, made
on the CPU on the graph AOTAutograd hands to Inductor (torch._inductor's own check for the unsafe ops): any tensor
constant counts, since on a GPU one made without a device lives on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import get_first_incompatible_cudagraph_node

from runner.data.base import DataInfo
from runner.methods import METHODS
from runner.methods.compiled import CompiledStep

CPU = torch.device("cpu")
TEXT = DataInfo("tokens12", (12,), 2, "text", 50, 100, 100)
MODELS_ = {  # the compiled paths of the GPU bench's families: embedding (padding row), attention, LayerNorm,
    # recurrent cells, convolutions with GroupNorm
    "transformer": (TEXT, {"layers": 2, "d_model": 16, "heads": 2, "ff": 32, "dropout": 0.1}),
    "bilstm": (TEXT, {}),
    "bu_cnn": (DataInfo("mnist", (1, 28, 28), 10, "image", 0, 100, 100), {}),
}
METHODS_ = [("nonprivate", {}), ("reweight", {"mode": "bk"})]


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def reasons(gm: torch.fx.GraphModule, example_inputs=()) -> list[str]:
    """Why Inductor would not capture this (post-AOTAutograd, inference) graph in a CUDA graph; [] if it would."""
    found = [f"non-tensor input {type(t).__name__}" for t in example_inputs
             if not isinstance(t, (torch.Tensor, torch.SymInt, torch.Generator))]
    if (node := get_first_incompatible_cudagraph_node(gm)) is not None:
        found.append(f"incompatible op {node.target}")
    placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, node.target), torch.Tensor):
            found.append(f"tensor constant {node.target} used by {[str(u.target) for u in node.users]}")
        if node.op == "call_function" and "copy_" in str(node.target) and node.args[0] in placeholders:
            found.append(f"mutated input {node.args[0].name}")
    return found


MODELS_.update({"lstm": (DataInfo("mnist", (1, 28, 28), 10, "image", 0, 100, 100), {}),  # unidirectional cells
                "resnet18": (DataInfo("cifar10", (3, 32, 32), 10, "image", 0, 100, 100), {})})  # residual convs
BK = ("reweight", {"mode": "bk"})
CASES = ([(m, *c, "fp32") for m in ("transformer", "bilstm", "bu_cnn") for c in METHODS_]
         + [(m, *BK, "fp32") for m in ("lstm", "resnet18")] + [("transformer", *BK, "bf16"), ("transformer", *BK, "bf16tc"),
                                                                ("transformer", "jl", {"r": 2, "jvp": "forward"}, "fp32")])


@pytest.mark.parametrize("model_name,name,cfg,precision", CASES,
                         ids=[f"{m}-{n}-{'-'.join(map(str, c.values()))}-{p}" for m, n, c, p in CASES])
def test_the_compiled_chunk_is_capturable_in_a_cuda_graph(model_name, name, cfg, precision, monkeypatch):
    """bf16tc: bf16 with the tensor-core route (DPRUN_TENSOR_CORES=1 on a GPU), its arithmetic emulated on the CPU."""
    from runner.models import MODELS
    from runner.norms import tensor_cores

    if precision == "bf16tc":
        monkeypatch.setattr(tensor_cores, "EMULATE", True)
        precision = "bf16"

    graphs: list[list[str]] = []

    def inspect(gm, example_inputs):
        graphs.append(reasons(gm, example_inputs))
        return gm.forward

    backend = aot_autograd(fw_compiler=inspect, keep_inference_input_mutations=True)
    info, kwargs = MODELS_[model_name]
    torch.manual_seed(0)
    model = MODELS.build(model_name, info, **kwargs)
    method = METHODS.build(name, cfg=cfg, clip=0.5, sigma=1.0).configure(precision=precision)
    model = method.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(1, 50, (5, *info.input_shape), generator=g) if info.kind == "text"
         else torch.randn(5, *info.input_shape, generator=g))
    y = torch.randint(0, info.num_classes, (5,), generator=g)
    torch._dynamo.reset()
    step = CompiledStep(method, "default", CPU, physical=8, backend=backend)
    for _ in range(2):  # the first step eager (validation), the second compiles
        step(model, loss_fn, x, y, opt, sample_rate=0.05, expected_batch_size=5.0, generator=g)
    assert step.compiled is not None and graphs, "nothing was compiled"
    assert graphs == [[]] * len(graphs), graphs


def test_the_check_finds_a_cpu_constant():
    """The check itself: `w[0] = 0` inside a compiled function is the CPU tensor constant it must report."""
    graphs: list[list[str]] = []

    def inspect(gm, example_inputs):
        graphs.append(reasons(gm))
        return gm.forward

    @torch.compile(backend=aot_autograd(fw_compiler=inspect, keep_inference_input_mutations=True), dynamic=False)
    def zero_first_row(w):
        w = w * 2
        w[0] = 0
        return w

    torch._dynamo.reset()
    zero_first_row(torch.ones(3, 2))
    assert any("tensor constant" in r for g in graphs for r in g), graphs
