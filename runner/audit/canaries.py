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

import math

import numpy as np
import torch

from runner.errors import DprunError
from runner.randomness import expanded_generator

MAX_RANDOM_ENTRIES = 50_000_000  # m x d floats held for random directions (200 MB); beyond: direction=dirac


def inclusion(m: int, seed: int) -> torch.Tensor:
    """(m,) bool: which canaries are in, each with probability 1/2 (the audit's own generator)."""
    return torch.rand(m, generator=expanded_generator(seed, "audit-inclusion")) < 0.5


class GradientCanaries:
    """Gradient canaries for a model's trainable parameters; `add_` is Method.clipped_sum's hook."""

    def __init__(self, params: list[torch.Tensor], m: int, clip: float, sample_rate: float, seed: int,
                 direction: str = "dirac", main: bool = True, score: str = "steps", step_size: float = 1.0):
        self.params, self.m, self.clip, self.q, self.main = params, m, float(clip), float(sample_rate), main
        self.score, self.step_size = score, float(step_size)  # step_size: lr C / B, one canary's move of a step
        self.d = sum(p.numel() for p in params)
        self.included = inclusion(m, seed)
        gen = expanded_generator(seed, "audit-directions")
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
        self.step_gen = expanded_generator(seed, "audit-steps")  # the canaries' Poisson draws, the same on every rank
        self.start = self.flat().clone()  # (d,) theta_0
        self.last = self.project(self.start)  # (m,) the projections before the step now running
        self.llr = torch.zeros(m, dtype=torch.float64, device=device)  # score=steps: the summed log-likelihood ratios
        self.drawn = 0  # canary gradients added so far (a test reads it)

    def flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])  # (d,)

    def project(self, flat: torch.Tensor) -> torch.Tensor:
        """(m,) theta . u_j."""
        return flat[self.coords] if self.coords is not None else self.directions @ flat

    def observe(self) -> None:
        """score=steps (white-box: every iterate is released, as the accountants assume): the last step's move
        along each u_j, z = -(theta_t - theta_t-1) . u_j, standardised across the canaries (median, MAD: most were
        not drawn), scored by the log-likelihood ratio of "drawn w.p. q, shifted by a = lr C / B" against "not
        drawn": log(1 - q + q exp(a z - a^2 / 2)). Uses the released weights only, never which canaries are in."""
        now = self.project(self.flat())
        z = -(now - self.last).double()  # (m,)
        self.last = now
        centre = z.median()
        scale = 1.4826 * (z - centre).abs().median()
        if not bool(scale > 0):
            scale = z.new_tensor(self.step_size * 1e-3)
        zs, a = (z - centre) / scale, self.step_size / float(scale)
        self.llr += torch.logaddexp(torch.full_like(zs, math.log1p(-self.q)), math.log(self.q) + a * zs - a * a / 2)

    def add_(self, params: list[torch.Tensor]) -> None:
        """This step's included canaries, each drawn with probability q, add C u_j to the clipped sum in p.grad."""
        if self.score == "steps":
            self.observe()  # the previous step's update, now in the weights
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
        """(m,) larger for a canary whose gradient the run applied: score=sum: -(theta_T - theta_0) . u_j;
        score=steps: the summed per-step log-likelihood ratios (observe)."""
        if self.score == "steps":
            self.observe()  # the last step's update
            return self.llr.cpu().numpy()
        return (-self.project(self.flat() - self.start)).double().cpu().numpy()


def input_canaries(kind: str, m: int, data, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of m crafted canaries shaped like the training set's examples, with uniformly random labels."""
    gen = expanded_generator(seed, "audit-inputs")
    x, classes = data.train_x, int(data.info.num_classes)
    shape = (m, *x.shape[1:])
    y = torch.randint(0, classes, (m,), generator=gen)
    if x.is_floating_point():
        # the loader's public range (its fixed normalisation of pixels in [0, 1]), not the training set's own min and
        # max: one record setting those moved every canary (m canaries: up to m C); synthetic data is not private
        lo, hi = data.info.input_range or (float(x.min()), float(x.max()))
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
