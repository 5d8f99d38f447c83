"""Review 64: a clipped sum weights one side of a layer's records by nu_i and multiplies the other; a LayerNorm made
the output-gradients ~1e-15, so nu g (nu ~ 2.7e-31 at C = 1.5e-30) fell to ~1e-45, float32's subnormals, rounded by
up to 100%, and an input ~3e14 multiplied that rounding: one example released 1.86 C in every reweight mode (1.90 C
under bf16 and in chunks). C below 1e-6 is refused now and clip_factors aims at C (1 - CLIP_SLACK); rows of the
multiplying side above 2^64 drop their example (their norms overflow, also rows of one entry)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runner.errors import DprunError
from runner.methods import METHODS
from runner.norms import tensor_cores
from runner.norms.certify import vector_norms

SCALES = [1e10, 1e14, 3e14, 1e17, 1e18, 3e18, 1e19, 1e20, 1e25, 1e30, 1e37]  # the input's, through 2^64 ~ 1.8e19


def model_with_a_small_readout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 3, bias=False), nn.LayerNorm(3, elementwise_affine=False), nn.Linear(3, 3))
    for p in model[2].parameters():
        p.requires_grad_(False)  # the first layer trains alone: its output-gradient is the LayerNorm's, ~1 / |input|
    return model


def contribution(cfg: dict, precision: str, x: torch.Tensor, clip: float) -> float:
    method = METHODS.build("reweight", cfg=cfg, clip=clip, sigma=0.0).configure(precision=precision)
    method.privacy_check = False
    m = method.attach(copy.deepcopy(model_with_a_small_readout()))
    method.step(m, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, torch.tensor([0]),
                torch.optim.SGD(m.parameters(), lr=0.0), sample_rate=1.0, expected_batch_size=1.0)
    return float(torch.cat([p.grad.double().flatten() for p in m.parameters() if p.requires_grad]).norm()) / clip


@pytest.mark.parametrize("cfg, precision", [({}, "fp32"), ({"mode": "twopass"}, "fp32"), ({"norm": "ghost"}, "fp32"),
                                            ({}, "bf16")], ids=["bk", "twopass", "ghost", "bk-bf16"])
def test_a_tiny_output_gradient_times_a_huge_input_releases_at_most_c(cfg, precision):
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(1))
    worst = max(contribution(cfg, precision, x * scale, clip) for scale in SCALES for clip in (1e-6, 1.7e-6, 1e-3))
    assert worst <= 1.0, worst


def test_review64s_clip_is_refused_in_one_line():
    with pytest.raises(DprunError, match=r"^clip \(max_grad_norm\)=1.5353e-30 is outside the accepted range "
                                         r"\[1e-6, 1e30\][^\n]*$"):
        METHODS.build("reweight", clip=1.5353e-30, sigma=0.0)


@pytest.mark.parametrize("norms", [vector_norms, tensor_cores.norms])
def test_a_row_of_one_entry_above_2_to_the_64_has_no_finite_norm(norms):
    """torch's norm of a single entry is its magnitude (no square): such a row of 1e30 kept a finite norm, so it could
    multiply the weighted side's rounding far past the bound; its norm overflows now, as a longer row's does."""
    rows = torch.tensor([[1e30], [3.0], [-1e19]])
    if norms is tensor_cores.norms:
        rows = rows.bfloat16()
    out = norms(rows, -1)
    assert torch.isinf(out[0]) and out[1] == 3.0 and torch.isfinite(out[2])
    assert torch.isinf(norms(torch.tensor([[1e30, 0.0]]).to(rows.dtype), -1)).all()
