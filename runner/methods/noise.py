"""The one place noise is added: the Gaussian mechanism on the clipped SUM, then division by the expected batch.

After privatize(), each p.grad holds sum_i clip(g_i). DP-SGD releases
    (sum_i clip(g_i) + N(0, (sigma*C)^2 I)) / B_expected
Dividing by the EXPECTED batch size (q*N), not the realised Poisson batch size, keeps the released quantity a
fixed function of the noisy sum (dividing by the realised size would leak the batch size).
DP-SBCD adds its per-layer noise to the weights with add_gaussian (below), from the same generator.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def add_noise_and_scale(model: torch.nn.Module, noise_std: float, expected_batch_size: float,
                        generator: torch.Generator | None = None) -> None:
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:  # a parameter unused by this batch (or empty batch) still gets noise
            p.grad = torch.zeros_like(p)
        if noise_std > 0:
            # generator must live on p's device; None draws from torch's global RNG (seeded by the run)
            noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)
            p.grad.add_(noise, alpha=noise_std)
        p.grad.div_(expected_batch_size)


def add_gaussian(t: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """t + N(0, std^2 I): DP-SBCD's noisy prox step, where the noise std is set per layer by the hidden-state step
    (runner/methods/sbcd/bounds.py) and nothing is divided afterwards (the gradient is already a mean over b)."""
    return t + std * torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype)
