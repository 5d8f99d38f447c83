"""The clipping-method interface. One file per method registers itself in METHODS.

A method turns a batch into a (privatized) gradient:

    method = METHODS.build("reweight", cfg=cfg.method, clip=1.0, sigma=1.0, r=1)
    model = method.prepare(model)                 # validate the model (norm rules), attach hooks
    out = method.step(model, loss_fn, x, y, optimizer, sample_rate=q, expected_batch_size=B)

`privatize(model, loss_fn, x, y)` is the core each private method implements: it leaves the SUM over the batch
of per-example gradients clipped to norm `clip` in each trainable parameter's `.grad` and returns the losses,
outputs and per-example norms. `step` is the same for every gradient method: zero grads, privatize, add noise
and scale (runner/methods/noise.py, the one place noise lives), optimizer step. DP-SBCD overrides `step`.

`loss_fn(outputs, y)` returns per-example losses, shape (B,).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from runner.errors import DprunError
from runner.accountants.mechanisms import Mechanism, NoPrivacy, SubsampledGaussian
from runner.methods.noise import add_noise_and_scale
from runner.registry import Registry

METHODS = Registry("method")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, y) -> (B,)


@dataclass
class StepOutput:
    losses: torch.Tensor  # (B,) detached per-example losses
    outputs: torch.Tensor | None  # (B, classes) detached model outputs, for train accuracy
    norms: torch.Tensor | None  # (B,) per-example gradient norms (estimates for JL); None if not private
    mechanism: Mechanism  # what the accountant is told about this step


def clip_factors(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, C / (norm + 1e-6)), shape (B,). The 1e-6 keeps zero-gradient examples finite."""
    return (clip / (norms + 1e-6)).clamp(max=1.0)


class Method:
    name: ClassVar[str] = "base"
    private: ClassVar[bool] = True
    exact: ClassVar[bool] = True  # computes exact per-example norms (checked against nxbp)
    default_accountant: ClassVar[str] = "pld"
    summary: ClassVar[str] = ""  # one line for the method table (JL paper Table 1)
    sampling: ClassVar[str | None] = None  # set: the sampling the method needs, overriding cfg.sampling (sbcd)

    def __init__(self, cfg: Any = None, clip: float = 1.0, sigma: float = 1.0, r: int = 1, **_: Any):
        self.cfg = cfg if cfg is not None else {}
        self.clip = float(clip)
        self.sigma = float(sigma)
        self.r = int(r)

    def option(self, key: str, default: Any) -> Any:
        """A method option from conf/method/<name>.yaml (`method.<key>=...`)."""
        try:
            value = self.cfg.get(key, default)
        except AttributeError:
            value = getattr(self.cfg, key, default)
        return default if value is None else value

    def validate(self, model: torch.nn.Module) -> None:
        """Checks every private method shares (the training loop calls it before prepare): BatchNorm is rejected,
        since with batch statistics an example's gradient depends on the other examples and clipping bounds nothing."""
        if not self.private:
            return
        from runner.norms.coverage import REASONS

        for path, module in model.named_modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                reason = REASONS[torch.nn.modules.batchnorm._BatchNorm]
                raise DprunError(f"{path or '<model>'} ({type(module).__name__}) cannot be trained with "
                                 f"method={self.name}: {reason}")

    # -- hooks for subclasses ---------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, data: Any = None) -> torch.nn.Module:
        """Check the model can be handled (raise DprunError naming the module otherwise); return the model to train."""
        return model

    def privatize(self, model, loss_fn: LossFn, x, y) -> StepOutput:
        raise NotImplementedError

    def mechanism(self, sample_rate: float) -> Mechanism:
        return SubsampledGaussian(sample_rate=float(sample_rate), noise_multiplier=self.sigma)

    # -- the shared step ---------------------------------------------------------------------------------
    def step(self, model, loss_fn: LossFn, x, y, optimizer, *, sample_rate: float, expected_batch_size: float,
             generator: torch.Generator | None = None, indices: torch.Tensor | None = None) -> StepOutput:
        optimizer.zero_grad(set_to_none=True)
        out = self.privatize(model, loss_fn, x, y)
        if self.private:
            add_noise_and_scale(model, self.sigma * self.clip, expected_batch_size, generator)
            out.mechanism = self.mechanism(sample_rate)
        optimizer.step()
        return out


class NonPrivate(Method):
    name = "nonprivate"
    private = False
    exact = False
    default_accountant = "none"
    summary = "plain SGD/Adam: mean gradient, no clipping, no noise (the speed baseline)"

    def privatize(self, model, loss_fn, x, y) -> StepOutput:
        outputs = model(x)
        losses = loss_fn(outputs, y)
        if losses.numel():
            losses.mean().backward()
        return StepOutput(losses.detach(), outputs.detach(), None, NoPrivacy())


METHODS.register("nonprivate", NonPrivate)
