"""The library API: DP training of YOUR model in YOUR loop, with the same methods, noise and accountants as `dprun`.

    import dprun                                   # or: from runner.api import make_private
    private = dprun.make_private(model, optimizer, (x, y), method="reweight", noise_multiplier=1.0,
                                 max_grad_norm=1.0, batch_size=64)
    for epoch in range(epochs):
        for xb, yb in private.batches():           # Poisson-sampled batches (the accountants assume it)
            private.step(xb, yb, loss_fn)          # clip, noise, optimizer.step(), tell the accountant
        print(private.get_epsilon(delta=1e-5))

`loss_fn(outputs, y)` returns per-example losses, shape (B,) (e.g. `F.cross_entropy(..., reduction="none")`).
Instead of `step` a loop may call `private.backward(xb, yb, loss_fn)` (p.grad then holds the private gradient:
clipped, noised, divided by the expected batch size) and `optimizer.step()` itself.

Data: in-memory tensors `(x, y)` (batches are index gathers), a torch `Dataset`, or a `DataLoader` (its dataset,
batch_size and collate_fn are kept; its batches are replaced by Poisson batches, see `poisson_loader`).

Nothing here is a second implementation: the method is `METHODS.build(...)` + validate/prepare (runner/methods/),
its `step` adds the noise (runner/methods/noise.py), the accountant is `accountants.build(...)` and the sampler
is runner/data/sampler.py's. docs/api.md has a runnable example.
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset as TorchDataset, IterableDataset, Sampler as TorchSampler
from torch.utils.data.dataloader import default_collate

from runner import distributed, randomness
from runner.methods import privacy_check
from runner.assembly import API_NAMES, PrivateRun, Request, assemble
from runner.data.base import DataInfo, Dataset
from runner.data.sampler import Sampler
from runner.accountants.published import delta_note
from runner.collated import batch_size_of
from runner.errors import DprunError
from runner.methods.base import StepOutput
from runner.methods.privacy_check.probe_rows import attach_probes
from runner.validate import check_options

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, y) -> (B,)


def _child_generator() -> torch.Generator:
    """A sampling generator seeded from torch's global RNG (so torch.manual_seed makes the batches reproducible)."""
    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))


class PoissonBatchSampler(TorchSampler):
    """Index batches for a DataLoader (`batch_sampler=`): each example joins each batch independently with
    probability q = batch_size / n; round(n / batch_size) batches per epoch; a batch may be empty.
    The indices come from runner.data.sampler.Sampler, the sampler `dprun` uses."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator | None = None, kind: str = "poisson"):
        gen = generator if generator is not None else _child_generator()
        self.sampler = Sampler(kind, n, batch_size, gen, "cpu")
        self.world = None  # make_private on several ranks: yield this rank's share of each global batch
        self.drawn = 0  # Poisson masks drawn so far (every iteration's); the batches of one start at `started`
        self.started = 0

    def __iter__(self) -> Iterator[list[int]]:
        # the DataLoader draws ahead of what it yields (its workers' prefetch), and an abandoned iteration's drawn
        # masks are gone: the j-th batch an iteration yields is mask started + j, whatever was drawn since
        self.started = self.drawn
        for idx in self.sampler.epoch():
            self.drawn += 1
            self.last = (idx if self.world is None else self.world.share(idx)).tolist()  # make_private's first batch
            yield self.last

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch


def _empty_like_batch(dataset: TorchDataset, collate: Callable) -> Any:
    """A batch of 0 examples with the right shapes: one example collated, then sliced to [:0]."""
    one = collate([dataset[0]])
    def cut(b):
        if isinstance(b, torch.Tensor):
            return b[:0]
        if isinstance(b, (list, tuple)):
            return type(b)(cut(v) for v in b)
        if isinstance(b, dict):
            return {k: cut(v) for k, v in b.items()}
        return b
    return cut(one)


class SafeCollate:
    """The Poisson loader's collate_fn: an empty batch as `empty` (shapes kept), else the user's collate, whose rows
    must be one per example. A class, not a closure, so that workers started by spawn can pickle it (review 48)."""

    def __init__(self, collate: Callable, empty: Any):
        self.collate, self.empty = collate, empty

    def __call__(self, batch: list) -> Any:
        if not len(batch):
            return self.empty
        collated = self.collate(batch)
        rows = batch_size_of(collated)
        if rows >= 0 and rows != len(batch):  # (no shared size: step() refuses the batch itself)
            raise DprunError(f"collate_fn returned {rows} rows for the {len(batch)} examples it was given: each "
                             f"example must be one row, since the accountant bounds one record's contribution by one "
                             f"clipped gradient (views of an example in rows of their own add one C each; review 24: "
                             f"2 views released 2 C); build the views inside the model or the loss, averaged per "
                             f"example")
        return collated


def poisson_loader(data: TorchDataset | DataLoader, batch_size: int | None = None,
                   generator: torch.Generator | None = None, **loader_kwargs: Any) -> DataLoader:
    """A DataLoader of Poisson batches of expected size `batch_size` over a Dataset (or a DataLoader's dataset,
    keeping its batch_size, collate_fn and num_workers). Empty batches are yielded too (with shapes), since a
    step on an empty batch is still a step of the mechanism the accountant counts."""
    if isinstance(data, DataLoader):
        batch_size = batch_size or data.batch_size
        loader_kwargs = {"collate_fn": data.collate_fn, "num_workers": data.num_workers,
                         "pin_memory": data.pin_memory, **loader_kwargs}
        data = data.dataset
    if not batch_size:
        raise DprunError("poisson_loader needs batch_size (the expected batch size)")
    collate = loader_kwargs.pop("collate_fn", None) or default_collate
    loader = DataLoader(data, batch_sampler=PoissonBatchSampler(len(data), int(batch_size), generator),
                        collate_fn=SafeCollate(collate, _empty_like_batch(data, collate)), **loader_kwargs)
    loader.per_example_collate = collate  # the caller's own (make_private checks it builds rows per example)
    return loader


class _NoStep:
    """The optimizer as Method.step sees it in `backward`: zero_grad passes through, step does nothing."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, *_: Any, **__: Any) -> None:
        pass


class PrivateTraining:
    """What make_private returns: the (prepared) model, its batches, a private step and epsilon so far."""

    def __init__(self, model, optimizer, method, accountant, accountant_name: str, sampler: Sampler | None,
                 loader: DataLoader | None, tensors: tuple[torch.Tensor, torch.Tensor] | None, n: int,
                 batch_size: int, delta: float | None, generator: torch.Generator | None):
        self.model, self.optimizer, self.method = model, optimizer, method
        self.accountant, self.accountant_name = accountant, accountant_name
        self._sampler, self._loader, self._tensors = sampler, loader, tensors
        self.n, self.sample_rate = n, batch_size / n
        self.expected_batch_size = float(batch_size)
        self.delta, self.generator = delta, generator
        self.steps = 0
        self.sampling = "poisson"  # set by make_private: the sampling the batches really use
        self.rng = "seeded"  # set by make_private: seeded | secure (runner/randomness.py)
        self.planned_epsilon: float | None = None  # target_epsilon: the certified epsilon after the planned epochs
        self.target_epsilon_met: bool | None = None
        self.privacy_notes: list[str] = []  # as summary.json's: what the guarantee does not cover
        self._collate_checked = False  # the DataLoader path's first batch (_check_collate); True: done or skipped
        self._yielded = 0  # the waiting batch's number: which Poisson mask it is, the same on every rank
        self._guards: list = []  # after backward()'s release: hooks refusing a gradient added before optimizer.step()
        self._disarm_on_step = None  # the optimizers' step hooks that remove them (and refuse a closure)
        self._user_optimizers: list = []  # the optimizer make_private was given, where it rebuilt another

    @property
    def noise_multiplier(self) -> float:
        return self.method.sigma

    @property
    def steps_per_epoch(self) -> int:
        return self._sampler.steps_per_epoch if self._sampler is not None else len(self._loader.batch_sampler)

    def batches(self) -> Iterator[Any]:
        """One epoch of batches: (x, y) index gathers for tensors, else the Poisson DataLoader's batches. Each is
        for ONE step() or backward() (the accountant counts one Poisson sample per step)."""
        if self._tensors is None:
            for j, batch in enumerate(self._loader):
                # the number of the Poisson mask this batch came from (review 48: with num_workers the loader draws
                # ahead, and a count of yields paired two ranks' different batches after one abandoned an epoch)
                self._waiting, self._yielded = batch_size_of(batch), self._loader.batch_sampler.started + j + 1
                self._check_collate(batch)
                yield batch
            return
        x, y = self._tensors
        for idx in self._sampler.epoch():
            idx = self.method.world.share(idx)  # several ranks: this rank's share of the global Poisson batch
            self._last_indices = idx
            self._waiting, self._yielded = len(idx), self._yielded + 1
            yield x[idx], y[idx]

    def _check_collate(self, batch) -> None:
        """The first batch of two or more examples: each collated alone equals its row (runner/methods/privacy_check/
        collate.py), where the loader collates in this process (its batch sampler's last indices are this batch's)."""
        if self._collate_checked or not self.method.private or self._loader.num_workers:
            return
        indices = getattr(self._loader.batch_sampler, "last", None)
        if indices is not None and len(indices) >= 2:
            privacy_check.check_collate(self._loader.dataset, self._loader.per_example_collate, self.method.name,
                                        indices, batch)
            self._collate_checked = True

    def _run(self, x, y, loss_fn: LossFn, optimizer) -> StepOutput:
        record = getattr(self, "_record", None)
        if record is not None and record["owner"] != id(self):
            raise DprunError("this PrivateTraining was superseded by a later make_private on the same model (which "
                             "accounts its steps from then on): step that one")
        self._disarm()  # a gradient added after backward() and before optimizer.step() is refused until the next step
        self._check_batch(x, y)
        self._check_user_autocast(x)
        world = self.method.world
        if world.size > 1 and not world.same_everywhere(self._yielded, x.device):
            # review 46: a rank skipping its (empty) share paired its release with the next batch's on the others:
            # one record in one release twice (2 C), accounted once; refused before anything is computed
            raise DprunError(f"private.step()/backward() on rank {world.rank} got batch {self._yielded} of batches(), "
                             f"another rank a different one: every rank must call step() (or backward()) on every "
                             f"batch batches() yields, an empty share included, so that a release adds the shares "
                             f"of one Poisson batch")
        indices = getattr(self, "_last_indices", None) if self._tensors is not None else None
        mechanism = self.method.step_mechanism(self.sample_rate, indices)
        if self.accountant is not None:  # one the accountant cannot compute (a sigma set since) is refused before
            self.accountant.step(mechanism, count=0)  # anything is released, not after the update
        try:
            out = self.method.step(self.model, loss_fn, x, y, optimizer, sample_rate=self.sample_rate,
                                   expected_batch_size=self.expected_batch_size, generator=self.generator,
                                   indices=indices, mechanism=mechanism)
        finally:
            if self.method.released:  # the update began (noise, optimizer): the batch is taken and the step counted,
                self._waiting = None  # even if something after the noise raised; a step refused before it (a bad
                if self.accountant is not None:  # loss) leaves its batch waiting
                    self.accountant.step(mechanism)
                if record is not None and self.method.private:  # public pretraining (nonprivate) is not counted
                    record["steps"] += 1
        self.steps += 1
        return out

    def _check_batch(self, x, y) -> None:
        """The epsilon counts one Poisson sample of the data per step: a batch batches() did not yield (the user's
        own loader: a fixed size, a shuffle) or one it yielded taken twice (two noise draws on one sample, or a
        batch split by hand) is not the mechanism the accountant analyses. Refused in one line, before any work.
        x must hold exactly y's examples: an x of other rows (`step(x_train, yb)`) trained every step on x's first
        len(y) rows, released at rate 1 and accounted at q (review 9)."""
        if not (torch.is_tensor(x) and torch.is_tensor(y) and x.dim() > 0 and y.dim() > 0 and len(x) == len(y)):
            shapes = [tuple(t.shape) if torch.is_tensor(t) else type(t).__name__ for t in (x, y)]
            raise DprunError(f"private.step()/backward() takes x and y as tensors of the same examples (first "
                             f"dimensions equal), got x {shapes[0]} and y {shapes[1]}: pass the inputs and labels of "
                             f"the batch private.batches() yielded")
        waiting = getattr(self, "_waiting", None)
        if waiting is None:
            raise DprunError("private.step()/backward() takes each batch private.batches() yields, once; none is "
                             "waiting (the accountant counts one Poisson sample per step): iterate `for x, y in "
                             "private.batches(): private.step(x, y, loss_fn)`; for smaller chunks of a batch use "
                             "make_private(max_physical_batch_size=...)")
        if waiting < 0:
            raise DprunError("private.step()/backward(): the batch private.batches() yielded has no size its tensors "
                             "share (a DataLoader's collate_fn returned no (x, y) of tensors), so the step cannot be "
                             "matched to the Poisson sample the accountant counts; collate to tensors (x, y)")
        if len(y) != waiting:
            raise DprunError(f"private.step()/backward() got a batch of {len(y)} examples, but the batch "
                             f"private.batches() yielded has {waiting}: the accountant counts that Poisson sample; "
                             f"pass the batch as it was yielded (moved to a device is fine)")

    def step(self, x, y, loss_fn: LossFn) -> StepOutput:
        """One private step: per-example clipping, noise on the sum, / expected batch size, optimizer.step().
        Returns the per-example losses, outputs and norms (StepOutput)."""
        return self._run(x, y, loss_fn, self.optimizer)

    def backward(self, x, y, loss_fn: LossFn) -> StepOutput:
        """Like step, without optimizer.step(): each p.grad holds the private gradient; call optimizer.step().
        Nothing may be added to it by autograd before that step (a second loss's backward would be released neither
        clipped nor noised): refused in one line, the gradients dropped. In-place changes (clip_grad_norm_, a
        scale) are post-processing of the noised gradient and pass."""
        if self.method.updates_model:
            raise DprunError(f"method={self.method.name} updates the model itself (no gradient): use step(), not "
                             f"backward()")
        out = self._run(x, y, loss_fn, _NoStep(self.optimizer))
        if self.method.private:
            self._arm()
        return out

    def _arm(self) -> None:
        """Hooks on the trained parameters until optimizer.step() (or the next private step): autograd accumulating
        into a released gradient raises (review 46: a regulariser's backward after private.backward released one
        record at 28,588 C). The hooks exist only in that window, so no check of a later make_private sees them."""
        params = self.method.trainable(self.model)

        def refuse(p: torch.Tensor, grad: torch.Tensor) -> None:
            # a parameter's tensor hook runs before autograd accumulates into p.grad: a gradient still there is the
            # released one (a backward after zero_grad(set_to_none=True) starts from None: not refused, review 51)
            if p.grad is None:
                return
            for q in params:  # the mixed gradient is not released by an optimizer.step() after a caught error
                q.grad = None
            self._disarm()
            raise DprunError("a gradient was added to the private gradient after private.backward() and before "
                             "optimizer.step() (another loss's backward): it would be released neither clipped nor "
                             "noised, so the private gradient is dropped; put every loss on the private batch in "
                             "loss_fn, and step a public-data loss in a step of its own (after "
                             "optimizer.zero_grad(set_to_none=True))")
        def closure_refused(_optimizer, args, kwargs) -> None:
            closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args: (optimizer, *step's own)
            if self._guards and closure is not None:  # review 48: a closure's backward ran
                for q in params:  # after a pre-hook's removal and released its raw gradient (801 C)
                    q.grad = None
                self._disarm()
                raise DprunError("optimizer.step(closure) after private.backward(): the closure's backward would add "
                                 "a gradient neither clipped nor noised to the private one, so the private gradient "
                                 "is dropped; call optimizer.step() without a closure")

        self._guards = [p.register_hook(functools.partial(refuse, p)) for p in params]
        if self._disarm_on_step is None:
            # removed after the step (not before: a closure's backward runs inside it), on the optimizer the user
            # steps too where make_private rebuilt one (review 48: the hooks stayed and refused an evaluation later)
            self._disarm_on_step = [h for opt in dict.fromkeys([self.optimizer, *self._user_optimizers])
                                    for h in (opt.register_step_pre_hook(closure_refused),
                                              opt.register_step_post_hook(lambda *_: self._disarm()))]

    def _disarm(self) -> None:
        for h in self._guards:
            h.remove()
        self._guards = []

    def _check_user_autocast(self, x: torch.Tensor) -> None:
        """The user's own torch.autocast around a private step: the norms the method forms in float32 would run in
        reduced precision without their rounding margin (review 46: multiloss released 1.0038 C under fp32; review
        48: 1.0017 C under precision="bf16", whose own autocast covers the forward and backward only)."""
        devices = {x.device.type, *(p.device.type for p in self.method.trainable(self.model))}  # x moved inside
        if self.method.private and any(torch.is_autocast_enabled(d) for d in devices):
            raise DprunError("private.step()/backward() ran inside torch.autocast: the per-example norms would be "
                             "formed in reduced precision without their rounding margin; call it outside autocast "
                             "and pass precision=\"bf16\" to make_private (its own autocast around the forward and "
                             "backward, certified)")

    def get_epsilon(self, delta: float | None = None) -> float:
        """epsilon(delta) of the steps taken so far (inf for method='nonprivate'); delta defaults to make_private's."""
        delta = self.delta if delta is None else delta
        if delta is None:
            raise DprunError("get_epsilon needs delta (or make_private(..., delta=...))")
        if self.accountant is None:
            if self.method.private:
                raise DprunError("accountant='none': no epsilon is computed for this run")
            return float("inf")  # method='nonprivate': no guarantee
        if self.sampling != self.accountant.assumes_sampling:
            raise DprunError(f"sampling={self.sampling}: no accountant here analyses it, so no epsilon is certified; "
                             f"epsilon_assuming_poisson() gives the Poisson number (not a guarantee)")
        # certified only, as the CLI's `epsilon` column (runner/accountants/published.py): gdp -> its PLD epsilon,
        # hsa -> the composition epsilon
        return self.accountant.certified_epsilon(float(delta))

    epsilon = get_epsilon

    def epsilon_assuming_poisson(self, delta: float | None = None) -> float:
        """What get_epsilon would be had the batches been Poisson-sampled: NOT a guarantee for shuffled batches."""
        if self.accountant is None:
            raise DprunError("no accountant: method='nonprivate' or accountant='none'")
        return self.accountant.certified_epsilon(float(self.delta if delta is None else delta))

    @property
    def privacy_note(self) -> str:
        """Who the guarantee holds against: the seed's secrecy (rng='seeded') or none assumed (rng='secure')."""
        return randomness.guarantee_note(self.rng, None)

    @property
    def private(self) -> bool:
        return self.method.private


def make_private(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 data: tuple[torch.Tensor, torch.Tensor] | TorchDataset | DataLoader, *,
                 method: str = "reweight", noise_multiplier: float | None = None, max_grad_norm: float = 1.0,
                 batch_size: int | None = None, poisson: bool = True, accountant: str = "auto",
                 method_options: dict[str, Any] | None = None, r: int | None = None,
                 target_epsilon: float | None = None, epochs: int | None = None, delta: float | None = 1e-5,
                 generator: torch.Generator | None = None, seed: int | None = None,
                 max_physical_batch_size: int | None = None, precision: str = "fp32",
                 rng: str = "seeded", validate: bool = True, memory_format: str = "auto") -> PrivateTraining:
    """Wrap a model, its optimizer and its training data for DP training with a dprun method.

    method: nonprivate | nxbp | multiloss | reweight | jl | sbcd | opacus (runner/methods/; docs/methods.md)
    noise_multiplier (sigma, default 1.0), max_grad_norm (C): noise N(0, (sigma C)^2 I) on the sum of clipped
        gradients; not with target_epsilon, which sets sigma.
    batch_size: the expected batch size B (sample rate q = B / N); a DataLoader's own batch_size by default.
    poisson: Poisson sampling (what the accountants assume); False shuffles (epsilon is then not a guarantee).
    accountant: auto (the method's own: pld, jl or hsa) | rdp | pld | gdp | jl | hsa.
    method_options: the method's options, as in conf/method/<name>.yaml (e.g. {"mode": "twopass"}); r: JL dimension.
    target_epsilon (with epochs, delta): calibrate noise_multiplier so that epsilon after `epochs` epochs is at most it.
    generator / seed: the RNG for sampling (and noise on the CPU); None draws from torch's global RNG.
    rng: "seeded" (the generators above: replayable, so epsilon assumes the seed is secret) | "secure" (sampling and
        noise from a cryptographic generator keyed by the OS, never stored; no generator=; runner/randomness.py).
    max_physical_batch_size: process each Poisson batch in chunks of at most this many examples (the same step:
        one noise draw and one update per batch; Opacus's BatchMemoryManager without a second loop). None: one pass.
    precision: "fp32" | "bf16" (forward/backward under autocast) | "tf32" (their CUDA matmuls and convolutions with
        TF32 products: method="reweight" bk and nonprivate); norms, clipping, noise in float32 (docs/precision.md).
    torch.distributed: in a program that initialised the default process group, every rank passes the same data
        and seed; each trains on its share of every global Poisson batch, the clipped sums are added over the ranks
        and one noise draw is added (runner/distributed.py). step() takes the rank's share from batches().
        seed=None: rank 0's seed on every rank; ranks holding other data are refused.
    validate: check on the first step what per-example clipping cannot bound (runner/methods/privacy_check/; batch coupling,
        data written by the forward, parameters used outside their module, a loss not of shape (B,)). False (experts)
        skips it with a warning, and private.privacy_notes says the guarantee is unchecked.
    memory_format: "auto" (the model as given, unless it is one of dprun's CNNs measured faster channels-last on the
        CPU: then its conv weights are put in channels-last, in place) | "channels_last" (any CNN: PyTorch's NCHW max
        pooling is several times slower on the CPU; time your model both ways) | "contiguous" (NCHW);
        runner/memory_format.py.
    """
    records = [getattr(m, WRAPPED, None) or LEDGERS.get(m) for m in model.modules()]  # a wrapper (Sequential,
    records += [getattr(p, WRAPPED, None) for p in model.parameters()]  # DataParallel, a new head) or a part of one
    records = [led for led in records if led is not None]  # (review 13); new modules over its Parameters (review 14)
    trained = [led for led in records if led["steps"] > 0]
    record = trained[0] if trained else (records[0] if records else None)
    if trained and method != "nonprivate":  # nonprivate publishes epsilon inf
        raise DprunError(f"this model already trained {record['steps']} private steps through an earlier make_private, "
                         f"whose PrivateTraining accounts them; a second make_private would start another ledger at "
                         f"epsilon 0 with those steps left out: keep stepping the first one (its batches() for each "
                         f"epoch), or build a fresh model")
    seed = privacy_check.shared_seed(seed, generator, distributed.current())  # several ranks: one sampling seed
    if generator is None and seed is not None and randomness.check_rng(rng) == "seeded":
        generator = torch.Generator().manual_seed(randomness.derived_seed(seed, "sampling"))  # apart from the global
    options = api_options(method_options, r)
    sigma = api_sigma(noise_multiplier, target_epsilon)
    check_options("method", method, options)  # a typo in an option name is an error, not a silent default
    world = distributed.current(int(seed or 0))  # the user's own process group, if they initialised one
    generator = randomness.api_generator(rng, generator, world)  # secure: SecureRandom, shared by the ranks
    # review 15: delta=2 was taken and warned about as weak; get_epsilon refused it only later
    if delta is not None and not 0 < _number("delta", delta) < 1:
        raise DprunError(f"delta={delta!r} is not valid: a probability in (0, 1), e.g. 1e-5")
    source = _Source(data, _whole("batch_size", batch_size), generator, world)
    request = Request(method=method, method_options=options, clip=_number("max_grad_norm", max_grad_norm),
                      sigma=sigma,
                      sampling="poisson" if poisson else "shuffle", accountant=accountant,
                      physical_batch_size=max_physical_batch_size, precision=precision, epochs=epochs,
                      memory_format=memory_format,
                      target_epsilon=target_epsilon, delta=delta, names=API_NAMES)
    params_before = [p for g in optimizer.param_groups for p in g["params"]]
    _check_optimizer_in_model(optimizer, params_before, model)
    for p in [*model.parameters(), *params_before]:  # review 26: a gradient left from a non-private backward on a
        p.grad = None  # parameter frozen since was applied by the user's optimizer.step() at every private step
    _check_optimizer_step(optimizer)
    private = assemble(request, model, source.dataset, world, source.sampler)  # runner/assembly.py, as the CLI's
    private.method.privacy_check = bool(validate)  # the first step's check (runner/methods/privacy_check/)
    if source.loader is not None and private.method.private:  # a TensorDataset's records join its probe too, as
        attach_probes(private.method, source.loader.dataset, source.loader.per_example_collate)  # collated
    if source.loader is not None and validate and private.method.private:  # rows built from their example alone
        privacy_check.check_collate(source.loader.dataset, source.loader.per_example_collate, private.method.name)
    records = (source.loader.dataset, source.loader.per_example_collate) if source.loader is not None else None
    privacy_check.check_ranks(world, *(source.tensors or (None, None)), private.sampler, records)  # same data, batches
    training = _training(private, optimizer, params_before, source, delta, generator, rng, validate, world)
    training._record = record if record is not None else {"steps": 0}
    training._record["owner"] = id(training)  # an earlier wrapper of this model (no step taken) is superseded
    for root in (model, training.model):
        object.__setattr__(root, WRAPPED, training._record)  # plain attribute: deepcopy copies it, state_dict not
        for m in root.modules():
            LEDGERS[m] = training._record  # each part too (a submodule trained again alone)
        for p in root.parameters():  # and each weight: new modules holding the same Parameter objects started a
            setattr(p, WRAPPED, training._record)  # second ledger at epsilon 0 (review 14: 60 steps, 30 in each)
    return training


def api_options(method_options: dict | None, r) -> dict:
    """The method's options with r= (the JL dimension, method.r) added; r= and method_options["r"] that disagree are
    refused, as the CLI's r= and method.r= are (review 62: r=4 with {"r": 8} ran r = 4, epsilon inf, silently)."""
    options = dict(method_options or {})
    if r is not None:
        r_ = _whole("r", r)  # review 68: r=4.7 ran r = 4 and r=True r = 1, where the CLI refuses both
        if "r" in options and _number("method_options['r']", options["r"]) != r_:
            raise DprunError(f"r={r!r} and method_options['r']={options['r']!r} disagree: r= is a shorthand for "
                             f"method_options['r']; give one of them")
        options["r"] = r_
    return options


def api_sigma(noise_multiplier, target_epsilon) -> float:
    """The noise multiplier, 1.0 by default; with target_epsilon (which calibrates it) none may be given, as the CLI
    refuses sigma= with target_epsilon= (review 62: noise_multiplier=5.0 was dropped for a calibrated 0.25, unsaid)."""
    if target_epsilon is not None and noise_multiplier is not None:
        raise DprunError(f"noise_multiplier={noise_multiplier!r} and target_epsilon={target_epsilon!r} both set the "
                         f"noise: target_epsilon calibrates noise_multiplier; give one of them")
    return 1.0 if noise_multiplier is None else _number("noise_multiplier", noise_multiplier)


def _number(name: str, value) -> float:
    """float(value), or one line naming the argument (review 15: a bare ValueError for noise_multiplier="abc")."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise DprunError(f"{name}={value!r} is not a number") from None


def _whole(name: str, value) -> int | None:
    """None, or value as a whole number >= 1 (review 15: batch_size=2.5 trained at 2, batch_size=0 said it was
    missing)."""
    if value is None:
        return None
    number = _number(name, value)
    if isinstance(value, bool) or not (math.isfinite(number) and number >= 1 and number == int(number)):
        raise DprunError(f"{name}={value!r} is not valid: a whole number >= 1")
    return int(number)


# Set on a model make_private wrapped, shared by its wrappers (review 9: make_private called in each epoch's loop
# started a new accountant each time: 24 steps released, 8 accounted, epsilon 3.18 published for 4.68).
WRAPPED = "_dprun_make_private"
LEDGERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its ledger, for every part of a model


def _check_optimizer_in_model(optimizer, params: list, model: torch.nn.Module) -> None:
    """Only the model's parameters have clipped, noised gradients: a tensor the optimizer steps that is not one (a
    learnable temperature used in loss_fn) would be trained on its raw gradient, so it is refused here rather than
    dropped from the optimizer (the rebuild in _training) or stepped."""
    own = {id(p) for p in model.parameters()}
    outside = [p for p in params if id(p) not in own and p.requires_grad]
    if outside:
        shapes = [tuple(p.shape) for p in outside[:4]]
        raise DprunError(f"the optimizer holds {len(outside)} tensor(s) that are not parameters of the model (shapes "
                         f"{shapes}): their gradients would be neither clipped nor noised; register them on the model "
                         f"(an nn.Parameter attribute of a module it calls) or give {type(optimizer).__name__} only "
                         f"model.parameters()")


def _check_optimizer_step(optimizer) -> None:
    """An optimizer whose step() requires a closure (torch.optim.LBFGS: it re-evaluates the loss for its line search)
    failed at every private.step (TypeError: missing closure) after the step's mechanism was counted, and a closure
    would compute raw gradients, neither clipped nor noised: refused here, in one line."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError, AttributeError):  # no introspectable step: Method.step's call says what is wrong
        return
    if closure is not None and closure.default is inspect.Parameter.empty and closure.kind is not closure.VAR_KEYWORD:
        raise DprunError(f"{type(optimizer).__name__} cannot be used with make_private: its step(closure) requires a "
                         f"closure that re-evaluates the loss and its gradients on the batch, which would be neither "
                         f"clipped nor noised (and private.step calls optimizer.step() without one); accepted: an "
                         f"optimizer whose step needs no closure (SGD, Adam, AdamW, RMSprop, ...)")


class _Source:
    """make_private's data: (x, y) tensors (batches are index gathers) or a Dataset / DataLoader (Poisson batches
    through poisson_loader); `sampler(kind)` is assemble's make_sampler."""

    def __init__(self, data: Any, batch_size: int | None, generator: torch.Generator | None, world):
        self.batch_size, self.generator, self.world = batch_size, generator, world
        self.loader: DataLoader | None = None
        self.tensors: tuple[torch.Tensor, torch.Tensor] | None = None
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
            if not batch_size:
                raise DprunError("make_private with tensors needs batch_size (the expected batch size)")
            x, y = self.tensors = tuple(data)
            if len(x) != len(y):  # review 15: x of 512 rows with y of 100 trained on x's first 100 rows alone
                raise DprunError(f"data (x, y) must hold the same examples: x has {len(x)} rows, y {len(y)}")
            info = DataInfo("user", tuple(x.shape[1:]), int(y.max().item()) + 1 if y.numel() else 0,
                            train_size=len(y))
            self.dataset = Dataset(info, x, y, x[:0], y[:0], source="user")
        elif isinstance(getattr(data, "dataset", data), IterableDataset):
            raise DprunError(f"data is an IterableDataset ({type(getattr(data, 'dataset', data)).__name__}): Poisson "
                             f"sampling draws records by index, which it has none of; pass a map-style Dataset "
                             f"(__getitem__ and __len__), a DataLoader over one, or (x, y) tensors")
        elif isinstance(data, (TorchDataset, DataLoader)):
            self.data, self.dataset = data, None
        else:
            raise DprunError(f"data must be (x, y) tensors, a torch Dataset or a DataLoader, not {type(data).__name__}")

    def sampler(self, kind: str) -> Sampler:
        if self.tensors is not None:
            y = self.tensors[1]
            gen = self.generator if self.generator is not None else _child_generator()
            return Sampler(kind, len(y), int(self.batch_size), gen, y.device)
        if kind not in ("poisson", "shuffle"):  # a method that needs its own sampling (sbcd: fixed)
            raise DprunError(f"the method needs sampling={kind} (its accountant assumes it): pass in-memory tensors "
                             f"(x, y), not a Dataset or DataLoader")
        self.loader = poisson_loader(self.data, self.batch_size, self.generator)
        batches = self.loader.batch_sampler
        if kind != "poisson":
            batches.sampler = Sampler(kind, len(self.loader.dataset), batches.sampler.batch_size,
                                      batches.sampler.generator)
        batches.world = self.world
        return batches.sampler


def _training(private: PrivateRun, optimizer: torch.optim.Optimizer, params_before: list, source: _Source,
              delta: float | None, generator, rng: str, validate: bool, world) -> PrivateTraining:
    """The PrivateTraining over the assembled run; the optimizer rebuilt if the method trains other tensors."""
    m, model, sampler = private.method, private.model, private.sampler
    given = optimizer  # the user's: it may still be stepped after a rebuild below
    trainable = [p for p in model.parameters() if p.requires_grad]
    if {id(p) for p in trainable} != {id(p) for p in params_before} and not m.updates_model:
        # the method trains different parameter tensors than the optimizer holds: rebuild it on them
        warnings.warn(f"make_private: the optimizer holds {len(params_before)} tensors and the method trains "
                      f"{len(trainable)} (frozen or replaced parameters): private.step() uses a new "
                      f"{type(optimizer).__name__} over the trained ones with the optimizer's defaults (its param "
                      f"groups' own settings and its state are not kept; private.optimizer is it)", stacklevel=3)
        optimizer = type(optimizer)(trainable, **optimizer.defaults)
    if sampler.kind != "poisson" and m.private and not m.sampling:
        warnings.warn("poisson=False: no accountant here analyses shuffled batches; get_epsilon() raises and "
                      "epsilon_assuming_poisson() gives what Poisson sampling would (not a guarantee)", stacklevel=3)
    if hasattr(m, "direction_generator"):  # jl: one set of directions for the whole batch, on every rank (review 20:
        # they came from torch's global RNG, which a program seeding torch per rank sets apart on each rank); seeded
        # from a draw of the global RNG, rank 0's, so N processes equal one
        drawn = privacy_check.shared_seed(None, None, world) if world.size > 1 else \
            int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
        m.direction_generator = randomness.secret_device_generator(model, generator) \
            if randomness.is_secure(generator) else \
            randomness.device_generator(model, randomness.derived_seed(drawn, "jl-directions"))
    noise_gen = randomness.noise_generator(generator, model)
    if noise_gen is None and world.size > 1:
        # torch's global RNG differs between ranks seeded apart (common for augmentation): each rank would add its
        # own draw to the same clipped sum and the models would train on 2 releases of it, 1 accounted (review 7:
        # a CUDA model's noise, with the sampling generator on the CPU). One seed, rank 0's, on every rank.
        noise_gen = randomness.device_generator(model, privacy_check.shared_seed(None, None, world))
    training = PrivateTraining(model, optimizer, m, private.accountant, private.accountant_name,
                               sampler if source.tensors is not None else None, source.loader, source.tensors,
                               sampler.n, int(sampler.batch_size), delta, noise_gen)
    training._user_optimizers = [given]
    training.sampling, training.rng = sampler.kind, rng
    training._collate_checked = not validate  # validate=False skips the first batch's collate check too
    if m.private and not validate:
        training.privacy_notes.append(privacy_check.UNCHECKED.replace("privacy_check=false", "validate=False"))
        warnings.warn(training.privacy_notes[-1], stacklevel=3)
    weak = delta_note(delta, sampler.n) if m.private else None
    if weak:  # the assembly logged it (a WARNING on dprun's logger)
        training.privacy_notes.append(weak)
    if private.target:
        training.planned_epsilon = private.target["planned_epsilon"]
        training.target_epsilon_met = private.target["target_epsilon_met"]
    return training
