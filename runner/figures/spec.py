"""A paper table or figure: which preset's runs it reads, how those runs become its data table, how it is drawn.

    FIGURES.register("jl_table2")(Figure("JL", "Seconds per epoch, ...", "table", "jl_table2", table2, draw2))
    fig = FIGURES.get("jl_table2")
    data = fig.table(runs, epochs, "smoke")     # the report's tables -> the figure's own (written as CSV)
    mpl_figure = fig.draw(data, caption, "smoke")  # matplotlib Figure (saved as PNG + PDF by runner.plots)

`experiment` names the conf/experiment preset whose runs the figure reads (several figures may share one preset:
JL Figure 4 reads Table 2's runs). `experiment=None` marks a computed figure (scipy, an accountant, the DP-SBCD
bound): no training; `table` then ignores the runs. The registry key is the figure's name (`make fig-<name>`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import pandas as pd

from runner.registry import Registry

FIGURES = Registry("figure")

TableFn = Callable[[pd.DataFrame, pd.DataFrame, str], pd.DataFrame]  # (runs, per-epoch rows, scale) -> data
DrawFn = Callable[[pd.DataFrame, str, str], "object"]  # (data, caption, scale) -> matplotlib.figure.Figure


@dataclass(frozen=True)
class Figure:
    paper: str  # "JL" | "L&K" | "DP-SBCD"
    title: str  # the paper's caption, shortened
    kind: str  # "figure" | "table"
    experiment: Optional[str]  # conf/experiment preset whose runs it reads; None = computed, no training
    table: TableFn
    draw: DrawFn
    gpu_only: bool = False
    keep_failed: bool = False  # the figure reads failed runs too (the memory study: the first batch that failed)
    study: Optional[str] = None  # a module run instead of the preset's grid: python -m <study> --scale S -- args


def newest_per(runs: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """One run per point of the figure (keys): the newest finished one. The report's latest() keeps one run per
    full configuration, so runs of an older preset version (other max_steps_per_epoch, warm-up) or a rerun with an
    extra override would otherwise stand for the same bar or line point twice."""
    if runs.empty:
        return runs
    keys = [k for k in keys if k in runs]
    order = runs.sort_values("finished_at", kind="stable") if "finished_at" in runs else runs
    return order.groupby(keys, dropna=False, sort=False).tail(1).sort_index()


def seconds_per_epoch(runs: pd.DataFrame) -> pd.Series:
    """The estimated seconds of a full epoch: median step time (warm-up steps excluded) x expected steps per epoch
    (`epoch_time_est_s`), the same for capped and full epochs and the same as the JL trajectories' time axis; the
    measured mean epoch time only where a run has no step times."""
    est = runs["epoch_time_est_s"] if "epoch_time_est_s" in runs else pd.Series(float("nan"), index=runs.index)
    mean = runs["mean_epoch_time_s"] if "mean_epoch_time_s" in runs else pd.Series(float("nan"), index=runs.index)
    return est.where(est.notna(), mean)


def threshold(paper_value: float, observed: pd.Series, scale: str) -> tuple[float, str]:
    """The paper's fixed accuracy / time / epsilon at scale=paper; at smoke (short runs on small or synthetic data,
    where the paper's value is out of reach) the median of the runs, so the panel still compares the methods."""
    if scale == "paper" or observed.dropna().empty:
        return paper_value, f"{paper_value:g}"
    value = float(observed.dropna().median())
    return value, f"{value:.3g} (smoke: median of the runs; paper {paper_value:g})"
