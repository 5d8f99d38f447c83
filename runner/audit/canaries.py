"""The canaries of a one-run audit: m of them, each included independently with probability 1/2.

    GradientCanaries (audit.canary=gradient, white-box)   a fixed unit direction u_j in parameter space per canary
        (Dirac: one coordinate; random: a Gaussian direction). An included canary joins every step's Poisson sample
        with the real examples' rate q and, when drawn, adds C u_j to the step's clipped sum: inside
        Method.clipped_sum, after the chunks and before the ranks' all-reduce and the noise, exactly where an
        example's clipped gradient would be (one rank adds it; every rank draws, so the draws stay in step).
        Score: -(theta_T - theta_0) . u_j (a gradient step moves the weights along -u_j).
    input_canaries (audit.canary=input | adversarial, black-box)   crafted examples with random labels; the
        included ones are appended to the training set (its size N grows, so the accountant's q = B / N and epsilon
        are for the dataset that contains them). Score: minus the final model's loss on each.
        input:        inputs drawn uniformly over the data's range (images) or vocabulary (token sequences)
        adversarial:  near-constant inputs a0 + 1e-3 noise, whose positions cancel in a float32 ghost norm
                      (issue 26): the audit that catches a per-example norm that does not bound the gradient.
"""
from __future__ import annotations

import numpy as np
import torch

from runner.errors import DprunError

MAX_RANDOM_ENTRIES = 50_000_000  # m x d floats held for random directions (200 MB); beyond: direction=dirac


def inclusion(m: int, seed: int) -> torch.Tensor:
    """(m,) bool: which canaries are in, each with probability 1/2 (the audit's own generator)."""
    return torch.rand(m, generator=torch.Generator().manual_seed(seed)) < 0.5


class GradientCanaries:
    """Gradient canaries for a model's trainable parameters; `add_` is Method.clipped_sum's hook."""

    def __init__(self, params: list[torch.Tensor], m: int, clip: float, sample_rate: float, seed: int,
                 direction: str = "dirac", main: bool = True):
        self.params, self.m, self.clip, self.q, self.main = params, m, float(clip), float(sample_rate), main
        self.d = sum(p.numel() for p in params)
        self.included = inclusion(m, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        device = params[0].device
        if direction == "dirac":
            if self.d < m:
                raise DprunError(f"audit.canaries={m} Dirac canaries need as many trainable parameters; the model "
                                 f"has {self.d}: use fewer canaries or audit.direction=random")
            self.coords = torch.randperm(self.d, generator=gen)[:m].to(device)  # (m,) one coordinate each
            self.directions = None
        else:
            if m * self.d > MAX_RANDOM_ENTRIES:
                raise DprunError(f"audit.direction=random holds m x d = {m} x {self.d} floats, over "
                                 f"{MAX_RANDOM_ENTRIES}; use audit.direction=dirac or fewer canaries")
            u = torch.randn(m, self.d, generator=gen)
            self.directions = (u / u.norm(dim=1, keepdim=True)).to(device)  # (m, d) unit rows
            self.coords = None
        self.step_gen = torch.Generator().manual_seed(seed + 2)  # the canaries' Poisson draws, the same on every rank
        self.start = self.flat().clone()  # (d,) theta_0
        self.drawn = 0  # canary gradients added so far (a test reads it)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])  # (d,)

    def add_(self, params: list[torch.Tensor]) -> None:
        """This step's included canaries, each drawn with probability q, add C u_j to the clipped sum in p.grad."""
        drawn = (torch.rand(self.m, generator=self.step_gen) < self.q) & self.included  # (m,)
        if not self.main or not bool(drawn.any()):
            return
        idx = drawn.nonzero().squeeze(1).to(self.params[0].device)
        self.drawn += len(idx)
        total = torch.zeros(self.d, device=self.params[0].device)  # (d,) sum_j C u_j over the drawn canaries
        if self.coords is not None:
            total.index_add_(0, self.coords[idx], torch.full((len(idx),), self.clip, device=total.device))
        else:
            total += self.clip * self.directions[idx].sum(0)
        offset = 0
        for p in params:
            piece = total[offset:offset + p.numel()].view_as(p).to(p.dtype)
            p.grad = piece.clone() if p.grad is None else p.grad.add_(piece)
            offset += p.numel()

    def scores(self) -> np.ndarray:
        """(m,) -(theta_T - theta_0) . u_j: larger for a canary whose gradient the run applied."""
        delta = self.flat() - self.start  # (d,)
        proj = delta[self.coords] if self.coords is not None else self.directions @ delta
        return (-proj).double().cpu().numpy()


def input_canaries(kind: str, m: int, data, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of m crafted canaries shaped like the training set's examples, with uniformly random labels."""
    gen = torch.Generator().manual_seed(seed + 3)
    x, classes = data.train_x, int(data.info.num_classes)
    shape = (m, *x.shape[1:])
    y = torch.randint(0, classes, (m,), generator=gen)
    if x.is_floating_point():
        lo, hi = float(x.min()), float(x.max())
        if kind == "input":
            xc = lo + (hi - lo) * torch.rand(shape, generator=gen)
        else:  # near-constant: one value per canary (and channel), 1e-3 noise across positions
            level = lo + (hi - lo) * torch.rand((m, *x.shape[1:2], *([1] * (x.dim() - 2))), generator=gen)
            xc = (level + 1e-3 * (hi - lo) * torch.randn(shape, generator=gen)).clamp(lo, hi)
    else:  # token ids
        vocab = int(data.info.vocab_size or int(x.max()) + 1)
        if kind == "input":
            xc = torch.randint(0, vocab, shape, generator=gen)
        else:  # one token repeated, 1 in 100 positions replaced
            xc = torch.randint(1, vocab, (m, 1), generator=gen).expand(shape).clone()
            swap = torch.rand(shape, generator=gen) < 0.01
            xc[swap] = torch.randint(0, vocab, (int(swap.sum()),), generator=gen)
    return xc.to(device=x.device, dtype=x.dtype), y.to(device=data.train_y.device, dtype=data.train_y.dtype)
