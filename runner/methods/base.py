"""The clipping-method interface. One file per method registers itself in METHODS.

A method turns a batch into a (privatized) update; library users, runner/train.py and the benches use it alike:

    method = METHODS.build("reweight", cfg=cfg.method, clip=1.0, sigma=1.0)
    model = method.attach(model, data)            # THE entry: refuses BatchNorm (one line), checks coverage, hooks
    out = method.step(model, loss_fn, x, y, optimizer, sample_rate=q, expected_batch_size=B)
    out.losses, out.outputs, out.norms, out.mechanism    # the mechanism is what the accountant is told

`attach` validates (the checks every private method shares) and then calls `prepare`, the subclass hook (norm-rule
coverage, Opacus's hooks, DP-SBCD's auxiliary variables); `step` accepts only the model `attach` returned.
`configure` sets how a logical batch is processed, never what is released (a method refuses what it cannot do
in one line, `why_not(Feature.X)`, runner/methods/features.py):

    method.configure(physical_batch_size=128, precision="bf16", world=world)

`step` is the same for every method: the step's mechanism; `clipped_sum`, which runs `privatize` on chunks of at
most physical_batch_size examples (none for an empty batch: the clipped sum is zero, the noisy update still
happens), under autocast for bf16, adds the chunks' clipped sums (float32 or the model's dtype) and then the
ranks' (runner/distributed.py); then `update`, ONE noise draw and optimizer step per logical batch:

    privatize(model, loss_fn, x, y) -> Privatized     the core each method implements: leaves the SUM over the
        batch of per-example gradients clipped to norm `clip` in each trainable parameter's `.grad` and returns
        only what it computed (losses, outputs, per-example norms)
    update(model, optimizer, mechanism, ...)          the default adds the noise and divides by the expected batch
        (runner/methods/noise.py), then steps the optimizer; DP-SBCD overrides it with its block updates

`loss_fn(outputs, y)` returns per-example losses, shape (B,).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from runner.distributed import World
from runner.errors import DprunError
from runner.trainable import trainable  # noqa: F401  (methods import it from here)
from runner.accountants.mechanisms import Mechanism, NoPrivacy, SubsampledGaussian
from runner.backward_thread import backward_in_this_thread
from runner.methods.dropped import without_dropped
from runner.methods.features import Feature
from runner.methods.noise import add_noise_and_scale
from runner.methods.rng import rng_state
from runner.methods.structure import Structure
from runner.precision import PRECISIONS, ROUNDING_MARGIN, autocast, matmul_precision
from runner.registry import Registry

METHODS = Registry("method")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, y) -> (B,)


@dataclass
class Privatized:
    """What privatize computed (the clipped gradient sum itself is left in p.grad)."""

    losses: torch.Tensor  # (B,) detached per-example losses
    outputs: torch.Tensor | None  # (B, classes) detached model outputs, for train accuracy
    norms: torch.Tensor | None  # (B,) per-example gradient norms (estimates for JL); None if not computed
    # 0-dim bool: the release agrees with what the norms measured (jl: its projections, runner/methods/jl.py
    # release_agrees); None where the method's release is its norms' own records. False: the chunk is formed again
    # without the records whose release alone disagrees (runner/methods/dropped.py)
    consistent: torch.Tensor | None = None


@dataclass
class StepOutput(Privatized):
    mechanism: Mechanism | None = None  # what the accountant is told about this step (always given)


WEIGHT_DTYPES = (torch.float32, torch.float64)  # what a private method trains (Method.validate says why)


# The range of the clip C and of the noise std sigma * C (sigma > 0) that a method accepts. Far outside it float32
# rounds what is released: C = 1e-44 (subnormal) made the noise std exactly 0 while the accountant certified an
# epsilon, C = 1e-43 gave contributions of 1.04 C and a noise std of 1.11 sigma C, sigma * C = 1e40 overflowed the
# noise to inf after the step was counted. 1e-30 and 1e30 keep every clipped gradient, noise draw and division by the
# expected batch size normal in float32 (and float64). SCALE_RANGE bounds sigma * C; C itself has CLIP_RANGE below. The
# CLI's validate.py refuses the same values.
SCALE_RANGE = (1e-30, 1e30)
SCALE_TEXT = "[1e-30, 1e30]"
# C itself from 1e-6 (review 64): a clipped sum weights one side of a layer's records by nu_i and multiplies the other;
# a weighted entry below float32's smallest normal is rounded by up to 2^-150 absolutely, which the other side
# multiplies (a row of norm up to 2^64, else its example's norm is not finite and it is dropped). Those losses add up
# to at most 2^-86 M per example (M: the weighted entries times their uses, 2^-70 M on bf16 tensor cores), which
# CLIP_SLACK covers for M up to ~1e13 (2e8) once C >= 1e-6: at C ~ 1.5e-30 one example released 1.86 C
CLIP_RANGE = (1e-6, 1e30)
CLIP_TEXT = "[1e-6, 1e30]"
CLIP_SLACK = 2.0**-22  # clip_factors aims at C (1 - CLIP_SLACK): 3 u of it survive C's own rounding to float32


def scale_problem(clip: float, sigma: float) -> str | None:
    """Why this finite clip (> 0) and sigma (>= 0) are refused (one line), or None: C, or sigma * C when sigma > 0,
    outside SCALE_RANGE."""
    low, high = SCALE_RANGE
    if not CLIP_RANGE[0] <= clip <= CLIP_RANGE[1]:
        return (f"clip (max_grad_norm)={clip:g} is outside the accepted range {CLIP_TEXT}: near float32's limits "
                f"the clipped gradients and the noise scaled to C are rounded (below 1e-6 the rounding of the "
                f"clipped sums is no longer covered by the clip bound); accepted: C in {CLIP_TEXT} (rescale the loss "
                f"to reach it)")
    if sigma > 0 and not low <= sigma * clip <= high:
        return (f"sigma (noise_multiplier)={sigma:g} with clip (max_grad_norm)={clip:g} puts the noise std sigma * C "
                f"= {sigma * clip:g} outside the accepted range {SCALE_TEXT}: near float32's limits the noise is "
                f"rounded (to 0) or overflows (to inf); accepted: sigma * C in {SCALE_TEXT}, or sigma=0 (no noise, "
                f"epsilon = inf)")
    return None


def _checked(value: float, name: str, low: float, strict: bool, why: str) -> float:
    """float(value) if finite and > low (strict) or >= low, else one line naming it (Method.clip, Method.sigma)."""
    value = float(value)
    if not (math.isfinite(value) and (value > low if strict else value >= low)):
        raise DprunError(f"{name}={value} must be a finite number {'>' if strict else '>='} {low:g}{why}")
    return value


def _scaled(method: "Method", clip: float | None = None, sigma: float | None = None) -> float:
    """The checked clip or sigma being set on `method`, refused (one line) with the other value already set where
    C or sigma * C leaves SCALE_RANGE (scale_problem). The constructor sets clip first: sigma is then unset."""
    problem = scale_problem(method._clip if clip is None else clip,
                            getattr(method, "_sigma", 0.0) if sigma is None else sigma)
    if problem:
        raise DprunError(problem)
    return sigma if clip is None else clip


def clip_factors(norms: torch.Tensor, clip: float, margin: float = 0.0) -> torch.Tensor:
    """min(1, C (1 - CLIP_SLACK) / (norm (1 + margin) + 1e-6)), shape (B,); 0 where the norm is not finite (inf or
    nan: the example must contribute nothing, runner/norms/certify.py). CLIP_SLACK covers the weighted records'
    rounding below float32's smallest normal (review 64, CLIP_RANGE above); ordinary factors move by 2.4e-7. The
    1e-6 keeps zero-gradient examples finite; the margin (bf16 only, runner/precision.py) covers the rounding of a
    norm formed from reduced-precision tensors.
    Six kernels: an inf norm gives C / inf = 0 by itself, a nan one a nan factor that nan_to_num_ sets to 0 (an
    isfinite mask and a where cost five more, and a small model's GPU step is launch-bound).

    One unit in the last place of the dtype's subnormals is taken off: a quotient below the smallest normal number
    (C / N < 2^-126 in float32; out of reach once C >= 1e-6 and N <= 2^64, but the privacy check's probes set tinier
    clips directly) is rounded to a multiple of 2^-149, up by as much as 100%,
    which no relative margin covers (review 61: C / N = 0.51 * 2^-149 rounded to 2^-149 and the example released
    1.96 C). Less that spacing it is at most the exact quotient; a normal quotient loses nothing (the subtraction
    is below half its unit in the last place, or takes it one down)."""
    scaled = norms * (1.0 + margin) if margin else norms
    info = torch.finfo(norms.dtype)
    aim = clip * (1.0 - CLIP_SLACK)
    return (aim / (scaled + 1e-6)).sub_(info.tiny * info.eps).clamp_(0.0, 1.0).nan_to_num_(nan=0.0)


def chunks(x, y, size: int | None):
    """(x, y) cut into consecutive chunks of at most `size` rows; one chunk when size is None; none when empty."""
    n = len(y)
    step = n if size is None else int(size)
    for start in range(0, n, max(step, 1)):
        yield x[start:start + step], y[start:start + step]


def add_into(total: list[torch.Tensor] | None, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The running clipped sum over chunks: total += each p.grad (a missing one counts as zero). The first chunk's
    gradients become the total (no copy: one chunk costs nothing extra)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if total is None:
        return grads
    torch._foreach_add_(total, grads)
    return total


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
    # False: the method's per-example gradients need NCHW activations, so memory_format=auto leaves the model
    # contiguous and channels_last is refused (runner/memory_format.py; Opacus's unfold assumes row-major strides)
    channels_last: ClassVar[bool] = True
    # True once a CompiledStep runs this method's privatize under torch.compile (runner/methods/compiled.py): routes
    # that register hooks or tensor hooks inside the traced region (reweight's lean recorder) are not taken then,
    # even where Dynamo falls back to running a frame eagerly (torch.compiler.is_compiling() is False there)
    traced: bool = False

    # how a logical batch is processed (configure()): chunk size, autocast, ranks. Never what is released.
    physical_batch_size: int | None = None
    precision: str = "fp32"
    world: World  # per instance (__init__): forward_rng counts this method's steps
    # False (privacy_check=false, make_private(validate=False)): skip the first step's check (runner/methods/privacy_check/);
    # the run's privacy notes then say the guarantee is unchecked
    privacy_check: bool = True
    audit: Any = None  # audit=one_run: its hook adds gradient canaries to the clipped sum (runner/audit/run.py)
    _walked: Any = None  # (model, trainable(model)) while step() runs: Method.trainable
    _structure: Any = None  # runner/methods/structure.py Structure of the attached model's modules
    released: bool = False  # step(): the update (noise, optimizer) began, so the step is one to account for

    def __init__(self, cfg: Any = None, clip: float = 1.0, sigma: float = 1.0, **unknown: Any):
        if unknown:  # e.g. r=4: method options live in cfg (conf/method/<name>.yaml), never silently dropped
            raise DprunError(f"method={self.name} got unknown argument(s) {', '.join(sorted(unknown))}; pass method "
                             f"options in cfg, e.g. METHODS.build({self.name!r}, cfg={{'r': 4}}, clip=1.0, sigma=1.0)")
        self.cfg = cfg if cfg is not None else {}
        self.clip = clip
        self.sigma = sigma
        self.model: torch.nn.Module | None = None  # the model attach() returned: the one step() trains
        self.world = World()  # one process until configure(world=...)

    # clip and sigma are checked wherever they are set (the constructor, calibration, a resume, a user's own
    # `private.method.sigma = ...`): noise.py draws no noise for sigma * C <= 0, so a clip <= 0 or a sigma < 0
    # would train without noise while the accountant certifies a finite epsilon (the CLI's validate.py refuses
    # them too, in its words); and C, or sigma * C for sigma > 0, must lie in SCALE_RANGE (float32 rounds them)
    clip = property(lambda self: self._clip, lambda self, v: setattr(self, "_clip", _scaled(self, clip=_checked(
        v, "clip (max_grad_norm)", 0.0, strict=True, why=": the bound on each example's gradient norm, which the "
                                                          "noise is scaled to"))))
    sigma = property(lambda self: self._sigma, lambda self, v: setattr(self, "_sigma", _scaled(self, sigma=_checked(
        v, "sigma (noise_multiplier)", 0.0, strict=False, why=" (0: no noise, epsilon = inf)"))))

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

    def configure(self, *, physical_batch_size: int | None = None, precision: str = "fp32",
                  world: World | None = None) -> "Method":
        """How each logical batch is processed: in chunks of at most `physical_batch_size` examples (None: one
        pass), under `precision` (fp32 | bf16), on the ranks of `world`. DprunError (one line) for what the method
        cannot do exactly; else the same released step, whatever the settings (tests/test_physical_batch.py)."""
        if physical_batch_size is not None and (isinstance(physical_batch_size, bool) or int(physical_batch_size) < 1):
            raise DprunError(f"physical_batch_size={physical_batch_size} must be an integer >= 1 or null")
        if precision not in PRECISIONS:
            raise DprunError(f"precision={precision!r} is not valid; valid: {', '.join(PRECISIONS)} (fp16 with loss "
                             f"scaling is not supported)")
        world = world or World()
        for asked, feature in ((physical_batch_size is not None, Feature.PHYSICAL_BATCH),
                               (precision == "bf16", Feature.BF16), (precision == "tf32", Feature.TF32),
                               (world.size > 1, Feature.DISTRIBUTED)):
            why = self.why_not(feature) if asked else None
            if why:
                raise DprunError(f"method={self.name} cannot run with {feature}: {why}")
        self.physical_batch_size = None if physical_batch_size is None else int(physical_batch_size)
        self.precision, self.world = precision, world
        return self

    def why_not(self, feature: Feature) -> str | None:
        """Why this method (with its options) cannot run with `feature`, or None; `feature` must be a Feature."""
        if not isinstance(feature, Feature):
            raise TypeError(f"method capabilities are Feature members ({', '.join(f.name for f in Feature)}), "
                            f"not {feature!r}")
        if feature is Feature.TF32 and not self.exact_under_tf32():
            return ("its per-example gradients, norms or clipped sums would be formed with TF32's 10-bit products, "
                    "up to ~1e-3 away from what was measured (an example could exceed C); precision=tf32 is for "
                    "method=reweight with method.mode=bk, and nonprivate")
        return self.unsupported(feature)

    def backward_holds_records(self) -> bool:
        """True where the clipped sum is a backward through a forward's graph, which holds a non-finite record's
        values (0 * inf = nan would reach every sum): each chunk is then checked, and formed again without such
        records (runner/methods/dropped.py). False where the sum leaves them out itself (recorded rows masked)."""
        return False

    def exact_under_tf32(self) -> bool:
        """precision=tf32 puts TF32 products in the step's forward and backward (CUDA). Certified only for a method
        that forms every norm and clipped sum with TF32 off, from the very tensors it recorded (reweight bk:
        runner/norms/certify.py exact_float32), or that has no privacy to lose (nonprivate). Opt-in."""
        return not self.private

    def unsupported(self, feature: Feature) -> str | None:
        """The subclass hook behind why_not. The default supports every Feature: the shared step chunks, autocasts
        and reduces."""
        return None

    def autocast(self, x: torch.Tensor):
        """The context for the model's forward and the loss (never the norms): autocast under bf16."""
        return autocast(x.device, self.precision)

    def clip_factors(self, norms: torch.Tensor) -> torch.Tensor:
        """(B,) clip factors for (B,) norms, with the precision's rounding margin (runner/precision.py)."""
        return clip_factors(norms, self.clip, ROUNDING_MARGIN[self.precision])

    # -- the one entry -----------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module, data: Any = None) -> torch.nn.Module:
        """Validate the model, prepare it (the subclass hook) and return the model to train; `step` takes only it."""
        self.validate(model)
        prepared = self.prepare(model, data)
        self.model = model if prepared is None else prepared
        self._structure = Structure(self.model, trainable(self.model))  # step() checks again if they change
        return self.model

    def validate(self, model: torch.nn.Module) -> None:
        """Checks every private method shares: BatchNorm is rejected, since with batch statistics an example's
        gradient depends on the other examples and clipping bounds nothing; an uninitialised lazy module
        (nn.LazyLinear before its first forward) too, which raised torch's ValueError at attach (opacus) or at the
        step (multiloss, jl) and has no shapes for the norm rules (method=nonprivate takes it: its first forward
        sets them)."""
        if not self.private:
            return
        from runner.norms.coverage import REASONS
        from runner.methods.privacy_check import check_modules

        for path, module in model.named_modules():
            if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
                raise DprunError(f"{path or '<model>'} ({type(module).__name__}) cannot be trained with "
                                 f"method={self.name}: its parameters are not initialised yet (a lazy module); run "
                                 f"one forward first (e.g. model(x[:1])) so they get their shapes; accepted: "
                                 f"initialised modules")
        check_modules(model, self.name)  # Embedding(max_norm), tracked InstanceNorm: they write data into the model

        for path, p in model.named_parameters():
            # the clipped sum is accumulated and noised in the weights' dtype: in bf16 (8-bit mantissa) or fp16 one
            # example's share of the sum is rounded by up to a few C, which the noise was not scaled to.
            # precision=bf16 autocasts the forward and keeps float32 weights (the CLI's dtype= allows only these)
            if p.requires_grad and p.dtype not in WEIGHT_DTYPES:
                raise DprunError(f"{path} ({str(p.dtype).replace('torch.', '')}) cannot be trained with "
                                 f"method={self.name}: weights must be float32 or float64 (for bfloat16 compute "
                                 f"keep float32 weights and pass precision='bf16')")

        for path, module in model.named_modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                reason = REASONS[torch.nn.modules.batchnorm._BatchNorm]
                raise DprunError(f"{path or '<model>'} ({type(module).__name__}) cannot be trained with "
                                 f"method={self.name}: {reason}")

    # -- hooks for subclasses ---------------------------------------------------------------------------
    def prepare(self, model: torch.nn.Module, data: Any = None) -> torch.nn.Module:
        """Check the model can be handled (raise DprunError naming the module otherwise); return the model to train."""
        return model

    def begin_step(self, model) -> None:
        """Draws shared by every chunk and rank of one logical step (JL's directions); before any forward."""

    def end_step(self) -> None:
        """After the step's last chunk: forget what begin_step drew."""

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
            add_noise_and_scale(model, self.sigma * self.clip, expected_batch_size, generator, self.trainable(model))
        optimizer.step()

    def trainable(self, model) -> list:
        """trainable(model), walked once a step: inside step() the walk made at its start (a step asked for it three
        times: the clipped sum, reweight's coverage check, the noise; ~12 us each on bu_cnn, ~1% of a host-bound
        small step), elsewhere (a direct clipped_sum or privatize, a compiled graph) a fresh walk. A step whose
        trainable parameters change midway is refused by reweight's end-of-step check, which walks afresh."""
        if torch.compiler.is_compiling():  # (traced: not the step's memo, which changes every step)
            return trainable(model)
        walked = self._walked
        return walked[1] if walked is not None and walked[0] is model else trainable(model)

    # -- the shared step ---------------------------------------------------------------------------------
    def step(self, model, loss_fn: LossFn, x, y, optimizer, *, sample_rate: float, expected_batch_size: float,
             generator: torch.Generator | None = None, indices: torch.Tensor | None = None,
             privatize=None, mechanism=None) -> StepOutput:
        """One logical step on this rank's share (x, y) of the Poisson batch: clipped sum, noise, update.
        `privatize`: what runs each chunk (default self.privatize; compile= passes a compiled, padded one).
        `mechanism`: the step's, when the caller already asked step_mechanism (the API, to account before the
        release): asked again, sbcd's advanced its batch position twice (its epoch, hence its noise, ran ahead)."""
        if self.model is None or model is not self.model:
            raise DprunError(f"method={self.name}: step a model returned by method.attach(model) (it validates and "
                             f"prepares it)")
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        mechanism = self.step_mechanism(sample_rate, indices) if mechanism is None else mechanism
        self.released = False  # True from the update on (noise, optimizer): the step is then one to account for
        self._walked = (model, trainable(model))  # this step's trainable parameters (Method.trainable)
        if self.private and self._structure is not None and self._structure.changed(model, self._walked[1]):
            # a module inserted or swapped, or a parameter unfrozen, after attach (a BatchNorm, a layer that mixes
            # the batch, a tied weight now trained): attach's checks again, and the first step's on this step
            self._walked = None
            self.validate(model)
            self._walked = (model, trainable(model))
            self._structure.accept(model, self._walked[1])
            self._privacy_checked = None  # clipped_sum's first-step check runs on this step
        if self.private and any(p.dtype not in WEIGHT_DTYPES for p in self._walked[1]):  # model.half() after attach
            self._walked = None
            self.validate(model)  # names the parameter
        try:
            out = self.clipped_sum(model, loss_fn, x, y, privatize)
            self.released = True
            self.update(model, optimizer, mechanism, x=x, y=y, indices=indices,
                        expected_batch_size=expected_batch_size, generator=generator)
        finally:
            self._walked = None
        return StepOutput(out.losses, out.outputs, out.norms, mechanism=mechanism)

    def clipped_sum(self, model, loss_fn: LossFn, x, y, privatize=None) -> Privatized:
        """p.grad = the sum over the whole logical batch (every chunk, every rank) of the clipped per-example
        gradients. `privatize` (default self.privatize) runs one chunk: compile= passes a compiled, padded one."""
        given = privatize is not None  # compile='s (compiled.py) or padding's: autograd's own threads kept there
        privatize = privatize or self.privatize
        if self.private and self.privacy_check:  # once per run, whatever runs the chunks (compile=, chunks, ranks)
            from runner.methods.privacy_check import check_first_step

            with matmul_precision(x.device, self.precision):  # the products the step's own will take
                check_first_step(self, model, loss_fn, x, y)  # refuses (one line) what per-example clipping cannot bound
        params = self.trainable(model)
        self.begin_step(model)  # before the forward fork: the same draws on every rank
        parts: list[Privatized] = []
        total = None
        try:
            # (on CUDA the backward runs in this thread: book-keeping's norm hooks are Python, runner/backward_thread.py)
            with self.world.forward_rng(x.device), matmul_precision(x.device, self.precision), \
                    backward_in_this_thread(x.device, compiled=given):
                for xc, yc in chunks(x, y, self.physical_batch_size):
                    if parts:  # the earlier chunks' sum is in `total`; this chunk's privatize writes p.grad afresh
                        for p in params:
                            p.grad = None
                        if len(parts) == 1 and getattr(privatize, "overwrites_outputs", False):
                            # CUDA graphs (compile=reduce-overhead|cudagraphs): the first chunk's gradients are the
                            # graph's static outputs, which this chunk's replay overwrites: the sum owns a copy
                            total = torch._foreach_add(total, 0.0)
                    state = rng_state(x.device) if self.backward_holds_records() else None
                    part = privatize(model, loss_fn, xc, yc)
                    if state is not None:  # a record that was not finite adds nothing (runner/methods/dropped.py)
                        part = without_dropped(self, model, loss_fn, xc, yc, part, state, params)
                    parts.append(part)
                    total = add_into(total, params)
        finally:
            self.end_step()
        for p, t in zip(params, total or []):
            p.grad = t
        if self.audit is not None:  # gradient canaries join here, as an example's clipped gradient would
            self.audit.add_canaries(params)
        self.examples = len(y)  # the logical batch's size (non-private divides by it)
        if self.world.size > 1:  # the global sum on every rank (an empty share adds zeros), with the global size
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            count = torch.full((1,), float(len(y)), device=x.device, dtype=params[0].dtype if params else None)
            self.world.all_reduce_([p.grad for p in params] + [count])
            self.examples = count[0]  # 0-dim: the divisor of non-private's summed gradient
        return joined(parts, x, self.private)


def joined(parts: list[Privatized], x: torch.Tensor, private: bool) -> Privatized:
    """The chunks' losses, outputs and norms, concatenated: (B,), (B, classes), (B,); empty for an empty batch."""
    if not parts:
        empty = x.new_zeros(0, dtype=torch.get_default_dtype())
        return Privatized(empty, None, empty.clone() if private else None)
    if len(parts) == 1:
        return parts[0]
    cat = lambda ts: None if any(t is None for t in ts) else torch.cat(ts)  # noqa: E731
    return Privatized(cat([p.losses for p in parts]), cat([p.outputs for p in parts]), cat([p.norms for p in parts]))


@METHODS.register("nonprivate")
class NonPrivate(Method):
    name = "nonprivate"
    private = False
    exact = False
    default_accountant = "none"
    summary = "plain SGD/Adam: mean gradient, no clipping, no noise (the speed baseline)"
    compiles = True

    def privatize(self, model, loss_fn, x, y) -> Privatized:
        with self.autocast(x):
            outputs = model(x)
            losses = loss_fn(outputs, y)
        losses.sum().backward()  # a sum, like every method: chunks and ranks add; update() divides
        return Privatized(losses.detach(), outputs.detach(), None)

    @torch.no_grad()
    def update(self, model, optimizer, mechanism, *, x, y, indices, expected_batch_size, generator) -> None:
        """The mean gradient over the realised batch (no privacy to protect here), then the optimizer step."""
        grads = [p.grad for p in trainable(model) if p.grad is not None]
        if grads and not (isinstance(self.examples, int) and self.examples == 0):
            torch._foreach_div_(grads, self.examples if isinstance(self.examples, int) else
                                self.examples.clamp_min(1))
        optimizer.step()
