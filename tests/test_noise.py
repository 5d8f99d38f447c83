"""runner/methods/noise.py: N(0, (sigma*C)^2) on the clipped SUM, then division by the EXPECTED batch size."""
import math

import pytest
import torch
from scipy import stats
from torch import nn

from runner.methods.base import Method, Privatized
from runner.methods.noise import add_noise_and_scale


def draws(n: int, sigma_c: float, expected_b: float, seed: int = 0) -> torch.Tensor:
    """n independent noisy releases of a zero gradient sum for a 1000-weight Linear, flattened."""
    model = nn.Linear(100, 10, bias=False).double()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        model.weight.grad = torch.zeros_like(model.weight)
        add_noise_and_scale(model, sigma_c, expected_b, gen)
        out.append(model.weight.grad.flatten().clone())
    return torch.cat(out)  # (n * 1000,)


def test_noise_is_gaussian_with_std_sigma_c_over_expected_batch():
    sigma_c, b = 1.3 * 1.5, 256.0
    z = draws(200, sigma_c, b)  # 200,000 samples
    target = sigma_c / b
    assert abs(z.std().item() / target - 1) < 0.01  # std error of the std ~ 1/sqrt(2n) = 0.16%
    assert abs(z.mean().item()) < 5 * target / math.sqrt(z.numel())
    assert stats.kstest((z / target).numpy(), "norm").pvalue > 1e-3


def test_noise_adds_to_the_clipped_sum_then_divides():
    model = nn.Linear(3, 2).double()
    s = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    model.weight.grad = s.clone()
    model.bias.grad = torch.ones(2, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    expected_noise = torch.randn((2, 3), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    add_noise_and_scale(model, 2.0, 4.0, gen)
    assert torch.allclose(model.weight.grad, (s + 2.0 * expected_noise) / 4.0)


def test_zero_noise_std_only_scales():
    model = nn.Linear(3, 2)
    model.weight.grad = torch.full((2, 3), 8.0)
    model.bias.grad = torch.full((2,), 8.0)
    add_noise_and_scale(model, 0.0, 4.0)
    assert torch.equal(model.weight.grad, torch.full((2, 3), 2.0))


def test_parameters_without_grad_still_get_noise():
    model = nn.Sequential(nn.Linear(50, 20), nn.Linear(20, 2))
    frozen = model[1].bias
    frozen.requires_grad_(False)
    for p in model.parameters():
        p.grad = None  # e.g. an empty Poisson batch, or a parameter this batch did not reach
    add_noise_and_scale(model, 3.0, 10.0, torch.Generator().manual_seed(0))
    w = model[0].weight.grad
    assert w is not None and w.shape == (20, 50)
    assert abs(w.std().item() / 0.3 - 1) < 0.1  # sigma*C / B = 0.3
    assert model[1].weight.grad is not None and model[1].weight.grad.abs().sum() > 0
    assert frozen.grad is None  # frozen parameters are not released


class FixedSum(Method):
    """privatize leaves the same clipped sum (all ones) whatever the batch, like a batch padded by zero-gradient examples."""

    privacy_check = False  # a test double with no loss function: nothing for runner/methods/privacy_check/ to check

    def privatize(self, model, loss_fn, x, y):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        return Privatized(torch.zeros(len(y)), None, torch.zeros(len(y)))


@pytest.mark.parametrize("realised", [0, 1, 7, 300])
def test_step_divides_by_expected_not_realised_batch_size(realised):
    """Method.step's update is (sum + noise) / B_expected for every realised Poisson batch size."""
    model = nn.Linear(4, 3).double()
    start = [p.detach().clone() for p in model.parameters()]
    method = FixedSum(clip=1.5, sigma=2.0)
    x, y = torch.randn(realised, 4, dtype=torch.float64), torch.zeros(realised, dtype=torch.long)
    model = method.attach(model)
    method.step(model, None, x, y, torch.optim.SGD(model.parameters(), lr=1.0), sample_rate=0.01,
                expected_batch_size=16.0, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(5)
    clipped_sum = 1.0 if realised else 0.0  # an empty batch: privatize is not called, the sum is zero
    for p0, p in zip(start, model.parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        assert torch.allclose(p.detach(), p0 - (clipped_sum + 3.0 * noise) / 16.0)
