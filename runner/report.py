"""`dprun-report`: every run under outputs/ -> one pandas table (CSV) and a readable summary, one row per run.

    dprun -m method=nonprivate,reweight,jl r=1,4 dataset=digits epochs=2
    dprun-report                                   # all runs: prints one row per run, writes outputs/tables/runs.csv
    dprun-report --experiment jl_table2            # only the runs of one preset (experiment_name)
    dprun-report --scale smoke --epochs            # the per-epoch long table (one row per run and epoch)
    dprun-report --root /scratch/outputs --out all.csv

A run is any folder holding summary.json (runner/train.py writes it first, then metrics.csv after each epoch):
single runs under outputs/runs/**, sweeps under outputs/multirun/**. Columns: the configuration (dataset, model,
method, r, batch_size, sigma, clip, lr, epochs, seed, sampling, data source, device, torch version, experiment,
scale), then the final epoch's metrics and `epoch_time_est_s`: the seconds a full (uncapped) epoch takes, from the
median step time times the expected steps per epoch, so capped smoke runs give comparable seconds per epoch.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from runner.errors import DprunError

# (column, path into summary.json's resolved config)
CONFIG_COLUMNS = [
    ("experiment", "experiment_name"), ("scale", "scale"), ("dataset", "dataset.name"), ("like", "dataset.like"),
    ("image_size", "dataset.image_size"), ("model", "model.name"), ("depth", "model.depth"),
    ("method", "method.name"), ("r", "r"), ("batch_size", "batch_size"), ("sigma", "sigma"), ("clip", "clip"),
    ("lr", "lr"), ("optimizer", "optimizer.name"), ("epochs", "epochs"), ("seed", "seed"),
    ("max_steps_per_epoch", "max_steps_per_epoch"), ("delta", "delta"),
]
METRIC_COLUMNS = ["test_acc", "test_loss", "train_loss", "train_acc", "epsilon", "epoch_time_s", "step_time_s",
                  "peak_mem_bytes"]
SUMMARY_VIEW = ["experiment", "scale", "dataset", "model", "method", "method_options", "r", "batch_size", "sigma",
                "epochs", "status", "test_acc", "epsilon", "delta", "epoch_time_est_s", "device"]
# the columns that identify "the same run" when a preset was run twice (latest() keeps the newest)
RUN_KEY = ["experiment", "scale", "dataset", "like", "image_size", "model", "depth", "method", "r", "batch_size",
           "sigma", "clip", "lr", "optimizer", "epochs", "seed", "max_steps_per_epoch", "device"]


def dig(cfg: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def find_runs(root: str | Path) -> list[Path]:
    """Folders under root holding a summary.json, sorted."""
    root = Path(root)
    if not root.is_dir():
        raise DprunError(f"no outputs folder {str(root)!r}; run dprun first or pass --root")
    return sorted(p.parent for p in root.rglob("summary.json"))


def read_run(run_dir: Path) -> tuple[dict[str, Any], pd.DataFrame]:
    """(one summary row, the per-epoch metrics table) of one run folder."""
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = summary.get("config", {})
    row: dict[str, Any] = {name: dig(cfg, path) for name, path in CONFIG_COLUMNS}
    versions = summary.get("versions", {})
    row["sigma_configured"] = row["sigma"]
    if "sigma" in summary:  # the sigma the run used: calibrated to target_epsilon; None if not private
        row["sigma"] = summary["sigma"]
        if summary["sigma"] is None:
            row["delta"] = None
    method_cfg = cfg.get("method") if isinstance(cfg.get("method"), dict) else {}
    row["method_options"] = ",".join(f"{k}={v}" for k, v in sorted(method_cfg.items())
                                     if k != "name" and v is not None and not isinstance(v, (dict, list))) or None
    row.update({
        "epsilon_lower_bound": summary.get("epsilon_lower_bound"),
        "status": summary.get("status"),
        "epochs_completed": summary.get("epochs_completed", 0),
        "data_source": summary.get("data_source"),
        "sampling": summary.get("sampling"),
        "sample_rate": summary.get("sample_rate"),
        "steps_per_epoch": summary.get("steps_per_epoch"),
        "num_parameters": summary.get("num_parameters"),
        "accountant": summary.get("accountant"),
        "noise_sigma": summary.get("sigma"),
        "device": summary.get("device"),
        "device_name": summary.get("device_name"),
        "torch_version": versions.get("torch"),
        "dprun_version": versions.get("dprun"),
        "run_dir": str(run_dir),
        "finished_at": datetime.fromtimestamp((run_dir / "summary.json").stat().st_mtime, timezone.utc)
        .isoformat(timespec="seconds"),  # UTC, so the strings sort in time order
    })
    metrics_path = run_dir / "metrics.csv"
    epochs = pd.read_csv(metrics_path) if metrics_path.exists() and metrics_path.stat().st_size else pd.DataFrame()
    if "epsilon" in epochs:
        epochs["epsilon"] = pd.to_numeric(epochs["epsilon"], errors="coerce")
    last = epochs.iloc[-1] if len(epochs) else {}
    for col in METRIC_COLUMNS:
        row[col] = last.get(col, math.nan) if len(epochs) else math.nan
    if len(epochs) and "epoch_time_s" in epochs:
        row["total_time_s"] = float(epochs["epoch_time_s"].sum())
        row["mean_epoch_time_s"] = float(epochs["epoch_time_s"].mean())
    if len(epochs) and "step_time_s" in epochs:
        step = float(epochs["step_time_s"].median())
        full_steps = 1.0 / row["sample_rate"] if row.get("sample_rate") else row.get("steps_per_epoch") or math.nan
        row["epoch_time_est_s"] = step * full_steps
    return row, epochs


def collect(root: str | Path = "outputs", experiment: str | None = None, scale: str | None = None,
            per_epoch: bool = False) -> pd.DataFrame:
    """All runs under root as one table: one row per run, or (per_epoch) one row per run and epoch."""
    frames, rows = [], []
    for run_dir in find_runs(root):
        try:
            row, epochs = read_run(run_dir)
        except (json.JSONDecodeError, pd.errors.ParserError, OSError) as e:
            print(f"dprun-report: skipping unreadable run {run_dir}: {e}", file=sys.stderr)
            continue
        if experiment is not None and row["experiment"] != experiment:
            continue
        if scale is not None and row["scale"] != scale:
            continue
        rows.append(row)
        if per_epoch and len(epochs):
            frames.append(epochs.assign(**{k: v for k, v in row.items() if k not in epochs}))
    if per_epoch:
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return pd.DataFrame(rows)


def latest(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: the newest finished run where a preset was run more than once."""
    if runs.empty:
        return runs
    done = runs[runs["status"] == "finished"]
    keys = [k for k in RUN_KEY if k in done]
    done = done.sort_values("finished_at")
    return done.groupby(keys, dropna=False, sort=False).tail(1).reset_index(drop=True)


def summary_view(runs: pd.DataFrame) -> str:
    cols = [c for c in SUMMARY_VIEW if c in runs]
    view = runs[cols].copy()
    if "epsilon" in view:
        view["epsilon"] = view["epsilon"].map(lambda v: "" if pd.isna(v) else f"{v:.3g}")
    return view.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dprun-report", description=__doc__.splitlines()[0])
    p.add_argument("--root", default="outputs", help="folder searched for run folders (default: outputs)")
    p.add_argument("--experiment", help="keep only runs with this experiment_name (a preset's name)")
    p.add_argument("--scale", choices=["smoke", "paper"], help="keep only runs of this scale")
    p.add_argument("--epochs", action="store_true", help="the per-epoch long table instead of one row per run")
    p.add_argument("--out", help="CSV to write (default: <root>/tables/runs.csv, or runs_<experiment>.csv)")
    p.add_argument("--quiet", action="store_true", help="write the CSV, print only its path")
    args = p.parse_args(argv)
    try:
        table = collect(args.root, args.experiment, args.scale, per_epoch=args.epochs)
    except DprunError as e:
        print(f"dprun-report: {e}", file=sys.stderr)
        return 2
    name = "runs" + (f"_{args.experiment}" if args.experiment else "") + ("_epochs" if args.epochs else "")
    out = Path(args.out or Path(args.root) / "tables" / f"{name}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    if table.empty:
        print(f"dprun-report: no runs under {args.root}" + (f" with experiment={args.experiment}" if args.experiment
                                                          else "") + f"; wrote an empty {out}")
        return 0
    if not args.quiet:
        print(table.to_string(index=False, max_colwidth=24) if args.epochs else summary_view(table))
    n = table["run_dir"].nunique()
    infinite = table[pd.to_numeric(table.get("epsilon"), errors="coerce") == math.inf] if "epsilon" in table else []
    if len(infinite):
        bound = pd.to_numeric(infinite.get("epsilon_lower_bound"), errors="coerce").dropna()
        print(f"dprun-report: {infinite['run_dir'].nunique()} runs have epsilon=inf: no finite guarantee at their "
              "delta (JL with small r: the heavy tail of Z_r)" + (f"; certified lower bounds up to {bound.max():.3g} "
              "in column epsilon_lower_bound" if len(bound) else "") + ". See docs/privacy.md")
    print(f"dprun-report: {n} runs, {len(table)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
