"""The one place noise is added: the Gaussian mechanism on the clipped SUM, then division by the expected batch.

After privatize(), each p.grad holds sum_i clip(g_i). DP-SGD releases
    (sum_i clip(g_i) + N(0, (sigma*C)^2 I)) / B_expected
Dividing by the EXPECTED batch size (q*N), not the realised Poisson batch size, keeps the released quantity a
fixed function of the noisy sum (dividing by the realised size would leak the batch size).

Few launches: ONE torch.randn over all trainable parameters of a (device, dtype) group, split into views, then
one _foreach_add_ and one _foreach_div_ over the gradients (instead of a randn, an add and a div per parameter).
The noise is still i.i.d. N(0, (sigma*C)^2) on every coordinate; no host synchronisation.
DP-SBCD adds its per-layer noise to the weights with add_gaussian (below), from the same generator.
`generator`: None (torch's global RNG, seeded by the run), a torch.Generator on the device, or rng=secure's
SecureRandom (runner/randomness.py: a cryptographic keystream, the same draw on every rank).
"""
from __future__ import annotations

import torch

from runner.randomness import standard_normal
from runner.trainable import trainable


@torch.no_grad()
def add_noise_and_scale(model: torch.nn.Module, noise_std: float, expected_batch_size: float,
                        generator: torch.Generator | None = None, params: list | None = None) -> None:
    """params: trainable(model), when the caller has it (one walk of the modules fewer)."""
    params = trainable(model) if params is None else params
    for p in params:
        if p.grad is None:  # a parameter unused by this batch (or empty batch) still gets noise
            p.grad = torch.zeros_like(p)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, dtype), grads in groups.items():
        if noise_std > 0:
            flat = standard_normal(generator, (sum(g.numel() for g in grads),), device, dtype)
            noise = [n.view(g.shape) for n, g in zip(flat.split([g.numel() for g in grads]), grads)]
            torch._foreach_add_(grads, noise, alpha=noise_std)
        torch._foreach_div_(grads, float(expected_batch_size))


def add_gaussian(t: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """t + N(0, std^2 I): DP-SBCD's noisy prox step, where the noise std is set per layer by the hidden-state step
    (runner/methods/sbcd/bounds.py) and nothing is divided afterwards (the gradient is already a mean over b)."""
    return t + std * standard_normal(generator, t.shape, t.device, t.dtype)
