"""The training loop, top to bottom: data -> model -> method -> noise -> step -> account -> log.

    from runner.train import train
    summary = train(cfg, out_dir="outputs/runs/x")     # cfg: the composed Hydra config (conf/config.yaml)

Four phases, each a function below: set_up (data, model, method, privacy, optimizer, resume), run_epoch (the
logical steps: Method.step does the chunks, the autocast and the ranks), epoch_row (evaluation, epsilon, the
metrics row) and finish (summary.json). Writes out_dir/metrics.csv (one row per finished epoch) and
out_dir/summary.json (resolved config, versions, device, final metrics). Both are replaced atomically, so an
interrupted run leaves only complete rows. On several ranks (runner/distributed.py) only rank 0 writes, and every
metric is global.
"""
from __future__ import annotations

import copy as _copy
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from runner.epsilon_shown import shown_value
from runner.norms import tensor_cores
from runner import checkpoint, distributed, interrupt, methods, models, randomness, run_lock
from runner.methods import privacy_check
from runner.audit import run as audit_run
from runner.accountants.published import delta_note, epsilon_columns, privacy_notes
from runner.assembly import PrivateRun, Request, assemble
from runner.data import load_dataset
from runner.data.sampler import Sampler
from runner.errors import DprunError
from runner.evaluation import eval_subset, evaluate
from runner.metrics import (StepTimer, device_name, package_versions, peak_memory_bytes, reset_peak_memory,
                            synchronize, write_csv, write_json)
from runner.optimizers import build_optimizer
from runner.methods.compiled import buckets, build_step
from runner.progress import format_eta, progress_bar
from runner.run_dir import ensure_fresh
from runner.validate import validate_config

log = logging.getLogger("dprun")

PROGRESS_EVERY = 20  # steps between progress-bar loss updates and divergence checks (each one syncs the device)


class Diverged(DprunError):
    """A non-finite training loss or parameter: the run ends with status `diverged` (exit 3), its complete epochs
    kept; a sweep over learning rates must not plot it as a result."""


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DprunError(f"device={name} but CUDA is not available here; use device=cpu or device=auto")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise DprunError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N")
    return torch.device(f"cuda:{local_rank}" if name == "cuda" else name)


def norm_columns(norm_log: list[torch.Tensor], clip: float) -> dict[str, float]:
    """log_norms=true: the epoch's per-example gradient norms as the method saw them (estimates for method=jl),
    their quantiles and the share of examples the clip left whole (norm <= C: factor 1, the full gradient)."""
    if not norm_log:
        return {}
    norms = torch.cat(norm_log).cpu()  # (examples seen this epoch,)
    q = torch.quantile(norms, torch.tensor([0.1, 0.5, 0.9]))
    return {"norm_p10": float(q[0]), "norm_median": float(q[1]), "norm_p90": float(q[2]),
            "norm_max": float(norms.max()), "unclipped_frac": float((norms <= clip).float().mean())}


def per_example_cross_entropy(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, y, reduction="none")  # (B,)


@dataclass
class Run:
    """What set_up builds and the phases share."""

    cfg: DictConfig
    out_dir: Path
    world: distributed.World
    device: torch.device
    data: Any
    sampler: Sampler
    steps_per_epoch: int
    model: torch.nn.Module
    method: methods.Method
    accountant: Any
    optimizer: torch.optim.Optimizer
    step_fn: Any
    eval_idx: torch.Tensor | None  # max_eval_batches: a fixed stratified subset of the test set; None: all of it
    summary: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    rows_on_disk: int = 0  # summary.json describes what metrics.csv holds, never an epoch that did not reach it
    start_epoch: int = 0
    noise_rng: Any = None  # rng=secure: the SecureRandom the noise comes from; None: torch's global RNG (seeded)
    published_steps: list = field(default_factory=list)  # the accountant's steps when metrics.csv's last row was written
    # which run summary.json and checkpoint.pt belong to: a resume takes a checkpoint of its own run only (review 42)
    run_id: str = field(default_factory=checkpoint.new_run_id)


@dataclass
class EpochStats:
    """One epoch's training, reduced over the ranks."""

    loss_sum: float  # over the examples whose loss was finite
    correct: int
    seen: int
    finite_losses: int
    nonfinite: int  # records whose loss or gradient norm was not finite: they added nothing (a private diagnostic)
    step_time_s: float
    epoch_time_s: float
    norm_log: list[torch.Tensor] | None


def train(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    validate_config(cfg)  # every knob, before any data is loaded or any file written
    out_dir = Path(out_dir)
    if distributed.launched_rank() != 0 or distributed.current().rank != 0:  # only rank 0 writes the folder (a
        return _train(cfg, out_dir)  # launcher's ranks, or a process group the caller initialised)
    with run_lock.holding(out_dir):  # one writer per folder (runner/run_lock.py; the CLI took it already)
        if not cfg.get("resume"):  # a resumed run continues in its own folder
            ensure_fresh(out_dir)  # before any data is loaded: never replace another run's results
        return _train(cfg, out_dir)


def _train(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    world = distributed.init(str(cfg.device), float(cfg.distributed.timeout_s), int(cfg.seed),
                             str(cfg.distributed.backend))
    completed = False  # every epoch done and recorded: the ranks leave the group together (distributed.leave)
    try:
        try:
            run = set_up(cfg, out_dir, world)
        except checkpoint.RunComplete:  # resume= of a run that has its epochs: its records stay as they are
            return checkpoint.saved_summary(cfg.resume)
        try:
            for epoch in range(run.start_epoch + 1, int(cfg.epochs) + 1):
                stats = run_epoch(run, epoch)
                record_epoch(run, *epoch_row(run, epoch, stats))
            run.summary["status"] = "finished"
        except Diverged as e:
            run.summary.update(status="diverged", error=str(e))
            raise
        except KeyboardInterrupt:
            run.summary["status"] = "interrupted"
            blame_peer(run)  # under torchrun: the SIGTERM that follows another rank's failure
            raise
        except Exception as e:  # e.g. CUDA out of memory: recorded so that reports never mistake it for a running job
            run.summary.update(status="failed", error=f"{type(e).__name__}: {e}".splitlines()[0])
            if distributed.broken_collective(e):  # another rank died first: name it
                blame_peer(run)
            else:  # this rank's own failure: the root cause the others will name
                world.report_failure(run.summary["error"])
            raise
        finally:
            with interrupt.signals_held():  # a second Ctrl-C must not cut the run's last records short
                finish(run)
        completed = True
    finally:
        distributed.shutdown(world, wait=completed)  # a failed rank must not wait for the others
    return run.summary


def blame_peer(run: Run) -> None:
    """On several ranks, when another rank reported a failure (its error in the store), rank 0's summary says so:
    status failed, error 'rank r: ...'; that rank's error caused this one's (a broken collective, or the SIGTERM
    the launcher sends the others)."""
    peer = run.world.peer_failure() if run.world.size > 1 else None
    if peer:
        run.summary.update(status="failed", error=peer)
    elif run.summary.get("status") == "failed":  # a broken collective, no report: the peer was killed
        run.summary["error"] = ("another rank stopped without reporting an error (killed from outside: SIGKILL, the "
                                "OOM killer, a lost node): " + run.summary["error"][:120])


# -- set-up ------------------------------------------------------------------------------------------------------
def set_up(cfg: DictConfig, out_dir: Path, world: distributed.World) -> Run:
    """Data, model, the private run (runner/assembly.py: method, sampler, accountant, sigma calibrated to
    target_epsilon: the same assembly as make_private's), optimizer, step, resume, summary.json."""
    if world.main:
        out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(str(cfg.device), world.local_rank)
    tensor_cores.mode(), tensor_cores.sum_mode()  # a bad DPRUN_TENSOR_CORES(_SUM) is refused before anything runs
    if str(cfg.get("precision", "fp32")) == "tf32" and device.type != "cuda":
        log.warning("precision=tf32 changes nothing on %s (TF32 is a CUDA tensor-core format): the step is fp32",
                    device.type)
    dtype = {"float32": torch.float32, "float64": torch.float64}[str(cfg.dtype)]
    torch.manual_seed(int(cfg.seed))
    data, audit = load_data(cfg, device, dtype, world)
    model, model_kwargs = build_model(cfg, data, device, dtype)  # its initialisation from `seed`, public
    # the sampler's (the same global batches on every rank) and, rng=secure, the noise's (runner/randomness.py). After
    # the model: secure reseeds torch's RNG for JL's directions and dropout, and an initialisation drawn from that
    # secret state (visible through the released model) would be a window onto it (review 40)
    gen = randomness.sampling_generator(str(cfg.get("rng", "seeded")), int(cfg.seed), world)
    private = assemble(request_from(cfg), model, data, world,
                       make_sampler=lambda kind: Sampler(kind, data.info.train_size or len(data.train_y),
                                                         int(cfg.batch_size), gen, device))
    if private.sampler.kind != "poisson" and not private.method.sampling:
        log.warning("sampling=%s: no accountant here analyses it, so `epsilon` stays empty; epsilon_poisson_assumed "
                    "holds only under Poisson sampling (not a guarantee)", private.sampler.kind)
    private.method.privacy_check = bool(cfg.get("privacy_check", True))  # the first step's check (runner/methods/privacy_check/)
    privacy_check.check_ranks(world, data.train_x, data.train_y, private.sampler)  # the same data and batches everywhere
    audit_run.attach(audit, private.method, private.model, private.sampler.sample_rate)  # gradient canaries
    optimizer = build_optimizer(cfg.optimizer, private.model.parameters(), float(cfg.lr))
    eval_idx = eval_subset(data.test_y, int(cfg.eval_batch_size) * int(cfg.max_eval_batches)) \
        if cfg.get("max_eval_batches") else None
    run = Run(cfg, out_dir, world, device, data, private.sampler, private.steps_per_epoch, private.model,
              private.method, private.accountant, optimizer, build_run_step(cfg, private, device, world), eval_idx,
              summary={}, noise_rng=gen if randomness.is_secure(gen) else None)
    # the resolved config, with every model knob's value used (summary.json; a resume must match it)
    run_config = {**OmegaConf.to_container(cfg, resolve=True), "model": {"name": str(cfg.model.name), **model_kwargs}}
    if cfg.get("resume"):
        resume(run, run_config)
    run.summary = start_summary(run, run_config, private)
    publish_state(run)  # a resumed run: its published epochs and steps, kept if it is killed before the next one
    if world.main:
        write_json(out_dir / "summary.json", run.summary)
    return run


def load_data(cfg: DictConfig, device: torch.device, dtype: torch.dtype,
              world: distributed.World | None = None) -> tuple[Any, Any]:
    """The dataset's tensors on the device, loaded once; float features in the run's dtype; and the run's audit
    (audit=one_run: included input canaries join the training set; None otherwise), its draws from a secret seed
    under rng=secure (review 40: from seed + 7919, anyone holding `seed` predicted which canaries joined each step)."""
    data = load_dataset(cfg.dataset, cfg.data_dir, device)
    secret = None
    if cfg.get("audit") is not None and str(cfg.audit.get("name", "none")) != "none" \
            and str(cfg.get("rng", "seeded")) == "secure":
        secret = randomness.shared_secret_seed(randomness.SecureRandom(world or distributed.World(), ahead=False))
    audit = audit_run.begin(cfg, data, secret)
    if data.train_x.is_floating_point():
        data.train_x, data.test_x = data.train_x.to(dtype), data.test_x.to(dtype)
    return data, audit


def build_model(cfg: DictConfig, data: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """The registry's model with its knobs (null -> the builder's default); (model, the knobs' values used)."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model_kwargs = {k: v for k, v in model_cfg.items() if k not in ("name", "kwargs")}
    model_kwargs.update(model_cfg.get("kwargs") or {})  # model=auto: the dataset's knobs for its paper model
    model_kwargs = models.knobs(str(cfg.model.name), **model_kwargs)
    return models.build(str(cfg.model.name), data.info, **model_kwargs).to(device=device, dtype=dtype), model_kwargs


def request_from(cfg: DictConfig) -> Request:
    """The config's privacy knobs in runner/assembly.py's vocabulary."""
    return Request(method=str(cfg.method.name), method_options=cfg.method, clip=float(cfg.clip),
                   sigma=float(cfg.sigma), sampling=str(cfg.sampling), accountant=str(cfg.accountant.name),
                   physical_batch_size=cfg.get("physical_batch_size"), precision=str(cfg.get("precision", "fp32")),
                   memory_format=str(cfg.get("memory_format", "auto")), epochs=int(cfg.epochs),
                   max_steps_per_epoch=cfg.get("max_steps_per_epoch"),
                   target_epsilon=cfg.target_epsilon, delta=float(cfg.delta),
                   calibration_accountant=cfg.get("calibration_accountant"))


def build_run_step(cfg: DictConfig, private: PrivateRun, device: torch.device, world: distributed.World):
    """The step callable for compile= (runner/methods/compiled.py): each chunk padded to physical_batch_size, or
    (one chunk per batch) each rank's share of the Poisson batch to the smallest of a few sizes that holds it."""
    expected = private.sampler.sample_rate * private.sampler.n  # the expected GLOBAL batch size
    physical = cfg.get("physical_batch_size")
    return build_step(private.method, cfg.get("compile", "off"), device,
                      int(physical) if physical else buckets(expected / world.size))


def resume(run: Run, run_config: dict[str, Any]) -> None:
    """resume=<dir> (runner/checkpoint.py): the same batches, noise and epsilon as an uninterrupted run."""
    cfg = run.cfg
    can_checkpoint = checkpoint.supported(run.method)  # None: the model + optimizer hold all of the method's state
    if can_checkpoint:
        raise DprunError(f"resume: {can_checkpoint}")
    checkpoint.check_config(cfg.resume, run_config)
    state = checkpoint.load(cfg.resume)
    run.run_id = checkpoint.check_run_id(cfg.resume, state)  # the same run: another's checkpoint is refused
    # published ahead of the checkpoint (checkpoint=false on an earlier resume): refused, never trained again.
    # The checkpoint is saved before metrics.csv (record_epoch): a signal between the two leaves the csv and
    # summary.json one epoch behind it; that epoch is published here from the checkpoint's rows, never trained again
    behind = checkpoint.check_published(cfg.resume, int(state["epoch"])) < int(state["epoch"])
    checkpoint.check_rows(cfg.resume, state)  # ... and, ids or none, one whose epochs are not the published ones
    if checkpoint.nothing_to_train(cfg.resume, state["epoch"], int(cfg.epochs)) and not behind \
            and checkpoint.finished(cfg.resume):  # refuses fewer; an unfinished run with every epoch: finished here
        raise checkpoint.RunComplete(f"resume={cfg.resume}: the run already has {state['epoch']} epochs")
    run.start_epoch, run.rows = checkpoint.restore(state, model=run.model, optimizer=run.optimizer,
                                                   sampler=run.sampler, method=run.method, accountant=run.accountant)
    if behind and run.world.main:
        write_csv(run.out_dir / "metrics.csv", run.rows)
    run.rows_on_disk = len(run.rows)
    run.world.steps = run.start_epoch * run.steps_per_epoch  # the ranks' forward streams continue where they were
    log.info("resumed %s after epoch %d%s", cfg.resume, run.start_epoch, "; rng=secure: the batches and noise from "
             "here on come from fresh entropy (no random state was saved)" if run.noise_rng is not None else "")


def start_summary(run: Run, run_config: dict[str, Any], private: PrivateRun) -> dict[str, Any]:
    """summary.json as the run starts (status running); finish() completes it."""
    cfg, method, accountant, sampler, data = run.cfg, run.method, run.accountant, run.sampler, run.data
    # bf16 Linears' norms and clipped sums on tensor cores (DPRUN_TENSOR_CORES: auto = compiled steps; 1 = always)
    tensor_cores_route = (tensor_cores.enabled(compiled=str(cfg.get("compile", "off")) != "off")
                          and str(cfg.get("precision", "fp32")) == "bf16" and run.device.type == "cuda")
    return {
        "status": "running",
        "run_id": run.run_id,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),  # UTC; dprun-report sorts by it
        "pid": os.getpid(), "host": run_lock.host(),  # a SIGKILLed run stays `running`: dprun-report checks these
        "config": run_config,
        "method": method.name,
        "sigma": method.sigma if method.private else None,
        **private.target,  # target_epsilon: planned_epsilon, target_epsilon_met
        "accountant": private.accountant_name if method.private else None,
        "accountant_approximate": bool(accountant is not None and accountant.approximate),
        "accountant_certified": bool(accountant is not None and accountant.certified),  # the named accountant's own
        # number; `epsilon` itself is certified whenever it is not empty (runner/accountants/published.py):
        "epsilon_certified": bool(accountant is not None and sampler.kind == accountant.assumes_sampling),
        "privacy_notes": privacy_notes(accountant, sampler.kind, bool(cfg.get("log_norms")), str(cfg.get("rng", "seeded")),
                                       int(cfg.seed)) + list(getattr(data, "privacy_notes", [])) + (
            [] if method.privacy_check or not method.private else [privacy_check.UNCHECKED]) + (
            [weak] if method.private and (weak := delta_note(float(cfg.delta), sampler.n)) else []),
        "data_source": data.source,
        "sampling": sampler.kind,
        "sample_rate": sampler.sample_rate,
        "steps_per_epoch": run.steps_per_epoch,
        "num_parameters": sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        "device": str(run.device),
        "device_name": device_name(run.device),
        "memory_format": private.memory_format,  # the conv activations' layout (memory_format=auto: runner/memory_format.py)
        "tensor_cores": tensor_cores_route,
        "tensor_cores_sum": tensor_cores.sum_mode() if tensor_cores_route else None,  # DPRUN_TENSOR_CORES_SUM
        "world_size": run.world.size,
        "backend": run.world.backend,
        "evaluation": ("the whole test split" if run.eval_idx is None else
                       f"a fixed stratified random subset of {len(run.eval_idx)} of the {len(data.test_y)} test "
                       f"examples (max_eval_batches={cfg.max_eval_batches}; the same subset for every run)"),
        "versions": package_versions(),
        "mechanisms": [],
    }


# -- one epoch ---------------------------------------------------------------------------------------------------
def run_epoch(run: Run, epoch: int) -> EpochStats:
    """The epoch's logical steps; each rank trains on its share of every global Poisson batch."""
    cfg, device, world = run.cfg, run.device, run.world
    reset_peak_memory(device)
    # loss and accuracy stay on the device until the epoch ends: an .item() per step would sync the GPU
    # float64 sums: the same totals whichever rank (or process count) adds them
    step_times, seen = [], 0
    loss_sum, correct = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
    finite_losses, nonfinite = (torch.zeros((), dtype=torch.long, device=device) for _ in range(2))
    counts = []  # per step since the last check: (3,) this rank's [examples, finite losses, finite norms]
    per_step_timing = cfg.get("step_timing", "sync") == "sync"
    norm_log = [] if cfg.get("log_norms", False) and run.method.private else None  # (B,) per step, on device
    expected = run.sampler.sample_rate * run.sampler.n
    epoch_start = time.perf_counter()
    batches = run.sampler.epoch()
    bar = progress_bar(range(run.steps_per_epoch), enabled=bool(cfg.progress) and world.main,
                       desc=f"epoch {epoch}/{cfg.epochs}")
    for step in bar:
        idx = world.share(next(batches))  # (B_t / ranks,) this rank's share of the global batch
        x, y = run.data.train_x[idx], run.data.train_y[idx]
        with StepTimer(device, enabled=per_step_timing) as t:
            out = run.step_fn(run.model, per_example_cross_entropy, x, y, run.optimizer,
                              sample_rate=run.sampler.sample_rate, expected_batch_size=expected, indices=idx,
                              generator=run.noise_rng)
        if per_step_timing and (step >= int(cfg.warmup_steps) or run.steps_per_epoch <= int(cfg.warmup_steps)):
            step_times.append(t.seconds)
        if run.accountant is not None:
            run.accountant.step(out.mechanism)
        losses = out.losses.detach()  # (B,)
        loss_ok, norm_ok = finite_masks(losses, out.norms)  # (B,) each
        loss_sum += torch.where(loss_ok, losses, torch.zeros((), dtype=losses.dtype, device=losses.device)).sum()
        finite_losses += loss_ok.sum()
        nonfinite += (~(loss_ok & norm_ok)).sum()
        seen += len(y)
        # one record that is not finite adds nothing to the release and must not end the run either (its presence
        # would decide the run's outcome): the run has diverged when no example of the global batch is finite
        counts.append(finite_counts(loss_ok, norm_ok))
        if out.outputs is not None:
            correct += (out.outputs.detach().argmax(1) == y).sum()
        if norm_log is not None and out.norms is not None:
            norm_log.append(out.norms.detach().float())
        if step % PROGRESS_EVERY == PROGRESS_EVERY - 1 or step == run.steps_per_epoch - 1:
            check_finite(run, epoch, first_diverged(run.world, counts, step + 1))  # a sync every few steps
            counts = []
            if cfg.progress:
                bar.set_postfix(loss=f"{float(loss_sum) / max(int(finite_losses), 1):.3f}")
    for _ in batches:  # finish the epoch's generator (capped epochs)
        pass
    synchronize(device)
    epoch_time = time.perf_counter() - epoch_start
    check_finite(run, epoch, 0, parameters=True)
    if not per_step_timing:  # step_timing=epoch: no per-step sync; the epoch's mean step time
        step_times = [epoch_time / max(run.steps_per_epoch, 1)]
    loss_total, correct_total, seen_total, finite_total, nonfinite_total = world.sum(
        [float(loss_sum), float(correct), seen, float(finite_losses), float(nonfinite)], device)
    (step_time,) = world.max([statistics.median(step_times) if step_times else float("nan")], device)  # slowest rank
    return EpochStats(loss_total, int(correct_total), int(seen_total), int(finite_total), int(nonfinite_total),
                      step_time, epoch_time, norm_log)


def finite_masks(losses: torch.Tensor, norms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) bool each: the examples whose loss, and whose gradient norm, is finite (norms None, non-private: all)."""
    loss_ok = torch.isfinite(losses)
    return loss_ok, (torch.ones_like(loss_ok) if norms is None else torch.isfinite(norms))


def finite_counts(loss_ok: torch.Tensor, norm_ok: torch.Tensor) -> torch.Tensor:
    """(3,) float64 on the device, no sync: this rank's share of the step: [examples, finite losses, finite gradient
    norms], from finite_masks."""
    return torch.stack([torch.tensor(float(len(loss_ok)), dtype=torch.float64, device=loss_ok.device),
                        loss_ok.sum().double(), norm_ok.sum().double()])


def first_diverged(world, counts: list[torch.Tensor], last_step: int) -> int:
    """The first of the steps `counts` covers (ending at step `last_step`, 1-based) whose GLOBAL batch (summed over
    the ranks: one all_reduce) had examples and none with a finite loss, or none with a finite gradient norm;
    0 if none. Certified clipping drops such records (they contribute nothing, runner/norms/certify.py), so a run
    whose weights blew up would otherwise go on adding noise alone with a finite but meaningless loss. Not one
    record: one that is not finite among finite ones is left out of the sum and the loss, and counted; the global
    batch, not a rank's share, so that one record cannot decide it on a rank whose share is that record."""
    if not counts:
        return 0
    table = torch.stack(counts)  # (k, 3)
    world.all_reduce_([table])
    bad = (table[:, 0] > 0) & ((table[:, 1] == 0) | (table[:, 2] == 0))  # (k,)
    first = int(torch.where(bad, torch.arange(len(bad), device=bad.device), len(bad)).min())  # the one read
    return last_step - len(counts) + 1 + first if first < len(bad) else 0


def check_finite(run: Run, epoch: int, bad_step: int, parameters: bool = False) -> None:
    """Diverged (a one-line DprunError) at step `bad_step` (first_diverged: the same on every rank) or, at the
    epoch's end, if a parameter is not finite on any rank. On every rank at the same steps: a collective."""
    bad_param = parameters and not all(bool(torch.isfinite(p).all()) for p in run.model.parameters())
    (bad_param,) = run.world.max([float(bad_param)], run.device)
    if bad_step > 0 or bad_param:
        where = f"at epoch {epoch}, step {int(bad_step)}" if bad_step > 0 else f"by the end of epoch {epoch}"
        what = "every example's training loss (or gradient)" if bad_step > 0 else "a parameter"
        raise Diverged(f"run diverged: {what} became non-finite (nan/inf) {where} (lr={run.cfg.lr}); the "
                       f"{len(run.rows)} complete epoch(s) before it are kept")


# -- the epoch's row ---------------------------------------------------------------------------------------------
def epoch_row(run: Run, epoch: int, stats: EpochStats) -> tuple[dict[str, Any], dict[str, Any]]:
    """Evaluation, epsilon and the metrics row of a finished epoch (global: reduced over the ranks); (row, the
    accountant's columns)."""
    cfg, world = run.cfg, run.world
    test_loss, test_acc = evaluate(run.model, run.data.test_x, run.data.test_y, int(cfg.eval_batch_size),
                                   run.eval_idx, world, run.device)
    eps = epsilon_columns(run.accountant, float(cfg.delta), run.sampler.kind) if run.accountant is not None else {}
    world.check_replicas(run.model, run.device, f"after epoch {epoch}")
    (peak,) = world.max([peak_memory_bytes(run.device)], run.device)
    return {
        "epoch": epoch,
        "steps": run.steps_per_epoch,
        "train_loss": stats.loss_sum / max(stats.finite_losses, 1),
        "train_acc": stats.correct / max(stats.seen, 1),
        "nonfinite_records": stats.nonfinite,
        "test_loss": test_loss,
        "test_acc": test_acc,
        "epoch_time_s": stats.epoch_time_s,
        "step_time_s": stats.step_time_s,
        "peak_mem_bytes": int(peak),
        "epsilon": "",  # only a certified epsilon, under the sampling used (runner/accountants/published.py)
        **eps,
        **(norm_columns(stats.norm_log, run.method.clip) if stats.norm_log is not None else {}),
    }, eps


def record_epoch(run: Run, row: dict[str, Any], eps: dict[str, Any]) -> None:
    """metrics.csv and the checkpoint (rank 0), then the epoch's log line with the run's ETA."""
    cfg, method = run.cfg, run.method
    run.rows.append(row)
    if run.world.main:
        # the checkpoint first: a signal or a full disk during its save then leaves the epoch unpublished (metrics.csv
        # and summary.json end at the epoch before), so a resume re-running it publishes it once. The other order
        # published epoch k's row, then resumed from epoch k - 1 and, under rng=secure, trained epoch k again with
        # fresh noise: two releases of the epoch, one accounted (stop 55's review)
        if cfg.get("checkpoint", True) and checkpoint.supported(method) is None:
            checkpoint.save(run.out_dir, epoch=row["epoch"], model=run.model, optimizer=run.optimizer,
                            sampler=run.sampler, method=method, accountant=run.accountant, rows=run.rows,
                            run_id=run.run_id)
        else:  # checkpoint=false on a resume: the run's checkpoint would stay at an epoch before the ones published
            # now, and a later resume from it train them again (rng=secure: with fresh noise, a second release)
            (run.out_dir / checkpoint.FILE).unlink(missing_ok=True)
        write_csv(run.out_dir / "metrics.csv", run.rows)
    run.rows_on_disk = len(run.rows)  # a signal during the write above leaves the previous file, and this count
    publish_state(run)
    if run.world.main:  # summary.json follows metrics.csv (replaced atomically: a kill leaves the previous one whole)
        write_json(run.out_dir / "summary.json", run.summary)
    done = [r["epoch_time_s"] for r in run.rows if r["epoch"] > run.start_epoch]
    eta = format_eta(statistics.mean(done) * (int(cfg.epochs) - row["epoch"]))
    no_epsilon = "epsilon=none (accountant=none)" if method.private else "epsilon=none (non-private)"
    eps_text = " ".join(f"{k}={shown_value(k, v)}" if isinstance(v, float) else f"{k}={v or 'none'}"  # '': not certified
                        for k, v in eps.items())
    log.info("epoch %d/%s: train_loss=%.4f test_acc=%.4f epoch_time=%.2fs %s eta=%s", row["epoch"], cfg.epochs,
             row["train_loss"], row["test_acc"], row["epoch_time_s"], eps_text or no_epsilon, eta,
             extra={"epoch_line": True})


# -- the summary -------------------------------------------------------------------------------------------------
def publish_state(run: Run) -> None:
    """What summary.json says of the published epochs (metrics.csv's rows), taken as an epoch is published: their
    count, the last row, and the steps told to the accountant by then (a run stopped mid-epoch describes the epochs
    it published, not the unfinished one's steps; that epoch's model is never written)."""
    summary, accountant, rows = run.summary, run.accountant, run.rows[:run.rows_on_disk]
    if run.cfg.get("resume") or rows:  # a fresh run's summary.json says nothing of epochs until its first one
        summary["epochs_completed"] = len(rows)
        summary["final"] = final_row(rows)
    run.published_steps = checkpoint.accountant_steps(accountant)
    if accountant is not None:
        summary["mechanisms"] = [{"kind": m.kind, **m.__dict__, "steps": n} for m, n in accountant.history.items()]


def final_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's `final`: the last published row, an epsilon with no number (metrics.csv's empty cell: not
    private, no accountant, or no certified epsilon under this sampling) as null, as an infinite one is."""
    return {k: None if k.startswith("epsilon") and v == "" else v for k, v in rows[-1].items()} if rows else {}


def published_accountant(run: Run):
    """The run's accountant as it stood when its last epoch was published: itself, or (a run stopped mid-epoch) a
    copy told only the published steps (the accountants' caches are module-level, keyed by the steps)."""
    accountant = run.accountant
    if accountant is None or checkpoint.accountant_steps(accountant) == run.published_steps:
        return accountant
    copy = _copy.copy(accountant)
    copy.history = type(accountant.history)()
    if hasattr(copy, "sequence"):
        copy.sequence = []
    for m, n in run.published_steps:
        copy.step(m, count=n)
    return copy


def publish_saved_epoch(run: Run) -> None:
    """A run that stops inside record_epoch after the epoch's checkpoint was saved and before metrics.csv and
    rows_on_disk took it (a signal, a failed write) publishes that epoch now: checkpoint.pt holds the run's model,
    and summary.json must not describe fewer steps than it took (review 38: a SIGTERM there left epsilon 1.171
    published for 3 steps beside a 6-step model, which needs 1.349). The checkpoint on disk decides (mapped, not
    read: a cheap look at its epoch), so a save that did not complete publishes nothing. No step was taken after the
    save (the next epoch starts only once record_epoch returns), so the accountant holds exactly the saved steps."""
    if not run.world.main or run.rows_on_disk >= len(run.rows) or not (run.out_dir / checkpoint.FILE).is_file():
        return
    try:
        saved_epoch = int(checkpoint.load(run.out_dir, mmap=True)["epoch"])
    except DprunError:  # damaged: it holds no epoch to publish
        return
    upto = sum(1 for r in run.rows if r["epoch"] <= saved_epoch)
    if upto <= run.rows_on_disk:
        return
    try:
        write_csv(run.out_dir / "metrics.csv", run.rows[:upto])
    except OSError as e:  # a full disk: the run's own error says why it ended; this says what the folder holds
        log.error("%s holds epoch %d, which metrics.csv and summary.json could not publish (%s): its epsilon is "
                  "the checkpoint's accountant's, not summary.json's", checkpoint.FILE, saved_epoch, e)
        return
    run.rows_on_disk = upto
    publish_state(run)
    log.warning("the run stopped after epoch %d's checkpoint was saved: that epoch is published with it "
                "(metrics.csv, summary.json)", saved_epoch)


def finish(run: Run) -> None:
    """summary.json's final state (rank 0): status, the last complete epoch and the mechanisms told to the accountant
    by its end (publish_state). Replaced atomically: a full disk leaves the previous summary.json (status running,
    whole) and the error propagates; a partial file would lose the run's config (no resume, no report)."""
    audit_run.finish(run)  # audit=one_run: summary["audit"], claimed vs audited epsilon
    publish_saved_epoch(run)
    summary, rows = run.summary, run.rows[:run.rows_on_disk]
    summary["epochs_completed"], summary["final"] = len(rows), final_row(rows)
    if rows and rows[-1]["epsilon"] == float("inf") and run.accountant is not None:
        accountant, delta = published_accountant(run), float(run.cfg.delta)
        if hasattr(accountant, "epsilon_lower_bound"):
            summary["epsilon_lower_bound"] = accountant.epsilon_lower_bound(delta)  # docs/privacy.md
        summary["epsilon_note"] = accountant.why_infinite(delta)  # the CLI prints it: why inf (sigma = 0; JL's
        # tail, and which r would give a number)
    if not run.world.main:
        return
    path = run.out_dir / "summary.json"
    try:
        write_json(path, run.summary)
    except OSError as e:  # the one line and dprun.log name both: this write, and why the run ended
        ended = run.summary.get("status")
        raise OSError(e.errno, f"{e.strerror or e}: {path} was not rewritten (its earlier version stays whole, "
                               f"status running); the run ended {ended}" +
                      (f": {run.summary['error']}" if run.summary.get("error") else "")) from e
