"""method=multiloss: torch.func vmap(grad) per-example gradients, clipped and summed (equal to nxBP's).

The zoo-wide equality with nxBP lives in tests/test_exact_methods.py; here: the multiLoss specifics (chunking,
edge batch sizes, dtypes, dropout under vmap, untraceable models, the training step).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.accountants.mechanisms import SubsampledGaussian
from runner.data.base import DataInfo
from runner.errors import DprunError
from runner.methods import METHODS
from runner.models import MODELS


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def clipped(method_name, model, x, y, clip=0.5, **cfg):
    for p in model.parameters():
        p.grad = None
    method = METHODS.build(method_name, cfg=cfg, clip=clip)
    out = method.privatize(method.attach(model), loss_fn, x, y)
    return out, [p.grad.clone() for p in model.parameters() if p.requires_grad]


MNIST_ROWS = DataInfo("mnist", (1, 7, 5), 10)
IMDB = DataInfo("imdb", (6,), 2, kind="text", vocab_size=12)
MODELS_UNDER_TEST = {
    "lstm": (MNIST_ROWS, dict(hidden=6)),  # a Linear called once per time step
    "bilstm": (IMDB, dict(hidden=4, embed_dim=3, dense=4)),
    "transformer": (IMDB, dict(d_model=8, heads=2, ff=6, dropout=0.0)),
    "cnn": (DataInfo("mnist", (1, 12, 12), 10), dict(widths=(3, 4), hidden=5)),
}


def inputs(info, B, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, info.num_classes, (B,), generator=g)
    if info.kind == "text":
        return torch.randint(0, info.vocab_size, (B, *info.input_shape), generator=g), y
    return torch.randn(B, *info.input_shape, generator=g, dtype=torch.float64), y


@pytest.mark.parametrize("name", list(MODELS_UNDER_TEST))
@pytest.mark.parametrize("B", [1, 5])
def test_float64_equals_nxbp(name, B):
    info, kw = MODELS_UNDER_TEST[name]
    model = MODELS.build(name, info, **kw).double()
    x, y = inputs(info, B)
    want, want_g = clipped("nxbp", model, x, y)
    got, got_g = clipped("multiloss", model, x, y)
    torch.testing.assert_close(got.norms, want.norms, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.losses, want.losses)
    torch.testing.assert_close(got.outputs, want.outputs)
    assert (want.norms > 0.5).any()  # the clip is active for some example
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_float32_equals_nxbp_to_float_tolerance():
    info, kw = MODELS_UNDER_TEST["lstm"]
    model = MODELS.build("lstm", info, **kw)
    x, y = inputs(info, 6)
    x = x.float()
    (want, want_g), (got, got_g) = clipped("nxbp", model, x, y), clipped("multiloss", model, x, y)
    assert got_g[0].dtype == torch.float32
    torch.testing.assert_close(got.norms, want.norms, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 2, 4, 100])
def test_chunking_gives_the_same_sum(chunk):
    info, kw = MODELS_UNDER_TEST["transformer"]
    model = MODELS.build("transformer", info, **kw).double()
    x, y = inputs(info, 7)
    want, want_g = clipped("multiloss", model, x, y)
    got, got_g = clipped("multiloss", model, x, y, chunk=chunk)
    torch.testing.assert_close(got.norms, want.norms)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)


def test_frozen_parameters_and_buffers_pass_through():
    model = nn.Sequential(nn.Linear(3, 4), nn.GroupNorm(2, 4), nn.Linear(4, 2)).double()
    model[0].weight.requires_grad_(False)
    model.register_buffer("unused", torch.ones(1))
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    (_, want_g), (_, got_g) = clipped("nxbp", model, x, y), clipped("multiloss", model, x, y)
    assert model[0].weight.grad is None  # frozen: no gradient
    assert len(got_g) == len(want_g) == 5
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b)


def test_dropout_draws_a_different_mask_per_example():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 2, bias=False)).double()
    x = torch.ones(8, 16, dtype=torch.float64)  # identical examples: equal norms only if the masks were shared
    out, _ = clipped("multiloss", model, x, torch.zeros(8, dtype=torch.long), clip=1e9)
    assert out.norms.unique().numel() > 1


class ItemModel(nn.Module):
    """Data-dependent Python control flow: vmap cannot trace it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x) * (2.0 if x.sum().item() > 0 else 1.0)


def test_untraceable_model_is_a_one_line_error():
    with pytest.raises(DprunError, match=r"^method=multiloss: torch.func.vmap cannot trace ItemModel: [^\n]*method=nxbp$"):
        clipped("multiloss", ItemModel(), torch.randn(2, 3), torch.tensor([0, 1]))


def test_negative_chunk_is_rejected():
    with pytest.raises(DprunError, match="method.chunk=-1"):
        clipped("multiloss", nn.Linear(3, 2), torch.randn(2, 3), torch.tensor([0, 1]), chunk=-1)


def test_step_with_noise_and_optimizer():
    """Method.step: privatize, + N(0, (sigma*C)^2), / expected batch size, SGD step; sigma=0 leaves the clipped mean."""
    model = nn.Linear(4, 3).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    before = [p.detach().clone() for p in model.parameters()]
    _, want_g = clipped("nxbp", model, x, y, clip=1.0)
    method = METHODS.build("multiloss", clip=1.0, sigma=0.0)
    model = method.attach(model)
    out = method.step(model, loss_fn, x, y, torch.optim.SGD(model.parameters(), lr=1.0), sample_rate=0.1,
                      expected_batch_size=10.0)
    assert out.mechanism == SubsampledGaussian(sample_rate=0.1, noise_multiplier=0.0) and out.norms.shape == (5,)
    for p0, g, p in zip(before, want_g, model.parameters()):
        torch.testing.assert_close(p.detach(), p0 - g / 10.0)


def test_bf16_with_a_layer_norm_after_a_linear_equals_nxbp():
    """CPU autocast runs layer_norm on the bf16 output of a Linear (float32 weights), whose backward under vmap failed
    ("vmap cannot trace Sequential: expected scalar type BFloat16 but found Float"): the LayerNorm now gets a
    float32 copy (as CUDA's autocast gives it), the norms match nxbp's bf16 ones and each contribution is <= C."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3))
    x, y = 3 * torch.randn(5, 8), torch.tensor([0, 1, 2, 0, 1])
    got, want = [], []
    for name, into in (("multiloss", got), ("nxbp", want)):
        for p in model.parameters():
            p.grad = None
        method = METHODS.build(name, clip=1e-3, sigma=0.0).configure(precision="bf16")
        into.append(method.privatize(method.attach(model), loss_fn, x, y))
        into.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(got[0].norms, want[0].norms, rtol=2e-2, atol=1e-6)
    assert bool((got[0].norms > 1e-2).all())  # every example clipped
    for i in range(len(y)):  # one example alone: its release is its contribution
        for p in model.parameters():
            p.grad = None
        method = METHODS.build("multiloss", clip=1e-3, sigma=0.0).configure(precision="bf16")
        method.privatize(method.attach(model), loss_fn, x[i:i + 1], y[i:i + 1])
        assert float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))) <= 1e-3
