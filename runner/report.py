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
A folder holding only Hydra's .hydra/ is a run that stopped before its first summary.json: a row with status
`failed-to-start` and the configuration Hydra recorded. A run whose files cannot be read is skipped with one line
on stderr; the runs that did not finish are listed after the table.
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
from runner.run_dir import unstarted_runs

# (column, path into summary.json's resolved config)
CONFIG_COLUMNS = [
    ("experiment", "experiment_name"), ("scale", "scale"), ("dataset", "dataset.name"), ("like", "dataset.like"),
    ("image_size", "dataset.image_size"), ("model", "model.name"), ("depth", "model.depth"),
    ("method", "method.name"), ("r", "method.r"), ("batch_size", "batch_size"), ("sigma", "sigma"), ("clip", "clip"),
    ("lr", "lr"), ("optimizer", "optimizer.name"), ("epochs", "epochs"), ("seed", "seed"),
    ("max_steps_per_epoch", "max_steps_per_epoch"), ("delta", "delta"),
]
# epsilon: certified, or empty; the labelled epsilon_*_approx/_assumed columns are NOT guarantees
# (runner/accountants/published.py); epsilon_lower_bound: certified lower bound where epsilon is inf
METRIC_COLUMNS = ["test_acc", "test_loss", "train_loss", "train_acc", "epsilon", "epsilon_lower_bound",
                  "epsilon_gdp_approx", "epsilon_hsa_assumed", "epsilon_poisson_assumed", "epoch_time_s",
                  "step_time_s", "peak_mem_bytes"]
SUMMARY_VIEW = ["experiment", "scale", "dataset", "model", "method", "method_options", "batch_size", "sigma", "epochs",
                "sampling", "status", "test_acc", "epsilon", "epsilon_gdp_approx", "epsilon_hsa_assumed",
                "epsilon_poisson_assumed", "delta", "epoch_time_est_s", "device"]
FAILED_TO_START = "failed-to-start"  # status of a folder holding only Hydra's .hydra/ record
# the columns that identify "the same run" when a preset was run twice (latest() keeps the newest): the whole
# resolved config (config_key) and the device; the named columns are functions of them, and stand in for
# config_key in tables written before it existed
RUN_KEY = ["config_key", "experiment", "scale", "dataset", "like", "image_size", "model", "depth", "method", "r",
           "batch_size", "sigma", "clip", "lr", "optimizer", "epochs", "seed", "max_steps_per_epoch", "device"]
NOT_IN_KEY = ("data_dir", "out_dir", "progress")  # where files live and how the run looks: not what it computes


def dig(cfg: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def flatten(cfg: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_key(cfg: dict) -> str:
    """The resolved config as one canonical string (every option: method.*, accountant, sampling, dtype, ...)."""
    flat = {k: v for k, v in flatten(cfg).items() if k not in NOT_IN_KEY}
    return json.dumps(flat, sort_keys=True, default=str)


def find_runs(root: str | Path) -> list[Path]:
    """Folders under root holding a summary.json, sorted."""
    root = Path(root)
    if not root.is_dir():
        raise DprunError(f"no outputs folder {str(root)!r}; run dprun first or pass --root")
    return sorted(p.parent for p in root.rglob("summary.json"))


def read_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json as a dict; ValueError (naming what is wrong) for anything else: [], null, binary, bad JSON.
    Old summaries with a bare Infinity still load (Python's json accepts it)."""
    summary = json.loads((run_dir / "summary.json").read_bytes().decode("utf-8"))
    if not isinstance(summary, dict):
        kind = "null" if summary is None else f"a {type(summary).__name__}"
        raise ValueError(f"summary.json holds {kind}, not a JSON object")
    return summary


def read_metrics(run_dir: Path) -> pd.DataFrame:
    """metrics.csv (empty table if the run has none yet); ValueError if it is empty, binary or not numeric."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return pd.DataFrame()  # a run that ended (or is still) before its first epoch
    epochs = pd.read_csv(path, encoding="utf-8")  # EmptyDataError, ParserError, UnicodeDecodeError: ValueErrors
    if epochs.empty:
        return epochs  # a header and no rows
    for col in ("epoch", "epoch_time_s", "step_time_s"):
        if col not in epochs or not pd.api.types.is_numeric_dtype(epochs[col]):
            raise ValueError(f"metrics.csv has no numeric {col!r} column")
    for col in [c for c in epochs.columns if str(c).startswith("epsilon")]:  # epsilon, its bound, labelled ones
        epochs[col] = pd.to_numeric(epochs[col], errors="coerce")
    return epochs


def read_run(run_dir: Path) -> tuple[dict[str, Any], pd.DataFrame]:
    """(one summary row, the per-epoch metrics table) of one run folder."""
    summary = read_summary(run_dir)
    cfg = summary.get("config") if isinstance(summary.get("config"), dict) else {}
    row: dict[str, Any] = {name: dig(cfg, path) for name, path in CONFIG_COLUMNS}
    if row["r"] is None:
        row["r"] = dig(cfg, "r")  # runs before r moved into method=jl's config
    method = cfg.get("method") if isinstance(cfg.get("method"), dict) else {}
    row["method_options"] = " ".join(f"{k}={v}" for k, v in method.items() if k != "name")  # e.g. mode=bk norm=auto
    row["config_key"] = config_key(cfg)
    versions = summary.get("versions") if isinstance(summary.get("versions"), dict) else {}
    row["sigma_configured"] = row["sigma"]
    if "sigma" in summary:  # the sigma the run used: calibrated to target_epsilon; None if not private
        row["sigma"] = summary["sigma"]
        if summary["sigma"] is None:
            row["delta"] = None
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
        "accountant_certified": summary.get("accountant_certified"),
        "epsilon_certified": summary.get("epsilon_certified"),
        "noise_sigma": summary.get("sigma"),
        "device": summary.get("device"),
        "device_name": summary.get("device_name"),
        "torch_version": versions.get("torch"),
        "dprun_version": versions.get("dprun"),
        "error": summary.get("error"),
        "run_dir": str(run_dir),
        "finished_at": datetime.fromtimestamp((run_dir / "summary.json").stat().st_mtime, timezone.utc)
        .isoformat(timespec="seconds"),  # UTC, so the strings sort in time order
    })
    epochs = read_metrics(run_dir)
    last = epochs.iloc[-1] if len(epochs) else {}
    for col in METRIC_COLUMNS:
        # the last epoch's value; else what summary.json says (an infinite epsilon's lower bound); else NaN
        row[col] = last.get(col, row.get(col, math.nan)) if len(epochs) else row.get(col, math.nan)
        row[col] = math.nan if row[col] is None else row[col]
    if len(epochs) and "epoch_time_s" in epochs:
        row["total_time_s"] = float(epochs["epoch_time_s"].sum())
        row["mean_epoch_time_s"] = float(epochs["epoch_time_s"].mean())
    if len(epochs) and "step_time_s" in epochs:
        step = float(epochs["step_time_s"].median())
        full_steps = 1.0 / row["sample_rate"] if row.get("sample_rate") else row.get("steps_per_epoch") or math.nan
        row["epoch_time_est_s"] = step * full_steps
    return row, epochs


def unstarted_row(folder: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """One row for a folder holding only Hydra's .hydra/ record: its configuration, status `failed-to-start`."""
    row: dict[str, Any] = {name: dig(cfg, path) for name, path in CONFIG_COLUMNS}
    row.update({col: math.nan for col in METRIC_COLUMNS})
    row.update({"status": FAILED_TO_START, "epochs_completed": 0, "run_dir": str(folder),
                "error": "no summary.json: stopped before training (bad input, missing data, out of memory), "
                         "or still loading data",
                "finished_at": (folder / ".hydra").stat().st_mtime})
    return row


def read_folder(folder: Path, hydra_cfg: dict[str, Any] | None) -> tuple[dict[str, Any], pd.DataFrame]:
    """read_run, or for a folder holding only .hydra/ (hydra_cfg: the config Hydra recorded) a row, no epochs."""
    if hydra_cfg is None:
        return read_run(folder)
    return unstarted_row(folder, hydra_cfg), pd.DataFrame()


def collect(root: str | Path = "outputs", experiment: str | None = None, scale: str | None = None,
            per_epoch: bool = False) -> pd.DataFrame:
    """All runs under root as one table: one row per run, or (per_epoch) one row per run and epoch."""
    frames, rows = [], []
    found = [(run_dir, None) for run_dir in find_runs(root)] + unstarted_runs(root)
    for run_dir, hydra_cfg in sorted(found, key=lambda f: str(f[0])):
        try:
            row, epochs = read_folder(run_dir, hydra_cfg)
        except Exception as e:  # noqa: BLE001  one damaged folder must not hide every other run
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            print(f"dprun-report: skipping unreadable run {run_dir}: {reason}", file=sys.stderr)
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
    view = view.drop(columns=[c for c in cols if c.startswith("epsilon_") and view[c].isna().all()])
    for col in [c for c in view.columns if c.startswith("epsilon_")]:  # labelled, not guarantees
        view[col] = view[col].map(lambda v: "" if pd.isna(v) else f"{v:.3g}")
    if "epsilon" in view:
        bound = runs["epsilon_lower_bound"] if "epsilon_lower_bound" in runs else pd.Series(math.nan, runs.index)
        view["epsilon"] = [epsilon_text(e, b) for e, b in zip(view["epsilon"], bound)]
    return view.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="")


def epsilon_text(eps: float, lower_bound: float) -> str:
    """"0.93"; an infinite epsilon with its certified lower bound as dprun-eps prints it: "inf (> 3.03e+09)"."""
    if pd.isna(eps):
        return ""
    if math.isinf(eps) and not pd.isna(lower_bound) and math.isfinite(lower_bound):  # sigma=0: the bound is inf too
        return f"inf (> {lower_bound:.3g})"
    return f"{eps:.3g}"


def unfinished_view(runs: pd.DataFrame) -> str:
    """One line per run that did not finish: status, folder, the error recorded (empty if none)."""
    bad = runs[runs["status"] != "finished"]
    if bad.empty:
        return ""
    errors = bad["error"] if "error" in bad else pd.Series("", bad.index)
    lines = [f"  {status}  {run_dir}  {'' if pd.isna(err) else err}".rstrip()
             for status, run_dir, err in zip(bad["status"].fillna("unknown"), bad["run_dir"], errors)]
    return "\n".join([f"runs that did not finish ({len(bad)}):", *lines])


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
    unfinished = "" if args.epochs else unfinished_view(table)
    if not args.quiet:
        print(table.to_string(index=False, max_colwidth=24) if args.epochs else summary_view(table))
        if unfinished:
            print(unfinished)
    n = table["run_dir"].nunique()
    infinite = table[pd.to_numeric(table.get("epsilon"), errors="coerce") == math.inf] if "epsilon" in table else []
    if len(infinite):
        bound = pd.to_numeric(infinite.get("epsilon_lower_bound"), errors="coerce").dropna()
        bound = bound[bound < math.inf]
        print(f"dprun-report: {infinite['run_dir'].nunique()} runs have epsilon=inf: no finite guarantee at their "
              "delta (sigma=0, or JL with small r: the heavy tail of Z_r)" + (f"; certified lower bounds up to "
              f"{bound.max():.3g} in column epsilon_lower_bound" if len(bound) else "") + ". See docs/privacy.md")
    note = f" ({len(unfinished.splitlines()) - 1} did not finish)" if unfinished else ""
    print(f"dprun-report: {n} runs{note}, {len(table)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
