"""`dprun-report`: your runs under outputs/ -> one pandas table (CSV) and a readable summary, one row per run.

    dprun -m method=nonprivate,reweight,jl r=1,4 dataset=digits epochs=2
    dprun-report                                   # your runs: one row per run, oldest first; outputs/tables/runs.csv
    dprun-report --experiment jl_table2            # only the runs of one preset (experiment_name)
    dprun-report --scale smoke --epochs            # the per-epoch long table (one row per run and epoch)
    dprun-report --reference                       # also the committed reference runs (outputs/reference/)
    dprun-report --root /scratch/outputs --out all.csv

A run is any folder holding summary.json (runner/train.py writes it first, then metrics.csv after each epoch):
single runs under outputs/runs/**, sweeps under outputs/multirun/**. The runs under <root>/reference/ are the
repository's committed reference runs, not yours: left out unless --reference (then the `source` column says
`reference` or `user`). Rows are sorted by start time, newest last (`started_at`: summary.json's, else when Hydra
wrote .hydra/; runs with neither come first); `folder` is the run's folder relative to --root. Columns: the
configuration (dataset, model, method, r, batch_size, sigma, clip, lr, epochs, seed, sampling, data source, device,
torch version, experiment, scale), then the final epoch's metrics and `epoch_time_est_s`: the seconds a full
(uncapped) epoch takes, from the median step time times the expected steps per epoch, so capped smoke runs give
comparable seconds per epoch; `capped` marks a run whose max_steps_per_epoch cut its epochs short (beside it
`full_steps_per_epoch`). A folder holding only Hydra's .hydra/ is a run that stopped before its first summary.json
(a sweep's refused job, a crash while loading): a row with status `failed-to-start`, the configuration Hydra
recorded and, as `error`, the last error line of its dprun.log. A run still `running` in its summary.json whose
process (its `pid` and `host` columns) is gone from this host is `stale` (killed: SIGKILL, the OOM killer); one on
another host stays `running`, unchecked. A run whose files cannot be read is skipped with one
line on stderr; the runs that did not finish are listed after the table, and runs whose calibrated sigma missed
target_epsilon are named.
"""
from __future__ import annotations

import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from runner.epsilon_shown import shown_epsilon, shown_lower_bound, shown_noise, shown_value
from runner.audit.columns import audit_columns, audited_text
from runner.entry import OneLineParser, run_entry
from runner.errors import DprunError
from runner.run_dir import out_dir_of, unstarted_runs
from runner.run_lock import alive
from runner.run_lock import host as this_host

# (column, path into summary.json's resolved config)
CONFIG_COLUMNS = [
    ("experiment", "experiment_name"), ("scale", "scale"), ("dataset", "dataset.name"), ("like", "dataset.like"),
    ("image_size", "dataset.image_size"), ("model", "model.name"), ("depth", "model.depth"),
    ("method", "method.name"), ("r", "method.r"), ("batch_size", "batch_size"), ("sigma", "sigma"), ("clip", "clip"),
    ("lr", "lr"), ("optimizer", "optimizer.name"), ("epochs", "epochs"), ("seed", "seed"),
    ("max_steps_per_epoch", "max_steps_per_epoch"), ("delta", "delta"), ("precision", "precision"),
    ("physical_batch_size", "physical_batch_size"),
]
# epsilon: certified, or empty; the labelled epsilon_*_approx/_assumed columns are NOT guarantees
# (runner/accountants/published.py); epsilon_lower_bound: certified lower bound where epsilon is inf
METRIC_COLUMNS = ["test_acc", "test_loss", "train_loss", "train_acc", "epsilon", "epsilon_lower_bound",
                  "epsilon_gdp_approx", "epsilon_hsa_assumed", "epsilon_poisson_assumed", "epoch_time_s",
                  "step_time_s", "peak_mem_bytes"]
SUMMARY_VIEW = ["started", "experiment", "scale", "dataset", "model", "method", "method_options", "batch_size",
                "physical_batch_size", "precision", "world_size", "sigma", "epochs", "sampling", "status", "test_acc",
                "epsilon", "audited", "epsilon_gdp_approx", "epsilon_hsa_assumed", "epsilon_poisson_assumed", "delta",
                "epoch_time_est_s", "device", "capped", "source", "folder"]
# the default view fits WIDTH characters: columns are left out from the end of this list (least needed first) until
# every line fits; --wide shows them all. What is never left out: what ran, on what scale, and what it gave.
WIDTH = 120
KEEP_FIRST = ["method", "status", "test_acc", "epsilon", "audited", "batch_size", "physical_batch_size", "precision", "world_size",
              "folder", "started", "capped", "source", "dataset", "sigma", "model", "epochs", "epoch_time_est_s",
              "method_options", "experiment", "scale", "device", "sampling", "delta", "epsilon_gdp_approx",
              "epsilon_hsa_assumed", "epsilon_poisson_assumed"]
NEVER_LEFT_OUT = KEEP_FIRST[:13]
SCALE_COLUMNS = ("physical_batch_size", "precision", "world_size")  # shown even where blank: how each run scaled
# the header a column is shown under in the default view (the CSV keeps the full names)
SHORT_NAMES = {"physical_batch_size": "phys_B", "world_size": "ranks", "epoch_time_est_s": "epoch_s",
               "batch_size": "B", "method_options": "options"}
FAILED_TO_START = "failed-to-start"  # status of a folder holding only Hydra's .hydra/ record
STALE = "stale"  # status of a `running` run whose process is gone from this host (status_now)
NO_SUMMARY = "no summary.json: stopped before training (bad input, missing data, out of memory), or still loading data"
REFERENCE = "reference"  # <root>/reference/: the committed reference runs (outputs/reference/), not the user's
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
    # e.g. mode=bk norm=auto keep=1.1; an option left null (keep_mb: unset) is not a setting of the run
    row["method_options"] = " ".join(f"{k}={v}" for k, v in method.items() if k != "name" and v is not None)
    row["config_key"] = config_key(cfg)
    versions = summary.get("versions") if isinstance(summary.get("versions"), dict) else {}
    row["sigma_configured"] = row["sigma"]
    if "sigma" in summary:  # the sigma the run used: calibrated to target_epsilon; None if not private
        row["sigma"] = summary["sigma"]
        if summary["sigma"] is None:
            row["delta"] = None
    row.update({
        "epsilon_lower_bound": summary.get("epsilon_lower_bound"),
        "status": status_now(summary),
        "pid": summary.get("pid"),  # the process that wrote it last, and its host (runs since run_lock)
        "host": summary.get("host"),
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
        "world_size": summary.get("world_size"),
        "device": summary.get("device"),
        "device_name": summary.get("device_name"),
        "torch_version": versions.get("torch"),
        "dprun_version": versions.get("dprun"),
        "error": summary.get("error"),
        "run_dir": str(run_dir),
        "started_at": summary.get("started_at") or hydra_time(run_dir),
        "finished_at": utc_iso((run_dir / "summary.json").stat().st_mtime),
        "target_epsilon": dig(cfg, "target_epsilon"),
        "planned_epsilon": summary.get("planned_epsilon"),  # the certified epsilon planned at calibration
        "target_epsilon_met": summary.get("target_epsilon_met"),
        **audit_columns(summary),  # audit=one_run: the audited lower bound beside the claimed epsilon
    })
    row.update(capping(row))
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


def status_now(summary: dict[str, Any]) -> Any:
    """summary.json's status, except a `running` run whose process is gone from this host: `stale` (killed without
    a chance to record it: SIGKILL, the OOM killer). On another host, or in a summary without pid and host, it
    stays `running`: nothing here can tell (unfinished_view says so)."""
    status = summary.get("status")
    if status == "running" and summary.get("pid") is not None and alive(summary["pid"], summary.get("host")) is False:
        return STALE
    return status


def process_note(status: Any, pid: Any, host: Any) -> str:
    """What dprun-report knows of a running or stale run's process, for the list of runs that did not finish."""
    if pd.isna(pid) or status not in ("running", STALE):
        return ""
    if status == STALE:
        return f"its process (pid {int(pid)} on this host) is gone: killed before it could record how it ended"
    if alive(int(pid), None if pd.isna(host) else str(host)):
        return f"pid {int(pid)} on this host"
    return f"pid {int(pid)} on host {host}: not checked from this host ({this_host()})"


def utc_iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds")  # UTC: sorts as text


def hydra_time(folder: Path) -> str | None:
    """When Hydra wrote the run's .hydra/ record (the job's start), for runs whose summary.json has no started_at."""
    record = folder / ".hydra" / "config.yaml"
    return utc_iso(record.stat().st_mtime) if record.is_file() else None


def capping(row: dict[str, Any]) -> dict[str, Any]:
    """`capped`: max_steps_per_epoch took fewer steps per epoch than a full epoch (`full_steps_per_epoch`, by the
    sampler's own rule; N = batch_size / sample_rate)."""
    cap, q, b = row.get("max_steps_per_epoch"), row.get("sample_rate"), row.get("batch_size")
    if not cap or not q or not b:
        return {"capped": False, "full_steps_per_epoch": row.get("steps_per_epoch")}
    from runner.data.sampler import poisson_steps_per_epoch  # here: it imports torch, which most reports never need

    n = round(float(b) / float(q))
    full = poisson_steps_per_epoch(n, int(b)) if row.get("sampling") in (None, "poisson") else math.ceil(n / int(b))
    return {"capped": int(cap) < full, "full_steps_per_epoch": full}


def last_error(folder: Path, cfg: dict[str, Any]) -> str | None:
    """The last ERROR line of the run's dprun.log (in its folder, or in the out_dir it named), without the time
    stamp: e.g. `run failed: DprunError: batch_size=100000 must be ...`; None if there is none."""
    try:
        logs = [folder / "dprun.log", *[d / "dprun.log" for d in [out_dir_of(folder, cfg)] if d is not None]]
    except Exception:  # noqa: BLE001  a damaged hydra.yaml: the folder's own log is still worth reading
        logs = [folder / "dprun.log"]
    for log in logs:
        if log.is_file():
            errors = [ln.split(" ERROR ", 1)[1].strip() for ln in log.read_text(errors="replace").splitlines()
                      if " ERROR " in ln]
            if errors:
                return errors[-1]
    return None


def unstarted_row(folder: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """One row for a folder holding only Hydra's .hydra/ record: its configuration, status `failed-to-start`, the
    error its dprun.log recorded."""
    row: dict[str, Any] = {name: dig(cfg, path) for name, path in CONFIG_COLUMNS}
    row.update({col: math.nan for col in METRIC_COLUMNS})
    row.update({"status": FAILED_TO_START, "epochs_completed": 0, "run_dir": str(folder), "capped": False,
                "error": last_error(folder, cfg) or NO_SUMMARY,
                "started_at": hydra_time(folder), "finished_at": utc_iso((folder / ".hydra").stat().st_mtime)})
    return row


def read_folder(folder: Path, hydra_cfg: dict[str, Any] | None) -> tuple[dict[str, Any], pd.DataFrame]:
    """read_run, or for a folder holding only .hydra/ (hydra_cfg: the config Hydra recorded) a row, no epochs."""
    if hydra_cfg is None:
        return read_run(folder)
    return unstarted_row(folder, hydra_cfg), pd.DataFrame()


def is_reference(run_dir: Path, root: Path) -> bool:
    """A committed reference run: under <root>/reference/, or --root itself is inside an outputs/reference/ folder
    (then they were asked for by name, and are listed)."""
    parts = Path(root).resolve().parts
    inside = any(a == "outputs" and b == REFERENCE for a, b in zip(parts, parts[1:]))
    return inside or Path(run_dir).relative_to(root).parts[:1] == (REFERENCE,)


def collect(root: str | Path = "outputs", experiment: str | None = None, scale: str | None = None,
            per_epoch: bool = False, reference: bool = False) -> pd.DataFrame:
    """The runs under root as one table, oldest first: one row per run, or (per_epoch) one row per run and epoch.
    The committed reference runs (<root>/reference/) only with reference=True."""
    frames, rows = [], []
    root = Path(root)
    found = [(run_dir, None) for run_dir in find_runs(root)] + unstarted_runs(root)
    for run_dir, hydra_cfg in sorted(found, key=lambda f: str(f[0])):
        if not reference and run_dir.relative_to(root).parts[:1] == (REFERENCE,):
            continue  # <root>/reference/: the committed runs, not the user's
        source = REFERENCE if is_reference(run_dir, root) else "user"
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
        row.update(source=source, folder=run_dir.relative_to(root).as_posix())
        rows.append(row)
        frames.append(epochs.assign(**{k: v for k, v in row.items() if k not in epochs}) if per_epoch else None)
    order = sorted(range(len(rows)), key=lambda i: (rows[i].get("started_at") is not None,
                                                    rows[i].get("started_at") or "", rows[i]["folder"]))
    if per_epoch:
        frames = [frames[i] for i in order if frames[i] is not None and len(frames[i])]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return pd.DataFrame([rows[i] for i in order])


def latest(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: the newest finished run where a preset was run more than once."""
    if runs.empty:
        return runs
    done = runs[runs["status"] == "finished"]
    keys = [k for k in RUN_KEY if k in done]
    done = done.sort_values("finished_at")
    return done.groupby(keys, dropna=False, sort=False).tail(1).reset_index(drop=True)


def local_time(iso: Any) -> str:
    """"2026-11-23T20:05:35+00:00" -> "2026-11-23 21:05" in this machine's time zone (Hydra's folder names use it)."""
    return "" if not isinstance(iso, str) else datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")


def summary_view(runs: pd.DataFrame, wide: bool = False) -> str:
    """One line per run: at most WIDTH characters (columns left out, least needed first, and named in a last line),
    or every column with wide=True. Empty cells are blank (a non-private run has no sigma or epsilon)."""
    view = summary_columns(runs)
    if not wide:  # a column blank on every row says nothing (capped when no run was cut short)
        view = view.drop(columns=[c for c in view.columns if c not in SCALE_COLUMNS and (view[c].isna() |
                                                                                          (view[c] == "")).all()])
    text = render(view, wide)
    hidden: list[str] = []
    while not wide and max(map(len, text.splitlines())) > WIDTH:
        droppable = [c for c in reversed(KEEP_FIRST) if c in view and c not in NEVER_LEFT_OUT]
        if not droppable:
            break
        hidden.append(droppable[0])
        view = view.drop(columns=droppable[0])
        text = render(view, wide)
    if hidden:
        note = f"(--wide adds {', '.join(reversed(hidden))})"
        text += "\n" + (note if len(note) <= WIDTH else f"(--wide adds {len(hidden)} more columns)")
    return text


def summary_columns(runs: pd.DataFrame) -> pd.DataFrame:
    """The summary view's columns, formatted: epsilon as text, capped as 'taken/full', numbers as numbers."""
    runs = runs.assign(started=runs["started_at"].map(local_time) if "started_at" in runs else "")
    if "capped" in runs:  # "3/98": steps per epoch taken / a full epoch's, for runs that max_steps_per_epoch cut
        none = pd.Series(math.nan, runs.index)
        steps, full = runs.get("steps_per_epoch", none), runs.get("full_steps_per_epoch", none)
        runs["capped"] = [f"{int(s)}/{int(f)}" if pd.notna(c) and bool(c) else ""
                          for c, s, f in zip(runs["capped"], steps, full)]
    if "source" in runs and runs["source"].nunique() < 2:
        runs = runs.drop(columns="source")  # shown only where reference and user runs are mixed
    if "audited_epsilon" in runs and runs["audited_epsilon"].notna().any():
        runs["audited"] = [audited_text(b, f, a) for b, f, a in
                           zip(runs["audited_epsilon"], runs["audited_epsilon_fdp"], runs["audit_above_claimed"])]
    cols = [c for c in SUMMARY_VIEW if c in runs]
    view = runs[cols].copy()
    view = view.drop(columns=[c for c in cols if c.startswith("epsilon_") and view[c].isna().all()])
    for col in view.columns:  # None in an object column (sigma of a non-private run) is a blank, not "None"
        if view[col].dtype == object:
            numbers = pd.to_numeric(view[col], errors="coerce")
            if numbers.notna().sum() == view[col].notna().sum() and numbers.notna().any():
                view[col] = numbers  # a NaN, printed blank (na_rep)
            else:
                view[col] = view[col].where(view[col].notna(), "")
    view = epsilons_shown(view, 3, skip=("epsilon",))  # the labelled epsilon_* columns rounded up too
    if "epsilon" in view:
        bound = runs["epsilon_lower_bound"] if "epsilon_lower_bound" in runs else pd.Series(math.nan, runs.index)
        view["epsilon"] = [epsilon_text(e, b) for e, b in zip(view["epsilon"], bound)]
    for col in ("sigma", "sigma_configured"):  # rounded down: an epsilon recomputed from a shown sigma is not below
        if col in view:  # the run's (review 43)
            view[col] = view[col].map(lambda v: "" if pd.isna(v) or v == "" else shown_noise(float(v)))
    for col in ("physical_batch_size", "world_size"):  # integers where set (a blank is a NaN: float otherwise)
        if col in view:
            view[col] = view[col].map(lambda v: "" if pd.isna(v) or v == "" else str(int(v)))
    return view


def render(view: pd.DataFrame, wide: bool) -> str:
    shown = view if wide else view.rename(columns=SHORT_NAMES)
    if not wide and "folder" in shown:  # a sweep's folders share their start (multirun/<date>/<time>/): keep the
        # end, the job's own name, which tells them apart (pandas would keep the start and cut the rest)
        shown = shown.assign(folder=shown["folder"].map(lambda f: f if len(str(f)) <= 22 else "…" + str(f)[-21:]))
    return shown.to_string(index=False, float_format=lambda v: f"{v:.4g}", na_rep="",
                                      max_colwidth=None if wide else 22)


def epsilons_shown(table: pd.DataFrame, digits: int, skip: tuple = ()) -> pd.DataFrame:
    """The epsilon columns as text to `digits` (shown_value: rounded up, epsilon_lower_bound down); the columns in
    `skip` as they are."""
    table = table.copy()
    for col in [c for c in table.columns if c.startswith("epsilon") and c != "epsilon_certified" and c not in skip]:
        numbers = pd.to_numeric(table[col], errors="coerce")
        if numbers.notna().any():
            table[col] = numbers.map(lambda v, c=col: "" if pd.isna(v) else shown_value(c, float(v), digits))
    return table


def epsilon_text(eps: float, lower_bound: float) -> str:
    """"0.93"; an infinite epsilon with its certified lower bound as dprun-eps prints it: "inf (> 3.03e+09)"."""
    if pd.isna(eps):
        return ""
    if math.isinf(eps) and not pd.isna(lower_bound) and math.isfinite(lower_bound):  # sigma=0: the bound is inf too
        return f"inf (> {shown_lower_bound(lower_bound, 3)})"
    return shown_epsilon(eps, 3)  # rounded up: never below the certified value


def unfinished_view(runs: pd.DataFrame) -> str:
    """One line per run that did not finish: status, folder, the error recorded (empty if none)."""
    bad = runs[runs["status"] != "finished"]
    if bad.empty:
        return ""
    errors = bad["error"] if "error" in bad else pd.Series("", bad.index)
    none = pd.Series(math.nan, bad.index)
    notes = [process_note(s, pid, host)
             for s, pid, host in zip(bad["status"], bad.get("pid", none), bad.get("host", none))]
    lines = [f"  {status}  {run_dir}  {'; '.join(t for t in ('' if pd.isna(err) else err, note) if t)}".rstrip()
             for status, run_dir, err, note in zip(bad["status"].fillna("unknown"), bad["run_dir"], errors, notes)]
    return "\n".join([f"runs that did not finish ({len(bad)}):", *lines])


def main(argv: list[str] | None = None) -> int:
    """`dprun-report`: bad input is one line (runner/entry.py)."""
    return run_entry(report, "dprun-report", argv)


def report(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="dprun-report", description=__doc__.splitlines()[0])
    p.add_argument("--root", default="outputs", help="folder searched for run folders (default: outputs)")
    p.add_argument("--experiment", help="keep only runs with this experiment_name (a preset's name)")
    p.add_argument("--scale", choices=["smoke", "paper"], help="keep only runs of this scale")
    p.add_argument("--epochs", action="store_true", help="the per-epoch long table instead of one row per run")
    p.add_argument("--reference", "--all", action="store_true", dest="reference",
                   help="also the committed reference runs under <root>/reference/ (column `source` tells them apart)")
    p.add_argument("--out", help="CSV to write (default: <root>/tables/runs.csv, or runs_<experiment>.csv)")
    p.add_argument("--quiet", action="store_true", help="write the CSV, print only its path")
    p.add_argument("--wide", action="store_true", help=f"every column of the summary (default: it fits {WIDTH} columns)")
    args = p.parse_args(argv)
    table = collect(args.root, args.experiment, args.scale, per_epoch=args.epochs, reference=args.reference)
    name = "runs" + (f"_{args.experiment}" if args.experiment else "") + ("_epochs" if args.epochs else "")
    out = Path(args.out or Path(args.root) / "tables" / f"{name}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    if table.empty:
        hidden = "" if args.reference or not (Path(args.root) / REFERENCE).is_dir() else \
            f" (the committed reference runs under {Path(args.root) / REFERENCE} are listed with --reference)"
        print(f"dprun-report: no runs under {args.root}" + (f" with experiment={args.experiment}" if args.experiment
                                                          else "") + f"; wrote an empty {out}{hidden}")
        return 0
    unfinished = "" if args.epochs else unfinished_view(table)
    if not args.quiet:
        print(epsilons_shown(table, 7).to_string(index=False, max_colwidth=24) if args.epochs
              else summary_view(table, args.wide))
        if unfinished:
            print(unfinished)
    n = table["run_dir"].nunique()
    infinite = table[pd.to_numeric(table.get("epsilon"), errors="coerce") == math.inf] if "epsilon" in table else []
    if len(infinite):
        bound = pd.to_numeric(infinite.get("epsilon_lower_bound"), errors="coerce").dropna()
        bound = bound[bound < math.inf]
        print(f"dprun-report: {infinite['run_dir'].nunique()} runs have epsilon=inf: no finite guarantee at their "
              "delta (sigma=0, or JL with small r: the heavy tail of Z_r)" + (f"; certified lower bounds up to "
              f"{shown_lower_bound(float(bound.max()), 3)} in column epsilon_lower_bound" if len(bound) else "") + ". See docs/privacy.md")
    missed = table[table["target_epsilon_met"] == False] if "target_epsilon_met" in table else []  # noqa: E712
    if len(missed):
        print(f"dprun-report: {missed['run_dir'].nunique()} runs missed their target_epsilon (sigma calibrated with "
              f"a non-certified calibration_accountant; columns planned_epsilon, target_epsilon): "
              + ", ".join(missed["folder"].drop_duplicates()))
    failed = table[table["audit_above_claimed"] == True] if "audit_above_claimed" in table else []  # noqa: E712
    if len(failed):
        print(f"dprun-report: WARNING: {failed['run_dir'].nunique()} runs FAILED their privacy audit (an audited "
              f"lower bound above the claimed epsilon: a privacy bug, column audited): "
              + ", ".join(failed["folder"].drop_duplicates()))
    note = f" ({len(unfinished.splitlines()) - 1} did not finish)" if unfinished else ""
    print(f"dprun-report: {n} runs{note}, {len(table)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
