"""The training loop, top to bottom: data -> model -> method -> noise -> step -> account -> log.

    from runner.train import train
    summary = train(cfg, out_dir="outputs/runs/x")     # cfg: the composed Hydra config (conf/config.yaml)

Writes out_dir/metrics.csv (one row per finished epoch) and out_dir/summary.json (resolved config, versions,
device, final metrics). Both are replaced atomically, so an interrupted run leaves only complete rows.
"""
from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from runner import accountants, checkpoint, methods, models
from runner.accountants.published import epsilon_columns, privacy_notes
from runner.data import load_dataset
from runner.data.sampler import Sampler
from runner.errors import DprunError
from runner.metrics import (StepTimer, device_name, package_versions, peak_memory_bytes, reset_peak_memory,
                            synchronize, write_csv, write_json, write_json_last_resort)
from runner.optimizers import build_optimizer
from runner.methods.compiled import build_step, physical_batch
from runner.progress import format_eta, progress_bar
from runner.run_dir import ensure_fresh
from runner.validate import validate_config

log = logging.getLogger("dprun")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DprunError(f"device={name} but CUDA is not available here; use device=cpu or device=auto")
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise DprunError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N")
    return torch.device(name)


PROGRESS_EVERY = 20  # steps between progress-bar loss updates (each one reads the loss back from the device)


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


@torch.no_grad()
def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int,
             max_batches: int | None = None) -> tuple[float, float]:
    """Mean loss and accuracy over (x, y), in eval mode; max_batches: only the first batches (timing runs)."""
    if max_batches:
        x, y = x[:batch_size * int(max_batches)], y[:batch_size * int(max_batches)]
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(y), batch_size):
        out = model(x[i:i + batch_size])
        loss += F.cross_entropy(out, y[i:i + batch_size], reduction="sum").item()
        correct += (out.argmax(1) == y[i:i + batch_size]).sum().item()
    model.train()
    return loss / max(1, len(y)), correct / max(1, len(y))


def train(cfg: DictConfig, out_dir: str | Path) -> dict[str, Any]:
    validate_config(cfg)  # every knob, before any data is loaded or any file written
    out_dir = Path(out_dir)
    if not cfg.get("resume"):  # a resumed run continues in its own folder (runner/checkpoint.py checks it)
        ensure_fresh(out_dir)  # before any data is loaded: never replace another run's results
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(str(cfg.device))
    dtype = {"float32": torch.float32, "float64": torch.float64}[str(cfg.dtype)]
    torch.manual_seed(int(cfg.seed))
    gen = torch.Generator().manual_seed(int(cfg.seed))

    # data: tensors on the device, loaded once
    data = load_dataset(cfg.dataset, cfg.data_dir, device)
    if data.train_x.is_floating_point():
        data.train_x, data.test_x = data.train_x.to(dtype), data.test_x.to(dtype)
    required = methods.METHODS.get(str(cfg.method.name)).sampling  # e.g. sbcd: fixed disjoint batches
    sampling = required or str(cfg.sampling)
    sampler = Sampler(sampling, data.info.train_size or len(data.train_y), int(cfg.batch_size), gen, device)
    if required and required != str(cfg.sampling):
        log.info("method=%s needs sampling=%s (its accountant assumes it); using it", cfg.method.name, required)
    if sampler.kind != "poisson" and not required:
        log.warning("sampling=%s: no accountant here analyses it, so `epsilon` stays empty; epsilon_poisson_assumed "
                    "holds only under Poisson sampling (not a guarantee)", sampler.kind)
    steps_per_epoch = sampler.steps_per_epoch
    if cfg.max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, int(cfg.max_steps_per_epoch))

    # model and method
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    model_kwargs = {k: v for k, v in model_cfg.items() if k not in ("name", "kwargs")}
    model_kwargs.update(model_cfg.get("kwargs") or {})  # model=auto: the dataset's knobs for its paper model
    model_kwargs = models.knobs(str(cfg.model.name), **model_kwargs)  # null -> the builder's default
    model = models.build(str(cfg.model.name), data.info, **model_kwargs).to(device=device, dtype=dtype)
    method = methods.build(cfg)
    model = method.attach(model, data)  # validates (BatchNorm refused, norm-rule coverage) and prepares

    # privacy: accountant and (optionally) sigma calibrated to a target epsilon
    accountant_name = accountants.resolve_name(str(cfg.accountant.name), method)
    accountant = accountants.build(accountant_name) if method.private else None
    total_steps = steps_per_epoch * int(cfg.epochs)
    if cfg.target_epsilon is not None:
        if not method.private:
            raise DprunError("target_epsilon is set but method=nonprivate has no privacy to calibrate")
        if accountant is not None and sampler.kind != accountant.assumes_sampling:
            raise DprunError(f"target_epsilon needs sampling={accountant.assumes_sampling}: no accountant here "
                             f"analyses sampling={sampler.kind}, so no epsilon could be certified")
        calibrator = accountants.calibration_accountant(accountant_name, cfg.get("calibration_accountant"))
        method.sigma = accountants.calibrate_sigma(calibrator, method.mechanism, sampler.sample_rate,
                                                   total_steps, float(cfg.target_epsilon), float(cfg.delta))
        log.info("calibrated sigma=%.4f for epsilon=%s at delta=%s (accountant=%s)", method.sigma,
                 cfg.target_epsilon, cfg.delta, calibrator)
        target = accountants.check_target(accountant_name, calibrator, method.mechanism(sampler.sample_rate),  # met?
                                          total_steps, float(cfg.target_epsilon), float(cfg.delta))
    if accountant is not None:
        accountants.check_for_method(accountant, method, sampler.sample_rate)  # before training

    optimizer = build_optimizer(cfg.optimizer, model.parameters(), float(cfg.lr))
    step_fn = build_step(method, cfg.get("compile", "off"), device,  # compile=...: runner/methods/compiled.py
                         physical_batch(sampler.sample_rate * sampler.n))
    loss_fn = per_example_cross_entropy
    rows: list[dict[str, Any]] = []
    rows_on_disk = 0  # summary.json describes what metrics.csv holds, never an epoch that did not reach it
    start_epoch = 0
    # the resolved config, with every model knob's value used (summary.json; a resume must match it)
    run_config = {**OmegaConf.to_container(cfg, resolve=True), "model": {"name": str(cfg.model.name), **model_kwargs}}
    can_checkpoint = checkpoint.supported(method)  # None: the model + optimizer hold all of the method's state
    if cfg.get("resume"):  # runner/checkpoint.py: same batches, noise and epsilon as an uninterrupted run
        if can_checkpoint:
            raise DprunError(f"resume: {can_checkpoint}")
        checkpoint.check_config(cfg.resume, run_config)
        start_epoch, rows = checkpoint.restore(checkpoint.load(cfg.resume), model=model, optimizer=optimizer,
                                               sampler=sampler, method=method, accountant=accountant)
        rows_on_disk = len(rows)
        log.info("resumed %s after epoch %d", cfg.resume, start_epoch)
    summary: dict[str, Any] = {
        "status": "running",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),  # UTC; dprun-report sorts by it
        "config": run_config,
        "method": method.name,
        "sigma": method.sigma if method.private else None,
        **(target if cfg.target_epsilon is not None else {}),  # planned_epsilon, target_epsilon_met
        "accountant": accountant_name if method.private else None,
        "accountant_approximate": bool(accountant is not None and accountant.approximate),
        "accountant_certified": bool(accountant is not None and accountant.certified),  # the named accountant's own
        # number; `epsilon` itself is certified whenever it is not empty (runner/accountants/published.py):
        "epsilon_certified": bool(accountant is not None and sampler.kind == accountant.assumes_sampling),
        "privacy_notes": privacy_notes(accountant, sampler.kind) + list(getattr(data, "privacy_notes", [])),
        "data_source": data.source,
        "sampling": sampler.kind,
        "sample_rate": sampler.sample_rate,
        "steps_per_epoch": steps_per_epoch,
        "num_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "device": str(device),
        "device_name": device_name(device),
        "versions": package_versions(),
        "mechanisms": [],
    }
    write_json(out_dir / "summary.json", summary)

    model.train()
    try:
        for epoch in range(start_epoch + 1, int(cfg.epochs) + 1):
            reset_peak_memory(device)
            # loss and accuracy stay on the device until the epoch ends: an .item() per step would sync the GPU
            step_times, loss_sum, correct, seen = [], torch.zeros((), device=device), torch.zeros((), device=device), 0
            per_step_timing = cfg.get("step_timing", "sync") == "sync"
            norm_log = [] if cfg.get("log_norms", False) and method.private else None  # (B,) per step, on device
            epoch_start = time.perf_counter()
            batches = sampler.epoch()
            bar = progress_bar(range(steps_per_epoch), enabled=bool(cfg.progress), desc=f"epoch {epoch}/{cfg.epochs}")
            for step in bar:
                idx = next(batches)
                x, y = data.train_x[idx], data.train_y[idx]
                with StepTimer(device, enabled=per_step_timing) as t:
                    out = step_fn(model, loss_fn, x, y, optimizer, sample_rate=sampler.sample_rate,
                                  expected_batch_size=sampler.sample_rate * sampler.n, indices=idx)
                if per_step_timing and (step >= int(cfg.warmup_steps) or steps_per_epoch <= int(cfg.warmup_steps)):
                    step_times.append(t.seconds)
                if accountant is not None:
                    accountant.step(out.mechanism)
                loss_sum += out.losses.detach().sum()
                seen += len(y)
                if out.outputs is not None:
                    correct += (out.outputs.detach().argmax(1) == y).sum()
                if norm_log is not None and out.norms is not None:
                    norm_log.append(out.norms.detach().float())
                if cfg.progress and (step % PROGRESS_EVERY == 0 or step == steps_per_epoch - 1):
                    bar.set_postfix(loss=f"{float(loss_sum) / max(seen, 1):.3f}")  # a sync, every few steps only
            for _ in batches:  # finish the epoch's generator (capped epochs)
                pass
            synchronize(device)
            if not per_step_timing:  # step_timing=epoch: no per-step sync; the epoch's mean step time
                step_times = [(time.perf_counter() - epoch_start) / max(steps_per_epoch, 1)]
            loss_sum, correct = float(loss_sum), int(correct)
            epoch_time = time.perf_counter() - epoch_start
            test_loss, test_acc = evaluate(model, data.test_x, data.test_y, int(cfg.eval_batch_size),
                                           cfg.get("max_eval_batches"))
            eps = epsilon_columns(accountant, float(cfg.delta), sampler.kind) if accountant is not None else {}
            rows.append({
                "epoch": epoch,
                "steps": steps_per_epoch,
                "train_loss": loss_sum / max(seen, 1),
                "train_acc": correct / max(seen, 1),
                "test_loss": test_loss,
                "test_acc": test_acc,
                "epoch_time_s": epoch_time,
                "step_time_s": statistics.median(step_times) if step_times else float("nan"),
                "peak_mem_bytes": peak_memory_bytes(device),
                "epsilon": "",  # only a certified epsilon, under the sampling used (runner/accountants/published.py)
                **eps,
                **(norm_columns(norm_log, method.clip) if norm_log is not None else {}),
            })
            write_csv(out_dir / "metrics.csv", rows)
            rows_on_disk = len(rows)  # a signal during the write above leaves the previous file, and this count
            if cfg.get("checkpoint", True) and can_checkpoint is None:
                checkpoint.save(out_dir, epoch=epoch, model=model, optimizer=optimizer, sampler=sampler, method=method,
                                accountant=accountant, rows=rows)
            done = [r["epoch_time_s"] for r in rows if r["epoch"] > start_epoch]
            eta = format_eta(statistics.mean(done) * (int(cfg.epochs) - epoch))
            no_epsilon = "epsilon=none (accountant=none)" if method.private else "epsilon=none (non-private)"
            eps_text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v or 'none'}"  # '': not certified
                                for k, v in eps.items())
            log.info("epoch %d/%s: train_loss=%.4f test_acc=%.4f epoch_time=%.2fs %s eta=%s", epoch, cfg.epochs,
                     rows[-1]["train_loss"], test_acc, epoch_time, eps_text or no_epsilon, eta,
                     extra={"epoch_line": True})
        summary["status"] = "finished"
    except KeyboardInterrupt:
        summary["status"] = "interrupted"
        raise
    except Exception as e:  # e.g. CUDA out of memory: recorded so that reports never mistake it for a running job
        summary["status"] = "failed"
        summary["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        raise
    finally:
        if accountant is not None:
            summary["mechanisms"] = [{"kind": m.kind, **m.__dict__, "steps": n} for m, n in accountant.history.items()]
        rows = rows[:rows_on_disk]
        summary["final"] = rows[-1] if rows else {}
        if rows and rows[-1]["epsilon"] == float("inf") and hasattr(accountant, "epsilon_lower_bound"):
            summary["epsilon_lower_bound"] = accountant.epsilon_lower_bound(float(cfg.delta))  # docs/privacy.md
        summary["epochs_completed"] = len(rows)
        write_json_last_resort(out_dir / "summary.json", summary)  # a full disk must not leave `running`
    return summary
