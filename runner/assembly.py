"""One assembly of a private run, shared by the CLI (runner/train.py set_up) and the API (runner/api.py make_private),
so the two cannot drift apart: the method and how it processes a batch, the sampling, the model's checks, the
accountant and sigma calibrated to a target epsilon.

    request = Request(method="reweight", method_options={}, clip=1.0, sigma=1.0, sampling="poisson", ...)
    private = assemble(request, model, data, world, make_sampler=lambda kind: Sampler(kind, n, B, gen, device))
    private.method, private.model, private.sampler, private.accountant, private.target

Each phase is a function below, in the order assemble calls them: build_method (configure: chunks, precision,
ranks), choose_sampler (a method that needs its own sampling overrides the request), method.attach (BatchNorm
refused, norm-rule coverage), set_up_privacy (accountant, calibration, the accountant's support check). The caller
keeps what is its own: loading data and building the model (CLI), a user's Dataset or DataLoader (API), and the
words it uses for a knob (`names`: the CLI's keys or make_private's arguments).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from runner import accountants, memory_format, methods
from runner.accountants.published import delta_note
from runner.epsilon_shown import shown_noise
from runner.data.sampler import Sampler
from runner.distributed import World
from runner.errors import DprunError
from runner.heap import retain_freed_memory
from runner.methods.privacy_check.probe_rows import attach_probes
from runner.validate import integer

log = logging.getLogger("dprun")

# make_private's arguments for the CLI's keys, in its error messages (the CLI's own spelling is the key itself)
API_NAMES = {"physical_batch_size": "max_physical_batch_size", "sampling=poisson": "poisson=True"}


@dataclass
class Request:
    """What the user asked for: the CLI's config or make_private's arguments, in one vocabulary."""

    method: str
    method_options: Any  # cfg.method (conf/method/<name>.yaml) or make_private's method_options dict
    clip: float
    sigma: float
    sampling: str = "poisson"  # poisson | shuffle; a method that needs its own (sbcd: fixed) overrides it
    accountant: str = "auto"
    physical_batch_size: int | None = None
    precision: str = "fp32"
    memory_format: str = "auto"  # auto | channels_last | contiguous: the CNN activations' layout (runner/memory_format.py)
    epochs: int | None = None
    max_steps_per_epoch: int | None = None  # the CLI's cap on an epoch's steps (calibration counts the capped ones)
    target_epsilon: float | None = None
    delta: float | None = None
    calibration_accountant: str | None = None
    names: Mapping[str, str] = field(default_factory=dict)  # CLI key -> the caller's word for it (API_NAMES)

    def name(self, key: str) -> str:
        return self.names.get(key, key)


@dataclass
class PrivateRun:
    """What assemble returns: everything a training loop needs to take private steps and account for them."""

    method: methods.Method
    model: torch.nn.Module  # the model method.attach returned (the one method.step trains)
    sampler: Any  # runner.data.sampler.Sampler: its kind, sample_rate, steps_per_epoch
    steps_per_epoch: int
    accountant_name: str
    accountant: Any  # an Accountant, or None (non-private, accountant=none)
    target: dict[str, Any]  # target_epsilon: planned_epsilon, target_epsilon_met (summary.json); else {}
    memory_format: str = "contiguous"  # the layout the model's conv weights were put in (summary.json)


def assemble(request: Request, model: torch.nn.Module, data: Any, world: World,
             make_sampler: Callable[[str], Sampler]) -> PrivateRun:
    """The phases below, in order. `make_sampler(kind)`: the caller's sampler of that kind over its data."""
    method = build_method(request, world)
    sampler = choose_sampler(request, method, make_sampler)
    layout = memory_format.apply(model, request.memory_format, method, request.name("memory_format"))
    if layout == "channels_last" and request.memory_format == "auto":
        log.info("memory_format=auto: channels_last on the CPU (this model measured faster so: PyTorch's NCHW max "
                 "pooling is several times slower; the same values)")
    model = method.attach(model, data)  # validates (BatchNorm refused, norm-rule coverage) and prepares
    if method.private:  # training records with extreme keys join the first step's check (probe_rows.py)
        attach_probes(method, data)
    if any(p.device.type == "cpu" for p in model.parameters()):
        # a CPU step's freed blocks serve the next step (runner/heap.py): without it, glibc hands them back and the
        # next step re-faults them (reweight bk: ~700 / 5,600 / 3,500 minor faults a step on L&K's CNN at B=16,
        # bu_cnn and the transformer; 0 with it), for the CLI and make_private alike
        retain_freed_memory()
    steps_per_epoch = sampler.steps_per_epoch
    if request.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, int(request.max_steps_per_epoch))
    name, accountant, target = set_up_privacy(request, method, sampler, steps_per_epoch)
    return PrivateRun(method, model, sampler, steps_per_epoch, name, accountant, target, layout)


def build_method(request: Request, world: World) -> methods.Method:
    """The method with its options, clip and sigma, configured for chunks, precision and ranks."""
    check_physical_batch_size(request.physical_batch_size, request.name("physical_batch_size"))
    method = methods.METHODS.build(request.method, cfg=request.method_options, clip=float(request.clip),
                                   sigma=float(request.sigma))
    return method.configure(physical_batch_size=request.physical_batch_size, precision=request.precision,
                            world=world)


def check_physical_batch_size(value: Any, name: str) -> None:
    """An integer >= 1 or None, else one line in the caller's words (`name`)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise DprunError(f"{name}={value!r} must be an integer >= 1, or unset for one pass over each batch")


def choose_sampler(request: Request, method: methods.Method, make_sampler: Callable[[str], Sampler]) -> Sampler:
    """The request's sampling, unless the method needs its own (DP-SBCD: fixed disjoint batches)."""
    kind = method.sampling or request.sampling
    if method.sampling and method.sampling != request.sampling:
        log.info("method=%s needs sampling=%s (its accountant assumes it); using it", method.name, method.sampling)
    return make_sampler(kind)


def set_up_privacy(request: Request, method: methods.Method, sampler: Sampler,
                   steps_per_epoch: int) -> tuple[str, Any, dict[str, Any]]:
    """(accountant name, accountant or None, target columns): sigma calibrated to target_epsilon if one is asked for,
    and the accountant's support for the method's mechanism checked before any step."""
    name = accountants.resolve_name(request.accountant, method)
    accountant = accountants.build(name) if method.private else None
    target: dict[str, Any] = {}
    if request.target_epsilon is not None:
        target = calibrate(request, method, sampler, name, accountant, steps_per_epoch)
    if accountant is not None:
        accountants.check_for_method(accountant, method, sampler.sample_rate)
        weak = delta_note(request.delta, int(getattr(sampler, "n", 0) or 0))
        if weak:
            log.warning(weak)
    return name, accountant, target


def calibrate(request: Request, method: methods.Method, sampler: Sampler, name: str, accountant: Any,
              steps_per_epoch: int) -> dict[str, Any]:
    """method.sigma set so that epsilon after the planned steps is at most target_epsilon; returns
    planned_epsilon (the certified epsilon the run publishes after them) and target_epsilon_met."""
    if not method.private:
        raise DprunError("target_epsilon is set but method=nonprivate has no privacy to calibrate")
    # whole epochs only: int(0.5) planned 0 steps, so sigma was calibrated to its floor and the target "met"
    accepted = None if request.epochs is None else integer(1)(request.epochs)
    if accepted is not None:
        raise DprunError(f"{request.name('epochs')}={request.epochs!r} is not valid: {request.name('epochs')} must "
                         f"be {accepted} (target_epsilon is calibrated for whole epochs)")
    if not request.epochs or request.delta is None:
        raise DprunError("target_epsilon needs epochs and delta (the privacy budget is for the whole run)")
    if accountant is not None and sampler.kind != accountant.assumes_sampling:
        raise DprunError(f"target_epsilon needs {request.name(f'sampling={accountant.assumes_sampling}')}: no "
                         f"accountant here analyses sampling={sampler.kind}, so no epsilon could be certified")
    calibrator = accountants.calibration_accountant(name, request.calibration_accountant)  # certified: never gdp
    steps = steps_per_epoch * int(request.epochs)
    target_epsilon, delta = float(request.target_epsilon), float(request.delta)
    method.sigma = accountants.calibrate_sigma(calibrator, method.mechanism, sampler.sample_rate, steps,
                                               target_epsilon, delta)
    log.info("calibrated sigma=%s for epsilon=%s at delta=%s (accountant=%s)", shown_noise(method.sigma),
             target_epsilon, delta, calibrator)  # rounded down: its epsilon is never below the run's
    return accountants.check_target(name, calibrator, method.mechanism(sampler.sample_rate), steps, target_epsilon,
                                    delta)
