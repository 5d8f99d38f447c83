"""Draw the papers' tables and figures from dprun-report's tables: never runs training.

    dprun-report --quiet && dprun-report --epochs --quiet      # outputs/tables/runs.csv, runs_epochs.csv
    python -m runner.plots jl_table2 lk_fig6 --scale smoke     # -> outputs/figures/<name>.png/.pdf,
                                                               #    outputs/tables/<name>.csv (the figure's data)
    python -m runner.plots --all --scale paper
    python -m runner.plots --list

A figure whose preset has no finished runs at this scale is skipped with a one-line note; nothing is drawn from
made-up numbers.
Computed figures (JL Table 1 and Figure 2, epsilon vs r, the DP-SBCD curves) need no runs.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from runner.entry import OneLineParser, run_entry
from runner.figures import FIGURES
from runner.figures.style import caption_for
from runner.report import RUN_KEY, latest

COMPUTED_WITH = {"jl_table1": "the method registry", "jl_fig2": "scipy.stats.chi", "jl_fig7": "dprun's jl accountant",
                 "jl_table4": "runner.bench on this machine",
                 "jl_epsilon_r": "dprun's jl and pld accountants",
                 "sbcd_adaptive_noise": "runner.sbcd_curves; utility: one DP-SBCD run per schedule trained here, CPU"}


def read_table(path: Path) -> pd.DataFrame:
    if not path.exists() or path.stat().st_size == 0:
        return pd.DataFrame()
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def select_runs(runs: pd.DataFrame, experiment: str, scale: str, keep_failed: bool = False,
                notes: list[str] | None = None) -> pd.DataFrame:
    """The preset's runs at this scale: the newest finished run of each configuration, plus (keep_failed) the newest
    unfinished one of each configuration that never finished (out of memory, killed); then only the runs that share
    the figure's settings (same_settings). notes: gets one line naming the runs left out, if any."""
    if runs.empty or "experiment" not in runs:
        return runs
    mine = runs[(runs["experiment"] == experiment) & (runs["scale"] == scale)]
    done = latest(mine)
    if keep_failed and not mine.empty:
        keys = [k for k in RUN_KEY if k in mine]
        unfinished = mine[mine["status"] != "finished"].sort_values("finished_at")
        unfinished = unfinished.groupby(keys, dropna=False, sort=False).tail(1)
        finished_keys = set(map(tuple, done[keys].astype(str).values)) if len(done) else set()
        unfinished = unfinished[[tuple(k) not in finished_keys for k in unfinished[keys].astype(str).values]]
        done = pd.concat([done, unfinished], ignore_index=True)
    kept, note = same_settings(done, swept_columns(experiment, scale))
    if note and notes is not None:
        notes.append(note)
    return kept


# What a figure's arms must share unless its preset sweeps it. The figures pick the newest run per arm, so without
# this a later one-off run of the preset (`dprun experiment=jl_fig3 method=opacus epochs=1`) would silently stand in
# for an arm of the sweep. Not lr: presets give a method its own rate (scales.<scale>.lr_<method>).
SHARED = ["dataset", "like", "image_size", "model", "depth", "batch_size", "sigma", "clip", "optimizer", "epochs",
          "max_steps_per_epoch", "seed", "device", "delta", "sampling", "accountant"]  # delta..: what an epsilon means
# ... compared only between runs of the same method (a column per method): the accountant goes with the method (jl
# for JL, pld for exact clipping), and comparing it across arms left every figure with one of them only (review 66:
# JL figures 1, 3, 4 and Table 2 lost DP-SGD-Outer and -Vanilla)
PER_METHOD = {"accountant"}
PRESET_KEYS = {"data": "dataset"}  # a preset's own variable -> the config key it sets (conf/experiment/*.yaml)


def swept_columns(experiment: str, scale: str) -> set[str]:
    """The SHARED columns the preset's sweeps vary (its grid and its extra_sweeps), e.g. model and depth for
    `model.depth: 2,4,6,8`; they may differ between a figure's arms. An unknown preset: all of them (no check)."""
    from omegaconf import OmegaConf

    from runner.paths import CONF_DIR
    from runner.report import CONFIG_COLUMNS

    path = Path(CONF_DIR) / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        return set(SHARED)
    preset = OmegaConf.load(path)
    preset.scale = scale  # extra_sweeps may be ${scales.${scale}.extra}
    keys = set(OmegaConf.select(preset, "hydra.sweeper.params", default=None) or {})
    for extra in OmegaConf.select(preset, "extra_sweeps", default=None) or []:
        keys |= {arg.partition("=")[0] for arg in str(extra).split()}
    keys = {PRESET_KEYS.get(k, k) for k in keys}
    return {col for col, dotted in CONFIG_COLUMNS
            if col in keys or any(dotted == k or dotted.startswith(k + ".") for k in keys)}


def same_settings(runs: pd.DataFrame, swept: set[str]) -> tuple[pd.DataFrame, str]:
    """The runs that share every SHARED setting not in swept with the largest such set (the newest on a tie: a
    whole preset run again with other settings), and a line naming the runs left out and how they differ ('' if
    none). A blank is no setting (a non-private run has no sigma) and fits any value."""
    cols = [c for c in SHARED if c in runs and c not in swept]
    if len(runs) < 2 or not cols:
        return runs, ""
    runs = runs.reset_index(drop=True)
    newest = runs["finished_at"].rank(method="first") if "finished_at" in runs else pd.Series(runs.index)
    methods = runs["method"].fillna("").astype(str) if "method" in runs else pd.Series("", index=runs.index)
    # a PER_METHOD setting as (method, value), one column per method: runs of two methods never differ in it
    per_method = [c for c in cols if c in PER_METHOD]
    cols = [c for c in cols if c not in PER_METHOD] + [f"{c}@{m}" for c in per_method for m in sorted(set(methods))]
    runs_ = runs.assign(**{f"{c}@{m}": runs[c].where(methods == m) for c in per_method for m in set(methods)})
    sig = [tuple(None if pd.isna(v) else v for v in row) for row in runs_[cols].itertuples(index=False)]

    def same(x, y) -> bool:
        return x is None or y is None or x == y

    def fits(a: tuple, b: tuple) -> bool:
        return all(same(x, y) for x, y in zip(a, b))

    counts = [sum(fits(a, b) for b in sig) for a in sig]
    best = max(range(len(sig)), key=lambda i: (counts[i], newest[i]))
    # the reference's own blanks take the value most of its runs have, so it never joins two values of a setting; on a
    # tie, the newest run's (review 69: pandas' mode took the value that sorts first: an older one-off's accountant)
    def filled(j: int):
        votes: dict = {}
        for i, s in enumerate(sig):
            if s[j] is not None and fits(s, sig[best]):
                count, latest_seen = votes.get(s[j], (0, -1))
                votes[s[j]] = (count + 1, max(latest_seen, newest[i]))
        return max(votes, key=votes.get) if votes else None

    ref = tuple(v if v is not None else filled(j) for j, v in enumerate(sig[best]))
    keep = [fits(s, ref) for s in sig]
    if all(keep):
        return runs, ""
    left = runs[[not k for k in keep]]
    names = list(left["folder"] if "folder" in left else left["run_dir"])
    differ = sorted({f"{c.replace('@', ' of ')}={s[j]} (figure: {ref[j]})" for s, k in zip(sig, keep) if not k
                     for j, c in enumerate(cols) if not same(s[j], ref[j])})
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    note = (f"left out {len(names)} run(s) with other settings than the figure's {sum(keep)}: "
            f"{'; '.join(differ)}: {shown}")
    return runs[keep], note


def render(name: str, runs: pd.DataFrame, epochs: pd.DataFrame, scale: str, out_dir: Path, tables_dir: Path,
           formats: tuple[str, ...] = ("png", "pdf")):
    """Draw one figure (as PNG and PDF); return the PNG path, or a string saying why it was skipped."""
    fig = FIGURES.get(name)
    if fig.gpu_only and not _cuda() and (runs.empty or "experiment" not in runs
                                         or not (runs["experiment"] == fig.experiment).any()):
        # not run here: the PNG and CSV still exist and say so (with the paper's numbers), so a CPU `make figures`
        # lists every target; nothing of ours is drawn
        print(f"plots: {name}: GPU only (largest batch before out-of-memory) and no CUDA here: not run; "
              f"its PNG/CSV say so and show the paper's numbers only", flush=True)
        runs = runs.iloc[0:0]
        caption = (f"{fig.paper}: NOT RUN: GPU only, and CUDA is not available on this machine "
                   f"(make fig-{name} SCALE=paper on a GPU) | paper numbers only | scale={scale}")
        return _save(name, fig, fig.table(runs, epochs.iloc[0:0], scale), caption, scale, out_dir, tables_dir,
                     formats)
    if fig.experiment:
        notes: list[str] = []
        runs = select_runs(runs, fig.experiment, scale, fig.keep_failed, notes)
        if runs.empty:
            return (f"skip {name}: no finished runs of experiment={fig.experiment} at scale={scale} "
                    f"(make fig-{name} SCALE={scale})")
        epochs = epochs[epochs["run_dir"].isin(set(runs["run_dir"]))] if not epochs.empty else epochs
        caption = f"{fig.paper}: " + caption_for(runs, scale) + "".join(f" | {n}" for n in notes)
        for note in notes:  # on the figure (its caption) and here: a missing arm is never silent
            print(f"plots: {name}: {note}", file=sys.stderr, flush=True)
    else:
        caption = f"{fig.paper}: " + caption_for(runs, scale, COMPUTED_WITH.get(name, "runner.sbcd_curves"))
    return _save(name, fig, fig.table(runs, epochs, scale), caption, scale, out_dir, tables_dir, formats)


def _save(name, fig, data: pd.DataFrame, caption: str, scale: str, out_dir: Path, tables_dir: Path,
          formats: tuple[str, ...]) -> Path:
    import matplotlib.pyplot as plt

    tables_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    data.to_csv(tables_dir / f"{name}.csv", index=False)
    figure = fig.draw(data, caption, scale)
    for fmt in formats:
        figure.savefig(out_dir / f"{name}.{fmt}", dpi=110, bbox_inches="tight")
    plt.close(figure)
    save_caption(tables_dir, name, scale, caption)
    return out_dir / f"{name}.png"


def save_caption(tables_dir: Path, name: str, scale: str, caption: str) -> None:
    """<tables_dir>/captions.csv: the caption drawn under each figure (one row per name), so that a copy of the
    figure's CSV can be drawn again with it (python -m runner.figures.reference_readme --import / --redraw)."""
    path = tables_dir / "captions.csv"
    old = read_table(path)
    row = pd.DataFrame([{"name": name, "scale": scale, "caption": caption}])
    keep = old[old["name"] != name] if "name" in old else old.iloc[0:0]
    pd.concat([keep, row], ignore_index=True).sort_values("name").to_csv(path, index=False)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m runner.plots", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="figure names (see --list)")
    p.add_argument("--all", action="store_true", help="every registered table and figure")
    p.add_argument("--tables-only", action="store_true", help="with --all: only the tables")
    p.add_argument("--list", action="store_true", help="list the figures and the preset each reads")
    p.add_argument("--scale", default="smoke", choices=["smoke", "paper"])
    p.add_argument("--tables", default="outputs/tables", help="where dprun-report wrote runs.csv, runs_epochs.csv")
    p.add_argument("--out", default="outputs/figures")
    args = p.parse_args(argv)
    if args.list:
        from runner.figures.gpu_time import PAPER_GPU_HOURS, estimate

        print("name                       kind   preset       paper: title\n"
              "                           GPU time at scale=paper (estimate; basis: runner/figures/gpu_time.py)")
        for name, fig in FIGURES.items():
            print(f"{name:26s} {fig.kind:6s} {fig.experiment or '(computed)':12s} {fig.paper}: {fig.title}")
            print(f"{'':26s} {estimate(name)}")
        total = sum(h for n, (h, _) in PAPER_GPU_HOURS.items() if n in FIGURES.names())
        print(f"total at scale=paper: ~{total:.0f} GPU hours (L&K Figures 5-7 at the paper's 100 epochs are "
              f"{sum(PAPER_GPU_HOURS[n][0] for n in ('lk_fig5', 'lk_fig6', 'lk_fig7')):.0f} h of it; "
              "SWEEP_ARGS=epochs=5 cuts them to about 11 h)")
        return 0
    names = FIGURES.names() if args.all else args.names
    if args.tables_only:
        names = [n for n in names if FIGURES.get(n).kind == "table"]
    if not names:
        p.error("name a figure (see --list) or pass --all")
    tables = Path(args.tables)
    runs, epochs = read_table(tables / "runs.csv"), read_table(tables / "runs_epochs.csv")
    failed = 0
    for name in names:
        try:
            result = render(name, runs, epochs, args.scale, Path(args.out), tables)
        except Exception as e:  # one figure's failure must not hide the others
            print(f"plots: {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"plots: {result}" if isinstance(result, str) else f"plots: {name} -> {result}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_entry(main, "python -m runner.plots"))
