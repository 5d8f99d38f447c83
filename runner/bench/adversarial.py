"""Adversarial inputs for the per-example norm rules (issue 26): each layer family applied at several positions to a
near-constant input, followed by a fixed +-1 sign per position and a fixed read-out, so that the exact per-example
gradient is O(eps) while each term of a float32 ghost Gram is O(1) (catastrophic cancellation).

    for kind, cases in CONSTRUCTIONS.items():          # one list per registered rule type
        for name, build, example in cases:
            model = build(seed)                        # Cancelling(layer, ...): (B, ...) -> (B, 1)
            x = example(torch.Generator().manual_seed(1), eps)   # (1, ...) one crafted example
    loss = model(x)[:, 0]                              # the read-out itself is the per-example loss

tests/test_certified_clipping.py checks every method on them, and `python -m runner.bench.adversarial` prints each
method's worst contribution / C (the table of docs/privacy.md).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from runner.entry import OneLineParser
from runner.methods import METHODS
from runner.methods.base import CLIP_RANGE


class Cancelling(nn.Module):
    """layer -> a fixed +-1 sign per position (buffer `signs`) and a fixed read-out over features (buffer `readout`)
    -> one number per example (B, 1). The layer's output is (B, P, F) after `to_positions`."""

    def __init__(self, layer: nn.Module, probe: torch.Tensor, to_positions, seed: int = 0):
        super().__init__()
        self.layer, self.to_positions = layer, to_positions
        with torch.no_grad():
            P, Fe = to_positions(layer(probe)).shape[1:]
        g = torch.Generator().manual_seed(seed)
        signs = torch.ones(P)
        signs[P // 2:] = -1.0  # sum_t s_t = 0: the large, shared part of every position cancels
        self.register_buffer("signs", signs[torch.randperm(P, generator=g)])
        self.register_buffer("readout", torch.randn(Fe, generator=g))

    def forward(self, x):
        h = self.to_positions(self.layer(x))  # (B, P, F)
        return ((h @ self.readout) * self.signs).sum(1, keepdim=True)  # (B, 1)


class FieldReadout(nn.Module):
    """layer -> a fixed random read-out of every output value, centred over each channel's positions (buffer
    `readout`, as Cancelling's: UNDERFLOW scales it) -> one number per example (B, 1); the layer's trainable norm weights drawn at random and its bias
    frozen (review 25's GroupNorm: the output-gradient then has no part the weight's gradient cancels exactly)."""

    def __init__(self, layer: nn.Module, probe: torch.Tensor, seed: int = 0):
        super().__init__()
        self.layer = layer
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            shape = layer(probe).shape[1:]  # (C, *spatial)
            for m in layer.modules():
                if isinstance(m, (nn.GroupNorm, nn.LayerNorm)) and m.weight is not None:
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g))
                    if m.bias is not None:
                        m.bias.requires_grad_(False)
        field = torch.randn(shape, generator=g).flatten(1)  # (C, positions)
        self.register_buffer("readout", (field - field.mean(1, keepdim=True)).reshape(-1))

    def forward(self, x):
        return (self.layer(x).flatten(1) @ self.readout).unsqueeze(1)  # (B, 1)


def seq(t):  # (B, T, F) already
    return t


def one_position(t):  # (B, F) -> (B, 1, F): a Linear on a flat input (an MLP, a classifier head)
    return t.unsqueeze(1)


def channels_last(t):  # (B, C, *spatial) -> (B, positions, C)
    return t.flatten(2).transpose(1, 2)


def near_constant(shape, eps, g):
    """a0 (shared by every position, O(1)) + eps * noise per position: shape (1, T, d) or (1, C, *spatial)."""
    if len(shape) == 2:  # (T, d): positions along dim 0
        a0 = torch.randn(1, 1, shape[1], generator=g)
    else:  # (C, *spatial): one value per channel
        a0 = torch.randn(1, shape[0], *([1] * (len(shape) - 1)), generator=g)
    return a0 + eps * torch.randn(1, *shape, generator=g)


def large_mean(shape, g, rel: float = 6e-8, mean: float = 1e4):
    """mean (1 + rel * noise), (1, *shape): near-constant at a large mean, its spread near float32's rounding step
    there. A norm layer's backward cancels on it (torch's CPU GroupNorm forms dgamma = (sum g x - mean sum g) rstd),
    and the input-gradient of a GroupNorm sums to rounding noise, which a conv below multiplies by the pixel value:
    twopass and recompute released 17.6 C and 2.7 C through a second backward of sum_i nu_i loss_i (review 25)."""
    return mean * (1 + rel * torch.randn(1, *shape, generator=g))


def tokens(T, vocab, g):
    """One token repeated at every position but one (the ghost sums g_t . g_s over equal tokens)."""
    x = torch.full((1, T), 3, dtype=torch.long)
    x[0, int(torch.randint(0, T, (1,), generator=g))] = 5
    return x


# rule type -> [(case name, build(seed) -> model, example(seed, eps) -> x)]; sizes from the table
CONSTRUCTIONS = {
    nn.Linear: [
        ("linear512_T16", lambda s: Cancelling(nn.Linear(512, 512), torch.zeros(1, 16, 512), seq, s),
         lambda g, eps: near_constant((16, 512), eps, g)),
        ("lstm_proj128x512_T28", lambda s: Cancelling(nn.Linear(128, 512), torch.zeros(1, 28, 128), seq, s),
         lambda g, eps: near_constant((28, 128), eps, g)),
        ("linear64_T256", lambda s: Cancelling(nn.Linear(64, 64), torch.zeros(1, 256, 64), seq, s),
         lambda g, eps: near_constant((256, 64), eps, g)),
        # the bench transformer's feed-forward shape: book-keeping keeps a G_i larger than its records, so on the CPU
        # it goes late and chunked (runner/norms/late.py); linear64_T256 goes late whole
        ("linear200x800_T150", lambda s: Cancelling(nn.Linear(200, 800), torch.zeros(1, 150, 200), seq, s),
         lambda g, eps: near_constant((150, 200), eps, g)),
        # one position (T = 1): the weight and the bias bounded together (outer.rank_one_with_bias_sq), no
        # cancellation to exploit, so the bound must be tight: a factor 0.1% short already exceeds C
        ("linear512x256_one_position", lambda s: Cancelling(nn.Linear(512, 256), torch.zeros(1, 512), one_position, s),
         lambda g, eps: near_constant((1, 512), eps, g).view(1, 512)),
    ],
    nn.Conv2d: [
        ("conv2d_64x256_8x8", lambda s: Cancelling(nn.Conv2d(64, 256, 3, padding=1), torch.zeros(1, 64, 8, 8),
                                                   channels_last, s),
         lambda g, eps: near_constant((64, 8, 8), eps, g)),
        ("conv2d_32x64_16x16_groups", lambda s: Cancelling(nn.Conv2d(32, 64, 3, groups=2), torch.zeros(1, 32, 16, 16),
                                                           channels_last, s),
         lambda g, eps: near_constant((32, 16, 16), eps, g)),
    ],
    nn.Conv1d: [
        ("conv1d_64x128_L64", lambda s: Cancelling(nn.Conv1d(64, 128, 5, padding=2), torch.zeros(1, 64, 64),
                                                   channels_last, s),
         lambda g, eps: near_constant((64, 64), eps, g)),
    ],
    nn.Embedding: [
        ("embedding_repeated_token", lambda s: Cancelling(nn.Embedding(10, 256), torch.zeros(1, 33, dtype=torch.long),
                                                          seq, s),
         lambda g, eps: tokens(33, 10, g)),
    ],
    nn.LayerNorm: [
        ("layernorm512_T64", lambda s: Cancelling(nn.LayerNorm(512), torch.zeros(1, 64, 512), seq, s),
         lambda g, eps: near_constant((64, 512), eps, g)),
        ("layernorm4096_T4_large_mean", lambda s: FieldReadout(nn.LayerNorm(4096, eps=1e-12), torch.zeros(1, 4, 4096),
                                                               s),
         lambda g, eps: large_mean((4, 4096), g)),
        # a LayerNorm over a conv's positions: its CPU backward forms the input-gradient from the raw input, which
        # cancels at a large mean (jl released 1.6e6 C through it before jl centred LayerNorm, review 28)
        ("conv_layernorm_hw_large_mean_image", lambda s: FieldReadout(
            nn.Sequential(nn.Conv2d(3, 8, 3), nn.LayerNorm([30, 30]), nn.Tanh()), torch.zeros(1, 3, 32, 32), s),
         lambda g, eps: large_mean((3, 32, 32), g, rel=1e-7)),
    ],
    nn.RMSNorm: [
        ("rmsnorm512_T64", lambda s: Cancelling(nn.RMSNorm(512), torch.zeros(1, 64, 512), seq, s),
         lambda g, eps: near_constant((64, 512), eps, g)),
    ],
    nn.GroupNorm: [
        ("groupnorm64_16x16", lambda s: Cancelling(nn.GroupNorm(8, 64), torch.zeros(1, 64, 16, 16), channels_last, s),
         lambda g, eps: near_constant((64, 16, 16), eps, g)),
        ("groupnorm8_64x64_large_mean", lambda s: FieldReadout(nn.GroupNorm(8, 8, eps=1e-12),
                                                               torch.zeros(1, 8, 64, 64), s),
         lambda g, eps: large_mean((8, 64, 64), g)),
        ("conv_groupnorm_large_mean_image", lambda s: FieldReadout(
            nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(8, 8), nn.Tanh()), torch.zeros(1, 3, 32, 32), s),
         lambda g, eps: large_mean((3, 32, 32), g, rel=1e-7)),
    ],
}


# Underflow (stop 35): each construction with its input scaled by s_in and its read-out by s_out, so that one of the
# layer's records is ~1e17 and the other's squares underflow float32 (1e-23: 1e-46 rounds to 0) while their
# product, the per-example gradient, stays ~1e-6 per term. A bound that multiplies a norm that underflowed by one that
# did not (rank one, a mass sum_t ||a_t|| ||g_t||, a Gram entry times the other Gram's) certified 0.3 x the true
# norm before certify.underflow_floor. eps = 1 (no cancellation: underflow alone). Integer inputs (tokens) keep
# their scale: the read-out's scale alone reaches the layer.
SCALES = {"huge_input": (1e17, 1e-23), "tiny_input": (1e-23, 1e17)}


def scaled(build, example, s_in: float, s_out: float):
    def build_scaled(seed):
        model = build(seed)
        model.readout.mul_(s_out)
        return model

    def example_scaled(g, eps):
        x = example(g, 1.0)
        return x * s_in if x.is_floating_point() else x

    return build_scaled, example_scaled


UNDERFLOW = {kind: [(f"{name}_{label}", *scaled(build, example, *scale)) for name, build, example in cases
                    for label, scale in SCALES.items()] for kind, cases in CONSTRUCTIONS.items()}


def loss_fn(out, y):
    return out[:, 0]  # (B,): the read-out itself, so the output-gradients are the fixed pattern


def released(method, model, x, compile_backend: str | None = None):
    """||what the step leaves in p.grad|| (sigma = 0, expected batch 1, lr 0), in float64, and the step's output.
    compile_backend: the step compiled (runner/methods/compiled.py, one physical size, Dynamo with this backend:
    "inductor", or "aot_eager" to trace without code generation); its first step runs eager, the second is measured."""
    y = torch.zeros(len(x), dtype=torch.long, device=x.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = method.step
    if compile_backend:
        from runner.methods.compiled import CompiledStep

        step = CompiledStep(method, "default", x.device, physical=len(x), backend=compile_backend)
        step(model, loss_fn, x, y, opt, sample_rate=1.0, expected_batch_size=1.0)  # eager: validates the model
        opt.zero_grad(set_to_none=True)
    elif callable(getattr(method, "defers", None)) and method.defers(x.device):
        # book-keeping defers a layer's norm from its second step on (lean.RECORDS_KEPT; defer=auto on CUDA)
        step(model, loss_fn, x, y, opt, sample_rate=1.0, expected_batch_size=1.0)
        opt.zero_grad(set_to_none=True)
    out = step(model, loss_fn, x, y, opt, sample_rate=1.0, expected_batch_size=1.0)
    if compile_backend and step.compiled is None:
        raise RuntimeError(f"the compiled step fell back to eager (backend {compile_backend}); see the log line")
    grads = [p.grad.detach().double() for p in model.parameters() if p.requires_grad]
    return float(torch.sqrt(sum(g.pow(2).sum() for g in grads))), out


def exact_norm(model, x):
    """The example's gradient norm, float64 throughout (the oracle: autograd of a float64 copy)."""
    m = copy.deepcopy(model).double()
    xd = x.double() if x.is_floating_point() else x
    grads = torch.autograd.grad(loss_fn(m(xd), None).sum(), [p for p in m.parameters() if p.requires_grad])
    return float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))


def measured(name: str, cfg: dict, model: nn.Module, x: torch.Tensor, fraction: float = 0.01,
             precision: str = "fp32", device: str = "cpu", compile_backend: str | None = None,
             neighbour: torch.Tensor | None = None) -> float:
    """One crafted example, one step on `device`: ||released|| / C with C = fraction * its exact gradient norm (float64,
    on the CPU). DprunError (one line) where the method refuses the model. compile_backend: see released.
    neighbour: a second example in the same step whose gradient is not finite (inf or nan inputs), which must add
    nothing: the release is still the crafted example's alone (book-keeping's masked second pass)."""
    C = fraction * exact_norm(model, x)
    if neighbour is not None:
        x = torch.cat([x, neighbour])
    model, x = copy.deepcopy(model).to(device), x.to(device)  # .to moves a module in place: the caller keeps its own
    method = METHODS.build(name, cfg=cfg, clip=max(C, CLIP_RANGE[0]), sigma=0.0)
    # below the accepted C (the underflow constructions' gradients are ~1e-6, so C ~ 1e-8) set directly: these
    # measure the norms' certificate; the floor guards the clipped sums' rounding against records ~1e30 (review 64),
    # far above these constructions' ~1e17
    method._clip = C
    method.configure(precision=precision)
    method.privacy_check = False  # this measures clipping alone (the first-step validator is runner/methods/privacy_check)
    norm, _ = released(method, method.attach(copy.deepcopy(model)), x, compile_backend)
    return norm / C


SETTINGS = {  # label -> (method, cfg, precision): the table's columns
    "reweight (defaults: bk, auto)": ("reweight", {}, "fp32"),
    "bk ghost": ("reweight", {"norm": "ghost"}, "fp32"),
    "bk direct": ("reweight", {"norm": "direct"}, "fp32"),
    "bk recorder full": ("reweight", {"recorder": "full"}, "fp32"),  # Recorder from the start (method.recorder)
    "bk defer on": ("reweight", {"defer": "on"}, "fp32"),  # record-keeping layers' norms after the backward
    "bk defer all": ("reweight", {"defer": "all"}, "fp32"),  # every layer's norm after the backward
    "bk keep 0": ("reweight", {"keep": 0}, "fp32"),  # every clipped sum from the records (no G_i kept)
    "bk late off": ("reweight", {"late": "off"}, "fp32"),  # kept G_i formed inside the backward (late: the default)
    "twopass": ("reweight", {"mode": "twopass"}, "fp32"),
    "recompute": ("reweight", {"mode": "recompute"}, "fp32"),
    "bk bf16": ("reweight", {}, "bf16"),
    "bk tf32": ("reweight", {}, "tf32"),  # TF32 products: CUDA only (the CPU runs it as fp32)
    "twopass tf32": ("reweight", {"mode": "twopass"}, "tf32"),
    "nxbp": ("nxbp", {}, "fp32"),
    "multiloss": ("multiloss", {}, "fp32"),
    "opacus hooks": ("opacus", {"grad_sample_mode": "hooks"}, "fp32"),
    "opacus ghost (timed only)": ("opacus", {"grad_sample_mode": "ghost", "uncertified_ok": True}, "fp32"),
}


def main(argv=None) -> None:
    """Print, per construction and setting, the worst ||released|| / C over C = 1% and 90% of the exact norm."""
    import pandas as pd

    from runner.errors import DprunError

    parser = OneLineParser(description=main.__doc__)
    parser.add_argument("--eps", type=float, default=1e-4, help="the deviation from a constant input (default 1e-4)")
    parser.add_argument("--device", default="cpu", help="where the steps run (cpu, cuda); the exact norm is on the CPU")
    args = parser.parse_args(argv)
    rows = {}
    for kind, cases in CONSTRUCTIONS.items():
        for case, build, example in cases:
            torch.manual_seed(0)
            model, x = build(0), example(torch.Generator().manual_seed(1), args.eps)
            row = {}
            for label, (name, cfg, precision) in SETTINGS.items():
                try:
                    row[label] = max(measured(name, cfg, model, x, f, precision, args.device) for f in (0.01, 0.9))
                except DprunError:
                    row[label] = float("nan")  # refused
                except ImportError:
                    row[label] = float("nan")
            rows[case] = row
            print(case, " ".join(f"{v:.7g}" for v in row.values()), flush=True)
    table = pd.DataFrame(rows).T
    print(table.to_string(float_format=lambda v: f"{v:.7g}"))


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.adversarial"))
