"""The certified book-keeping step dispatches no more kernels than the uncertified one did (issue 26's speed budget):
a small model's GPU step is bound by the host launching operators (docs/bench.md, stop 30: bu_cnn's bk step spends
0.38 ms of its 6.5 ms on the device), so each kernel a certificate adds costs time there. Counted on the CPU, where
the count is the same: every aten operator that reaches a kernel (views and metadata excluded)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runner.bench.common import MNIST, loss_fn, synthetic_batch
from runner.methods import METHODS
from runner.methods.base import CLIP_SLACK, clip_factors
from runner.models import MODELS

# operators that make no kernel: views, aliases and metadata
NO_KERNEL = {"view", "_unsafe_view", "reshape", "t", "permute", "expand", "as_strided", "transpose", "unsqueeze",
             "squeeze", "select", "slice", "alias", "detach", "diagonal", "split_with_sizes"}
# L&K fig. 6's CNN at B = 16, reweight-bk, counted by this test: 99 kernels a step at 0c009e4 (before certified
# clipping), 110 at stop 29, 94 since stop 30
UNCERTIFIED_FIG6_BK = 99


class Kernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL and not name.startswith("_record_function"):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def kernels_of(fn) -> list[str]:
    with Kernels() as k:
        fn()
    return k.names


def test_the_certified_bk_step_launches_no_more_kernels_than_the_uncertified_one():
    torch.manual_seed(0)
    model = MODELS.build("cnn", MNIST)
    x, y = synthetic_batch(MNIST, 16, torch.device("cpu"))
    method = METHODS.build("reweight", cfg={"mode": "bk"}, clip=1.0, sigma=1.0)
    model = method.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)
    gen = torch.Generator().manual_seed(0)
    step = lambda: method.step(model, loss_fn, x, y, opt, sample_rate=0.01, expected_batch_size=16.0,  # noqa: E731
                               generator=gen)
    step()  # the first step validates the model (its own operators)
    names = kernels_of(step)
    assert len(names) <= UNCERTIFIED_FIG6_BK, sorted(names)
    assert names.count("_local_scalar_dense") == 1  # the one designed read (tests/test_no_host_sync.py)


def test_clip_factors_in_six_kernels_with_nonfinite_norms_to_zero():
    norms = torch.tensor([0.0, 0.5, 2.0, 1e38, float("inf"), float("nan")])
    names = kernels_of(lambda: clip_factors(norms, 1.0))
    assert len(names) <= 6, names  # add, reciprocal, mul, the subnormal spacing taken off (review 61), clamp, nan
    factors = clip_factors(norms, 1.0)
    assert torch.equal(factors[4:], torch.zeros(2))  # inf and nan norms: the example contributes nothing
    assert factors[:2].tolist() == [1.0, 1.0] and 0 < factors[3] < 1.01e-38  # a huge finite norm is clipped, not 0
    aim = 1.0 - CLIP_SLACK  # C less the slack that covers the clipped sums' subnormal rounding (review 64)
    assert factors[2].item() == pytest.approx(aim / (2.0 + 1e-6), rel=2**-22) and factors[2] < 1 / 2.0
    assert clip_factors(norms, 1.0, margin=1e-3)[2].item() == pytest.approx(aim / (2.0 * 1.001 + 1e-6), rel=2**-22)
