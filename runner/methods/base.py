"""The clipping-method interface. One file per method registers itself in METHODS.

A method turns a batch into a (privatized) update; library users, runner/train.py and the benches use it alike:

    method = METHODS.build("reweight", cfg=cfg.method, clip=1.0, sigma=1.0)
    model = method.attach(model, data)            # THE entry: refuses BatchNorm (one line), checks coverage, hooks
    out = method.step(model, loss_fn, x, y, optimizer, sample_rate=q, expected_batch_size=B)
    out.losses, out.outputs, out.norms, out.mechanism    # the mechanism is what the accountant is told

`attach` validates (the checks every private method shares) and then calls `prepare`, the subclass hook (norm-rule
coverage, Opacus's hooks, DP-SBCD's auxiliary variables); `step` accepts only the model `attach` returned.
`step` is the same for every method: the step's mechanism, the empty Poisson batch (nothing to compute: the
clipped sum is zero, the noisy update still happens), then `privatize` and `update`:

    privatize(model, loss_fn, x, y) -> Privatized     the core each method implements: leaves the SUM over the
        batch of per-example gradients clipped to norm `clip` in each trainable parameter's `.grad` and returns
        only what it computed (losses, outputs, per-example norms)
    update(model, optimizer, mechanism, ...)          the default adds the noise and divides by the expected batch
        (runner/methods/noise.py), then steps the optimizer; DP-SBCD overrides it with its block updates

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
class Privatized:
    """What privatize computed (the clipped gradient sum itself is left in p.grad)."""

    losses: torch.Tensor  # (B,) detached per-example losses
    outputs: torch.Tensor | None  # (B, classes) detached model outputs, for train accuracy
    norms: torch.Tensor | None  # (B,) per-example gradient norms (estimates for JL); None if not computed


@dataclass
class StepOutput(Privatized):
    mechanism: Mechanism  # what the accountant is told about this step


def clip_factors(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """min(1, C / (norm + 1e-6)), shape (B,). The 1e-6 keeps zero-gradient examples finite."""
    return (clip / (norms + 1e-6)).clamp(max=1.0)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class Method:
    name: ClassVar[str] = "base"
    private: ClassVar[bool] = True
    exact: ClassVar[bool] = True  # computes exact per-example norms (checked against nxbp)
    default_accountant: ClassVar[str] = "pld"
    summary: ClassVar[str] = ""  # one line for the method table (JL paper Table 1)
    sampling: ClassVar[str | None] = None  # set: the sampling the method needs, overriding cfg.sampling (sbcd)
    # True: update() changes the weights itself (DP-SBCD's block updates), so no private gradient is left in p.grad
    # for a caller's own optimizer.step(), and the optimizer is not used
    updates_model: ClassVar[bool] = False
    # set: why a checkpoint (model, optimizer, RNG, accountant) would miss part of the method's state (no resume=)
    not_resumable: ClassVar[str | None] = None
    # True: privatize calls loss_fn once on the whole batch, so a masked padded batch gives the same step
    # (runner/methods/padding.py), and the whole step runs under compile=... (runner/methods/compiled.py)
    compiles: ClassVar[bool] = False

    def __init__(self, cfg: Any = None, clip: float = 1.0, sigma: float = 1.0, **unknown: Any):
        if unknown:  # e.g. r=4: method options live in cfg (conf/method/<name>.yaml), never silently dropped
            raise DprunError(f"method={self.name} got unknown argument(s) {', '.join(sorted(unknown))}; pass method "
                             f"options in cfg, e.g. METHODS.build({self.name!r}, cfg={{'r': 4}}, clip=1.0, sigma=1.0)")
        self.cfg = cfg if cfg is not None else {}
        self.clip = float(clip)
        self.sigma = float(sigma)
        self.model: torch.nn.Module | None = None  # the model attach() returned: the one step() trains

    def option(self, key: str, default: Any) -> Any:
        """A method option from conf/method/<name>.yaml (`method.<key>=...`)."""
        try:
            value = self.cfg.get(key, default)
        except AttributeError:
            value = getattr(self.cfg, key, default)
        return default if value is None else value

    def choice(self, key: str, default: str, valid: tuple[str, ...]) -> str:
        """A method option with fixed choices; any other value is a one-line error naming them."""
        value = str(self.option(key, default))
        if value not in valid:
            raise DprunError(f"unknown method.{key} {value!r} for method={self.name}; valid: {', '.join(valid)}")
        return value

    # -- the one entry -----------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module, data: Any = None) -> torch.nn.Module:
        """Validate the model, prepare it (the subclass hook) and return the model to train; `step` takes only it."""
        self.validate(model)
        prepared = self.prepare(model, data)
        self.model = model if prepared is None else prepared
        return self.model

    def validate(self, model: torch.nn.Module) -> None:
        """Checks every private method shares: BatchNorm is rejected, since with batch statistics an example's
        gradient depends on the other examples and clipping bounds nothing."""
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

    def privatize(self, model, loss_fn: LossFn, x, y) -> Privatized:
        raise NotImplementedError

    def mechanism(self, sample_rate: float) -> Mechanism:
        """The nominal step's mechanism (calibration, the accountant's support check)."""
        if not self.private:
            return NoPrivacy()
        return SubsampledGaussian(sample_rate=float(sample_rate), noise_multiplier=self.sigma)

    def step_mechanism(self, sample_rate: float, indices: torch.Tensor | None) -> Mechanism:
        """This step's mechanism; DP-SBCD's depends on the batch's position in its fixed partition."""
        return self.mechanism(sample_rate)

    @torch.no_grad()
    def update(self, model, optimizer, mechanism: Mechanism, *, x, y, indices, expected_batch_size: float,
               generator: torch.Generator | None) -> None:
        """After privatize: noise on the clipped sum and division by the expected batch size, optimizer step."""
        if self.private:
            add_noise_and_scale(model, self.sigma * self.clip, expected_batch_size, generator)
        optimizer.step()

    # -- the shared step ---------------------------------------------------------------------------------
    def step(self, model, loss_fn: LossFn, x, y, optimizer, *, sample_rate: float, expected_batch_size: float,
             generator: torch.Generator | None = None, indices: torch.Tensor | None = None) -> StepOutput:
        if self.model is None or model is not self.model:
            raise DprunError(f"method={self.name}: step a model returned by method.attach(model) (it validates and "
                             f"prepares it)")
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        mechanism = self.step_mechanism(sample_rate, indices)
        if len(y) == 0:  # an empty Poisson batch: the clipped sum is zero (p.grad None -> zeros when noised)
            empty = x.new_zeros(0, dtype=torch.get_default_dtype())
            out = Privatized(empty, None, empty.clone() if self.private else None)
        else:
            out = self.privatize(model, loss_fn, x, y)
        self.update(model, optimizer, mechanism, x=x, y=y, indices=indices, expected_batch_size=expected_batch_size,
                    generator=generator)
        return StepOutput(out.losses, out.outputs, out.norms, mechanism)


@METHODS.register("nonprivate")
class NonPrivate(Method):
    name = "nonprivate"
    private = False
    exact = False
    default_accountant = "none"
    summary = "plain SGD/Adam: mean gradient, no clipping, no noise (the speed baseline)"
    compiles = True

    def privatize(self, model, loss_fn, x, y) -> Privatized:
        outputs = model(x)
        losses = loss_fn(outputs, y)
        losses.mean().backward()
        return Privatized(losses.detach(), outputs.detach(), None)
