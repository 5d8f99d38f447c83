"""Paper-scale reference runs (issue 13): MNIST and IMDB at the JL paper's settings, over the full 15 / 20 epochs,
and a README that puts their numbers next to the papers'. The tables are generated from the runs' metrics.csv and
summary.json, never typed.

    python -m runner.paper_runs run --data-dir /data                    # make paper-runs DATA_DIR=/data
    python -m runner.paper_runs run --data-dir /data --only mnist --device cuda
    python -m runner.paper_runs run --dry-run --data-dir /data          # the dprun commands only
    python -m runner.paper_runs readme                                  # make paper-readme
    python -m runner.paper_runs readme --runs /work/paper_runs --out /tmp/README.md   # any folder of such runs
    python -m runner.paper_runs readme --runs /work/paper_runs --import-to outputs/reference/paper/runs
                                          # make paper-readme RUNS_DIR=/work/paper_runs: copy, then the README

`run` writes each run into <out>/<name>/ (default outputs/reference/paper/runs/; only metrics.csv and summary.json
are kept in git) and skips a run whose summary.json says finished (--force reruns). Each run is one plain `dprun`
(the dataset's paper defaults from conf/dataset/: MNIST bu_cnn, B=256, lr 0.25, sigma 1.3, C 1.5, 15 epochs, the
non-private baseline at its own lr, MNIST_NONPRIVATE_LR; IMDB bilstm, DP-Adam, B=256, lr 0.001, sigma 0.6, C 1, 20
epochs). `readme` reads every <runs>/<name>/ holding a
summary.json (finished or not: a partial run is shown with its epochs completed) and writes the README.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd
from runner.epsilon_shown import shown_epsilon, shown_noise

OUT = Path("outputs/reference/paper/runs")
PROBES = Path("outputs/reference/paper/imdb_probes")  # the IMDB setups tried (docs/imdb_reproduction.md)
LR_PROBES = Path("outputs/reference/paper/mnist_probes")  # the learning rates tried for the non-private MNIST run
README = Path("outputs/reference/paper/README.md")


@dataclass(frozen=True)
class Ref:
    name: str
    dataset: str
    overrides: tuple[str, ...]


# The non-private MNIST baseline trains at its own learning rate, not DP-SGD's 0.25: the JL paper states no rate for
# its Non-DP SGD, and at 0.25 plain SGD on bu_cnn (no clipping, no noise) diverged (seed 0 fell to 11% at epoch 4,
# seed 1 to 86% at epoch 15). The rates tried (outputs/reference/paper/mnist_probes, a table in the README): 0.1 and
# 0.05 both reach ~98% in 4 epochs, 0.025 trains slower; 0.05 keeps a 5x margin below the rate that diverged.
# conf/experiment/jl_fig3.yaml's scale=paper lr_nonprivate is the same (tests/test_paper_runs.py).
MNIST_NONPRIVATE_LR = 0.05

RUNS = [
    Ref("mnist_nonprivate_s0", "mnist", ("method=nonprivate", f"lr={MNIST_NONPRIVATE_LR}", "seed=0")),
    Ref("mnist_nonprivate_s1", "mnist", ("method=nonprivate", f"lr={MNIST_NONPRIVATE_LR}", "seed=1")),
    Ref("mnist_reweight_s0", "mnist", ("method=reweight", "seed=0")),
    Ref("mnist_reweight_s1", "mnist", ("method=reweight", "seed=1")),
    Ref("mnist_reweight_s2", "mnist", ("method=reweight", "seed=2")),
    Ref("mnist_jl1_s0", "mnist", ("method=jl", "r=1", "seed=0")),
    Ref("mnist_jl30_s0", "mnist", ("method=jl", "r=30", "seed=0")),
    Ref("imdb_nonprivate_s0", "imdb", ("method=nonprivate", "seed=0")),
    Ref("imdb_reweight_s0", "imdb", ("method=reweight", "seed=0")),
    Ref("imdb_jl1_s0", "imdb", ("method=jl", "r=1", "seed=0")),
    Ref("imdb_jl4_s0", "imdb", ("method=jl", "r=4", "seed=0")),
]
BY_NAME = {r.name: r for r in RUNS}

# The papers' numbers (JL = jl-projections-dpsgd: section 3.1 / Figure 3 for MNIST, section 3.3 / Table 3 for IMDB)
THRESHOLD = {"mnist": 0.95, "imdb": 0.70}  # the accuracy the JL paper fixes (Figure 3: 95%; Figure 6: 70%)
PAPER = {
    ("mnist", "nonprivate"): "Figure 3 curve only (no number, no learning rate stated for Non-DP SGD)",
    ("mnist", "reweight"): "95% at eps < 1, > 100 s (DP-SGD-Outer; JL sec. 3.1, Figure 3)",
    ("mnist", "jl1"): "95% in < 10 s at eps 2.4 (JL sec. 3.1, Figure 3)",
    ("mnist", "jl30"): "Figure 3 curve only (no number in the text)",
    ("imdb", "nonprivate"): "~84% ('very close' to 83.2%; JL sec. 3.3); 12 s/epoch (Table 3, TF)",
    ("imdb", "reweight"): "DP-Adam-Vanilla: 4 epochs only, never reached 70% (JL sec. 3.3); 13,931 s/epoch",
    ("imdb", "jl1"): "83.2% at eps 21 after 20 epochs (JL sec. 3.3); 38 s/epoch (Table 3)",
    ("imdb", "jl4"): "Figures 5-6 curves only; 100 s/epoch (Table 3)",
}
PAPER_ACCURACY = {"imdb": [(0.832, "paper: DP-Adam-JL(1) 83.2%, 20 epochs", "jl1")]}  # drawn on the curves
LABEL = {"nonprivate": "non-private", "reweight": "exact (ReweightGP)", "jl1": "JL(1)", "jl4": "JL(4)",
         "jl30": "JL(30)"}
OPTIMIZER_NAME = {"mnist": "DP-SGD", "imdb": "DP-Adam"}
DATASET_NAME = {"mnist": "MNIST", "imdb": "IMDB"}


def command(ref: Ref, data_dir: str, out_root: Path, device: str) -> list[str]:
    return ["dprun", f"dataset={ref.dataset}", *ref.overrides, f"data_dir={data_dir}", f"device={device}",
            "progress=false", f"out_dir={Path(out_root) / ref.name}"]


def status_of(run_dir: Path) -> Optional[str]:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()).get("status") if path.exists() else None


def run_all(data_dir: str, out_root: Path, device: str, only: Optional[str], force: bool, dry_run: bool) -> int:
    refs = [r for r in RUNS if not only or r.dataset == only or r.name == only]
    failed = 0
    for ref in refs:
        argv = command(ref, data_dir, out_root, device)
        if not force and status_of(Path(out_root) / ref.name) == "finished":
            print(f"paper_runs: {ref.name}: finished already (--force reruns it)")
            continue
        print("paper_runs: " + " ".join(argv), flush=True)
        if dry_run:
            continue
        start = time.time()
        rc = subprocess.call([sys.executable, "-m", "runner.cli", *argv[1:]])
        print(f"paper_runs: {ref.name}: exit {rc} after {time.time() - start:.0f} s", flush=True)
        failed += rc != 0
    return 1 if failed else 0


# --- the README ------------------------------------------------------------------------------------------------

def method_key(cfg: dict) -> str:
    name = cfg.get("method", {}).get("name", "?")
    return f"jl{int(cfg.get('r', 1))}" if name == "jl" else name


def summarise(run_dir: Path) -> dict:
    """One row: what the run was, and its final / best accuracy, epsilon and time, from its own files."""
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = summary.get("config", {})
    path = run_dir / "metrics.csv"
    m = pd.read_csv(path) if path.exists() and path.stat().st_size else pd.DataFrame()
    dataset = cfg.get("dataset", {}).get("name", "?")
    row = {"name": run_dir.name, "dataset": dataset, "method": method_key(cfg), "seed": cfg.get("seed"),
           "status": summary.get("status"), "epochs": f"{len(m)}/{cfg.get('epochs')}",
           "device": summary.get("device_name") or summary.get("device"),
           "config": {k: cfg.get(k) for k in ("batch_size", "lr", "sigma", "clip", "delta")}
           | {"model": cfg.get("model", {}).get("name"), "optimizer": cfg.get("optimizer", {}).get("name"),
              "accountant": summary.get("accountant"), "sampling": summary.get("sampling")},
           "data_dir": cfg.get("data_dir"), "device_arg": cfg.get("device")}
    row["setup"] = setup_of(cfg | ({"sigma": shown_noise(summary["sigma"])} if summary.get("sigma") else {}))  # calibrated, down
    row["command"] = probe_command(cfg)
    row["unclipped"] = (float(m["unclipped_frac"].median()) if "unclipped_frac" in m and len(m) else None)
    if m.empty:
        return row | {"final_acc": math.nan, "best_acc": math.nan, "best_epoch": None, "epsilon": math.nan,
                      "time_s": math.nan, "to_threshold": None}
    eps = pd.to_numeric(m.get("epsilon", pd.Series(dtype=float)), errors="coerce")
    time_cum = m["epoch_time_s"].cumsum()
    best = int(m["test_acc"].idxmax())
    thr = THRESHOLD.get(dataset)
    hit = m.index[m["test_acc"] >= thr] if thr else []
    to_thr = None
    if len(hit):
        i = int(hit[0])
        to_thr = {"epoch": int(m.loc[i, "epoch"]), "time_s": float(time_cum[i]),
                  "epsilon": float(eps[i]) if len(eps) and pd.notna(eps[i]) else None}
    return row | {"accs": [float(a) for a in m["test_acc"]],
                  "final_acc": float(m["test_acc"].iloc[-1]), "best_acc": float(m.loc[best, "test_acc"]),
                  "best_epoch": int(m.loc[best, "epoch"]),
                  "epsilon": float(eps.iloc[-1]) if len(eps) and pd.notna(eps.iloc[-1]) else math.nan,
                  "time_s": float(time_cum.iloc[-1]), "final_train_loss": float(m["train_loss"].iloc[-1]),
                  "to_threshold": to_thr}


OPTIMIZER_KNOBS = {"adam": ("eps",), "sgd": ("momentum",)}  # what the IMDB investigation varies per optimizer


def optimizer_knobs(opt: dict, sep: str | None):
    """The varied knobs of the run's optimizer as key=value: a list (sep None) or one string."""
    pairs = [f"{k}={opt.get(k)}" for k in OPTIMIZER_KNOBS.get(str(opt.get("name")), ()) if opt.get(k) is not None]
    return pairs if sep is None else sep.join(pairs)


def setup_of(cfg: dict) -> str:
    """The knobs the IMDB investigation varies, as one short string (absent knobs: their defaults)."""
    model, data, opt = cfg.get("model", {}), cfg.get("dataset", {}), cfg.get("optimizer", {})
    parts = [f"init={model.get('init') or 'torch'}", f"mask={'on' if model.get('mask_padding') else 'off'}",
             f"truncate={data.get('truncate', 'end')}", f"pad={data.get('pad', 'end')}",
             f"seq_len={data.get('seq_len')}", f"{opt.get('name')}({optimizer_knobs(opt, ', ')})",
             f"lr={cfg.get('lr')}",
             f"C={cfg.get('clip')}", f"sigma={cfg.get('sigma')}"]
    return " ".join(parts)


def probe_command(cfg: dict) -> str:
    """The dprun command line of a run, from its resolved config: the knobs the investigation varies."""
    model, data, opt, method = cfg.get("model", {}), cfg.get("dataset", {}), cfg.get("optimizer", {}), cfg.get(
        "method", {})
    parts = ["dprun", f"dataset={data.get('name')}", f"method={method.get('name')}"]
    if method.get("name") == "jl":
        parts.append(f"r={cfg.get('r')}")
    parts += [f"model={model.get('name')}", f"model.init={model.get('init') or 'torch'}",
              f"model.mask_padding={str(bool(model.get('mask_padding'))).lower()}",
              f"dataset.truncate={data.get('truncate', 'end')}", f"dataset.pad={data.get('pad', 'end')}",
              f"optimizer={opt.get('name')}", *(f"optimizer.{kv}" for kv in optimizer_knobs(opt, None)),
              f"lr={cfg.get('lr')}"]
    if cfg.get("target_epsilon") is not None:
        parts.append(f"target_epsilon={cfg.get('target_epsilon')}")
    else:
        parts.append(f"sigma={cfg.get('sigma')}")
    parts += [f"clip={cfg.get('clip')}", f"epochs={cfg.get('epochs')}", f"seed={cfg.get('seed')}",
              "data_dir=<data_dir>"]
    return " ".join(parts)


def probes_section(rows: list[dict], probes_dir: Path) -> list[str]:
    """The table of every IMDB setup tried: what changed, accuracy, training loss, epsilon, the unclipped share."""
    lines = ["## IMDB: every setup tried", "",
             f"From `{probes_dir}` (each run's metrics.csv and summary.json); what each setup tests: "
             "docs/imdb_reproduction.md. `unclipped` is the median over epochs of the share of examples whose "
             "norm (JL: estimated norm) was at most C (`log_norms=true` runs only).", "",
             "| run | method | setup | status | epochs | best test acc (epoch) | final test acc | final train loss "
             "| epsilon | unclipped | device |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        best = f"{pct(r['best_acc'])} ({r['best_epoch']})" if r.get("best_epoch") else "-"
        loss = f"{r['final_train_loss']:.3f}" if r.get("final_train_loss") is not None else "-"
        unclipped = "-" if r.get("unclipped") is None else f"{r['unclipped']:.0%}"
        lines.append(f"| {r['name']} | {LABEL.get(r['method'], r['method'])} | {r['setup']} | {r['status']} | "
                     f"{r['epochs']} | {best} | {pct(r['final_acc'])} | {loss} | {eps_str(r['epsilon'])} | "
                     f"{unclipped} | {r['device']} |")
    lines += ["", "Each as one command (`interrupted`: stopped by hand once its best epoch had passed):", "", "```"]
    lines += [f"{r['name']}: {r['command']}" for r in rows]
    return lines + ["```", ""]


def collect(runs_dir: Path) -> list[dict]:
    return [summarise(p.parent) for p in sorted(Path(runs_dir).glob("*/summary.json"))]


def pct(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"


def eps_str(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return "inf" if math.isinf(v) else shown_epsilon(v, 3)


def reproduce_command(row: dict) -> str:
    ref = BY_NAME.get(row["name"])
    if ref is None:
        return f"(not a runner.paper_runs name; see {row['name']}/summary.json for its configuration)"
    out = "<runs>"
    return " ".join(command(ref, row["data_dir"] or "<data_dir>", Path(out), row["device_arg"] or "auto"))


def lr_probes_section(rows: list[dict], probes_dir: Path) -> list[str]:
    """The learning rates tried for the non-private MNIST run: test accuracy per epoch of each, from its files."""
    lines = ["## MNIST non-private: the learning rates tried", "",
             f"From `{probes_dir}` (each run's metrics.csv and summary.json). The JL paper states no learning rate "
             "for its Non-DP SGD; plain SGD takes unclipped, noise-free steps, so the non-private reference run gets "
             "its own rate instead of DP-SGD's.", "",
             "| run | lr | seed | status | epochs | test accuracy per epoch | best (epoch) | final |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (-float(r["config"]["lr"] or 0), str(r["seed"]))):
        best = f"{pct(r['best_acc'])} ({r['best_epoch']})" if r.get("best_epoch") else "-"
        lines.append(f"| {r['name']} | {r['config']['lr']} | {r['seed']} | {r['status']} | {r['epochs']} | "
                     f"{' '.join(pct(a) for a in r.get('accs', []))} | {best} | {pct(r['final_acc'])} |")
    return lines + [""]


def lrs_line(sub: list[dict]) -> Optional[str]:
    """Where the methods of a dataset train at different learning rates: which runs use which, from their configs."""
    by_lr: dict = {}
    for r in sub:
        by_lr.setdefault(r["config"].get("lr"), []).append(LABEL.get(r["method"], r["method"]))
    if len(by_lr) < 2:
        return None
    return ("- learning rates: " + "; ".join(f"{', '.join(dict.fromkeys(methods))}: lr {lr}"
                                           for lr, methods in by_lr.items())
            + " (the non-private run has its own: see the learning rates tried below)")


def readme(rows: list[dict], runs_dir: Path, probes: Optional[list[dict]] = None,
           probes_dir: Path = PROBES, lr_probes: Optional[list[dict]] = None, lr_probes_dir: Path = LR_PROBES) -> str:
    lines = ["# Paper-scale reference runs (MNIST, IMDB)", "",
             "Curves: [mnist.png](mnist.png), [imdb.png](imdb.png) (drawn by the same command).", "",
             "Generated by `python -m runner.paper_runs readme --runs " + str(runs_dir) + "` from each run's "
             "metrics.csv and summary.json: do not edit by hand. The papers' numbers are quoted from the JL paper "
             "(jl-projections-dpsgd: section 3.1 and Figure 3 for MNIST, section 3.3 and Table 3 for IMDB).", ""]
    if not rows:
        return "\n".join(lines + ["No reference runs found.", ""]
                         + (lr_probes_section(lr_probes, lr_probes_dir) if lr_probes else [])
                         + (probes_section(probes, probes_dir) if probes else []))
    for dataset in ("mnist", "imdb"):
        sub = [r for r in rows if r["dataset"] == dataset]
        if not sub:
            lines += [f"## {dataset.upper()}", "", "Not run yet (`make paper-runs DATA_DIR=... PAPER_ARGS=\"--only "
                      f"{dataset}\"`).", ""]
            continue
        thr = THRESHOLD[dataset]
        shared = {k: v for k, v in sub[0]["config"].items()
                  if k != "accountant" and all(r["config"].get(k) == v for r in sub)}  # per run: the lr column
        # one delta for the column, or each epsilon with its own (review 43: the first run's delta headed them all)
        one_delta = "delta" in shared
        delta_heading = f"delta={shared['delta']}" if one_delta else "at each run's delta"
        at = (lambda r: "") if one_delta else (lambda r: f" (delta={r['config'].get('delta')})")
        lines += [f"## {dataset.upper()} ({OPTIMIZER_NAME[dataset]}; settings: "
                  + ", ".join(f"{k}={v}" for k, v in shared.items()) + ")", "",
                  f"| run | method | seed | lr | status | epochs | final test acc | best test acc (epoch) | epsilon "
                  f"({delta_heading}) | train time | first epoch at {thr:.0%} (time, eps) "
                  "| paper |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(sub, key=lambda r: (list(LABEL).index(r["method"]) if r["method"] in LABEL else 99,
                                            str(r["seed"]))):
            t = r.get("to_threshold")
            hit = f"{t['epoch']} ({t['time_s']:.0f} s, eps {eps_str(t['epsilon'])})" if t else "not reached"
            best = f"{pct(r['best_acc'])} ({r['best_epoch']})" if r.get("best_epoch") else "-"
            time_s = "-" if math.isnan(r["time_s"]) else f"{r['time_s']:.0f} s"
            lines.append(f"| {r['name']} | {LABEL.get(r['method'], r['method'])} | {r['seed']} | "
                         f"{r['config'].get('lr')} | {r['status']} | "
                         f"{r['epochs']} | {pct(r['final_acc'])} | {best} | {eps_str(r['epsilon'])}{at(r)} | {time_s} | "
                         f"{hit} | {PAPER.get((dataset, r['method']), '-')} |")
        lines.append("")
        missing = [ref.name for ref in RUNS if ref.dataset == dataset and ref.name not in {r["name"] for r in sub}]
        if missing:
            lines.append(f"- not run yet: {', '.join(missing)}")
        if lrs_line(sub):
            lines.append(lrs_line(sub))
        for method in sorted({r["method"] for r in sub}):
            seeds = [r for r in sub if r["method"] == method and not math.isnan(r["final_acc"])]
            if len(seeds) > 1:
                accs = [r["final_acc"] for r in seeds]
                crossed = [r["to_threshold"] for r in seeds if r.get("to_threshold")]
                crossed = crossed if any(t["epsilon"] is not None for t in crossed) else []  # private runs only
                crossing = (f"; {len(crossed)} of {len(seeds)} seeds cross {thr:.0%} during training, at epsilon "
                            f"{', '.join(eps_str(t['epsilon']) for t in crossed)} (a paper figure's 'reaches "
                            f"{thr:.0%} at epsilon ...' is such a crossing, not a final value)") if crossed else ""
                lines.append(f"- {LABEL.get(method, method)}: mean final test accuracy over {len(seeds)} seeds "
                             f"{pct(statistics.mean(accs))} (sd {100 * statistics.stdev(accs):.2f} points), "
                             f"epsilon {', '.join(eps_str(r['epsilon']) + at(r) for r in seeds)}; all finished: "
                             f"{all(r['status'] == 'finished' for r in seeds)}{crossing}")
        lines.append("")
    if lr_probes:
        lines += lr_probes_section(lr_probes, lr_probes_dir)
    if probes:
        lines += probes_section(probes, probes_dir)
    lines += ["## Commands, device, seeds", "",
              "Each run is one `dprun` with the dataset's paper defaults (conf/dataset/); `<runs>` is the runs folder "
              "(`make paper-runs DATA_DIR=...` writes outputs/reference/paper/runs/).", "", "```"]
    lines += [reproduce_command(r) for r in rows]
    lines += ["```", "", "| run | device | accountant | sampling | seed |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['device']} | {r['config']['accountant']} | {r['config']['sampling']} | "
              f"{r['seed']} |" for r in rows]
    lines.append("")
    return "\n".join(lines)


def draw_curves(runs_dir: Path, dataset: str, out: Path) -> Optional[Path]:
    """<out> (PNG): curves_figure of the runs of `dataset` in runs_dir; None when there are none."""
    fig = curves_figure(runs_dir, dataset)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def curves_figure(runs_dir: Path, dataset: str):
    """Test accuracy and training loss per epoch of every run of `dataset` in runs_dir (one colour per method,
    line style per seed), and test accuracy against the certified epsilon where the run has one."""
    from runner.figures.style import finish, method_style, panels

    runs = []
    for summary in sorted(Path(runs_dir).glob("*/summary.json")):
        row = summarise(summary.parent)
        path = summary.parent / "metrics.csv"
        if row["dataset"] != dataset or not path.exists() or not path.stat().st_size:
            continue
        runs.append((row, pd.read_csv(path)))
    if not runs:
        return None
    cfg = runs[0][0]["config"]
    keys = ("model", "optimizer", "batch_size", "lr", "sigma", "clip", "delta")
    shared = [k for k in keys if all(r["config"].get(k) == cfg.get(k) for r, _ in runs)]
    own_lr = "lr" not in shared  # a method with its own learning rate (the non-private baseline): in its label
    lrs = {}
    for r, _ in runs:
        lrs.setdefault(r["config"].get("lr"), []).append(LABEL.get(r["method"], r["method"]))
    setting = ", ".join(f"{k}={cfg[k]}" for k in shared) + ("; lr: " + "; ".join(
        f"{lr} ({', '.join(dict.fromkeys(m))})" for lr, m in lrs.items()) if own_lr else "")
    epochs = "/".join(dict.fromkeys(r["epochs"].split("/")[-1] for r, _ in runs))  # as configured
    fig, (acc_ax, loss_ax, eps_ax) = panels(1, 3, f"{DATASET_NAME.get(dataset, dataset.upper())} reference runs, "
                                            f"{epochs} epochs: the JL paper's {OPTIMIZER_NAME.get(dataset, '')} "
                                            f"settings{', non-private at its own lr' if own_lr else ''}\n"
                                            f"{setting}", 4.6, 3.2)
    styles = ["-", "--", ":", "-."]
    infinite = []
    for row, m in runs:
        label = f"{LABEL.get(row['method'], row['method'])} seed {row['seed']}" + (
            f" (lr {row['config'].get('lr')})" if own_lr else "") + (
            "" if "delta" in shared else f" (delta {row['config'].get('delta')})")
        style = method_style(LABEL.get(row["method"], row["method"]))
        ls = styles[int(row["seed"] or 0) % len(styles)]
        acc_ax.plot(m["epoch"], m["test_acc"], ls=ls, label=label, ms=4, **style)
        loss_ax.plot(m["epoch"], m["train_loss"], ls=ls, ms=4, **style)
        eps = pd.to_numeric(m.get("epsilon", pd.Series(dtype=float)), errors="coerce")
        finite = eps.notna() & (eps < math.inf)
        if finite.any():
            eps_ax.plot(eps[finite], m["test_acc"][finite], ls=ls, ms=4, **style)
        elif row["method"] != "nonprivate":
            infinite.append(LABEL.get(row["method"], row["method"]))
    thr = THRESHOLD[dataset]
    for ax in (acc_ax, eps_ax):
        ax.axhline(thr, color="0.6", lw=0.8, ls=":")
    for value, text, method in PAPER_ACCURACY.get(dataset, []):
        color = method_style(LABEL.get(method, method))["color"]
        acc_ax.axhline(value, color=color, lw=0.8, ls="--", alpha=0.7)
        acc_ax.annotate(text, (0.02, value), xycoords=("axes fraction", "data"), xytext=(0, 3),
                        textcoords="offset points", fontsize=6.5, color=color)
    # a diverged run (MNIST non-private at DP-SGD's lr 0.25 fell to 11%) would squash every other curve: the axis
    # spans the runs' typical accuracies and the runs that leave it are named on the panel
    top = max(float(m["test_acc"].max()) for _, m in runs)
    medians = [float(m["test_acc"].median()) for _, m in runs]
    kept = [m for (_, m), v in zip(runs, medians) if v >= 0.5 * top] or [m for _, m in runs]  # not diverged
    low = max(0.0, min(min(float(m["test_acc"].min()) for m in kept), thr) - 0.02)
    acc_ax.set_ylim(low, 1.0)
    below = [f"{LABEL.get(r['method'], r['method'])} seed {r['seed']} ({m['test_acc'].min():.1%}, epoch "
             f"{int(m.loc[m['test_acc'].idxmin(), 'epoch'])})" for r, m in runs if m["test_acc"].min() < low]
    if below:
        acc_ax.text(0.02, 0.02, "below the axis:\n" + "\n".join(below), transform=acc_ax.transAxes, fontsize=6.5,
                    color="0.3")
    loss_ax.set_yscale("log")
    acc_ax.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy")
    loss_ax.set(xlabel="epoch", ylabel="training loss (mean over the epoch)", title="training loss")
    eps_ax.set(xlabel=f"certified epsilon (delta={cfg['delta']})" if "delta" in shared else
               "certified epsilon (at each run's delta: in its label)", ylabel="test accuracy",
               title="accuracy vs certified epsilon")
    if infinite:
        eps_ax.text(0.02, 0.02, "no certified epsilon (inf), not shown: " + ", ".join(sorted(set(infinite))),
                    transform=eps_ax.transAxes, fontsize=7, color="0.3")
    for ax in (acc_ax, loss_ax, eps_ax):
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(9)
    acc_ax.legend(fontsize=6.5, loc="lower right")
    devices = sorted({str(r["device"]) for r, _ in runs})
    return finish(fig, f"runs: {runs_dir} | device: {', '.join(devices)} | {len(runs)} runs | dotted line: "
                       f"{thr:.0%} (the JL paper's threshold)", top=0.84)


def import_runs(src: Path, dest: Path) -> list[str]:
    """Copy each <src>/<name>/{metrics.csv,summary.json} into <dest>/<name>/ (what git keeps of a reference run)."""
    import shutil

    names = []
    for summary in sorted(Path(src).glob("*/summary.json")):
        target = Path(dest) / summary.parent.name
        if target.resolve() == summary.parent.resolve():
            continue
        target.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.csv", "summary.json"):
            if (summary.parent / f).exists():
                shutil.copy2(summary.parent / f, target / f)
        names.append(summary.parent.name)
    return names


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runner.paper_runs", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the reference runs (sequentially), skipping finished ones")
    r.add_argument("--data-dir", required=True, help="folder holding mnist/ and imdb/ (docs/data.md)")
    r.add_argument("--out", default=str(OUT))
    r.add_argument("--device", default="auto")
    r.add_argument("--only", help="mnist | imdb | one run name")
    r.add_argument("--force", action="store_true")
    r.add_argument("--dry-run", action="store_true")
    w = sub.add_parser("readme", help="write the README tables from a folder of runs")
    w.add_argument("--runs", default=str(OUT), help="folder of <name>/{metrics.csv,summary.json}")
    w.add_argument("--out", default=str(README))
    w.add_argument("--import-to", metavar="DIR", help="first copy each run's metrics.csv + summary.json into "
                   f"DIR/<name>/ (e.g. {OUT}, to commit them) and write the README from there")
    w.add_argument("--probes", default=str(PROBES), help="folder of the IMDB setups tried (a table of its own)")
    w.add_argument("--import-probes", metavar="SRC", help="first copy the runs in SRC into --probes")
    w.add_argument("--lr-probes", default=str(LR_PROBES), help="folder of the learning rates tried for the "
                   "non-private MNIST run (a table of its own)")
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run_all(args.data_dir, Path(args.out), args.device, args.only, args.force, args.dry_run)
    if args.import_to:
        names = import_runs(Path(args.runs), Path(args.import_to))
        print(f"paper_runs: copied {len(names)} runs ({', '.join(names)}) into {args.import_to}")
        args.runs = args.import_to
    if args.import_probes:
        names = import_runs(Path(args.import_probes), Path(args.probes))
        print(f"paper_runs: copied {len(names)} probe runs into {args.probes}")
    rows = collect(Path(args.runs))
    probes = [r for r in collect(Path(args.probes)) if r["dataset"] == "imdb"] if Path(args.probes).is_dir() else []
    lr_probes = collect(Path(args.lr_probes)) if Path(args.lr_probes).is_dir() else []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(readme(rows, Path(args.runs), probes, Path(args.probes), lr_probes, Path(args.lr_probes)))
    print(f"paper_runs: {len(rows)} runs from {args.runs} -> {out}")
    for dataset in THRESHOLD:
        png = draw_curves(Path(args.runs), dataset, out.parent / f"{dataset}.png")
        if png:
            print(f"paper_runs: {dataset} curves -> {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
