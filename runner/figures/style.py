"""Shared drawing helpers: paper method labels, captions, log-scale bar/line panels, tables rendered as PNG.

    fig, axes = panels(1, 3, "Lee & Kifer Figure 6: execution time by batch size")
    line_panel(axes[0], data, x="batch_size", y="epoch_time_est_s", series="label", title="MLP")
    finish(fig, caption)
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

JL_LABELS = {"nonprivate": "Non-DP {opt}", "nxbp": "DP-{opt}-Vanilla", "opacus": "DP-{opt}-Outer",
             "multiloss": "DP-{opt}-Multiple", "reweight": "DP-{opt}-ReweightGP", "jl": "DP-{opt}-JL({r})",
             "sbcd": "DP-SBCD"}
LK_LABELS = {"nonprivate": "Non-private", "nxbp": "nxBP", "multiloss": "multiLoss", "reweight": "ReweightGP",
             "opacus": "Opacus", "jl": "JL({r})", "sbcd": "DP-SBCD"}
LK_ORDER = ["Non-private", "nxBP", "multiLoss", "ReweightGP"]


def jl_label(method: str, r, optimizer: str = "sgd") -> str:
    opt = "Adam" if str(optimizer).lower() == "adam" else "SGD"
    return JL_LABELS.get(method, method).format(opt=opt, r=int(r) if pd.notna(r) else "?")


def lk_label(method: str, r=None) -> str:
    return LK_LABELS.get(method, method).format(r=int(r) if pd.notna(r) else "?")


def caption_for(runs: pd.DataFrame, scale: str, computed: str | None = None) -> str:
    """One line under each figure: data source, device, scale, versions."""
    if computed:
        return f"computed ({computed}); no training | scale={scale}"
    def uniq(col):
        vals = sorted({str(v) for v in runs.get(col, pd.Series(dtype=object)).dropna()})
        return ", ".join(vals) if vals else "?"
    data = sorted({f"{d} ({'synthetic ' + str(l) + '-shaped' if d == 'synthetic' else s})"
                   for d, l, s in zip(runs.get("dataset", []), runs.get("like", []), runs.get("data_source", []))})
    capped = runs["max_steps_per_epoch"].notna().any() if "max_steps_per_epoch" in runs else False
    return (f"data: {', '.join(data) or '?'} | device: {uniq('device_name')} | scale={scale}"
            f"{' (steps capped; s/epoch estimated from the median step)' if capped else ''}"
            f" | torch {uniq('torch_version')} | {len(runs)} runs")


def series_color(name: str, order=None):
    """One colour per series across all panels of a figure (its position in `order`), so a panel that leaves a
    series out (the speed-up over nxBP, a missing bar) does not shift the colours of the others."""
    return f"C{list(order).index(name)}" if order and name in order else None


def plain_log_axis(axis):
    """Log-axis tick labels as plain numbers (0.3, 2, 10) rather than 3x10^-1 on crowded minor ticks."""
    from matplotlib import ticker

    class Plain(ticker.LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return f"{x:g}"

    axis.set_major_formatter(Plain(labelOnlyBase=False, minor_thresholds=(1.5, 0.6)))
    axis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(1.5, 0.6)))


def panels(rows: int, cols: int, title: str, width: float = 4.2, height: float = 3.4):
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.8), squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, axes.ravel()


def finish(fig, caption: str):
    fig.text(0.01, 0.005, caption, fontsize=7, color="0.35", ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    return fig


def bar_panel(ax, data: pd.DataFrame, x: str, y: str, series: str, title: str, order=None, log=True,
              ylabel="seconds per epoch"):
    """Grouped bars: one group per x value, one bar per series; a missing bar is marked n/a."""
    xs = list(dict.fromkeys(data[x]))
    names = order or list(dict.fromkeys(data[series]))
    names = [n for n in names if n in set(data[series])]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        sub = data[data[series] == name].set_index(x)[y]
        vals = [sub.get(v, float("nan")) for v in xs]
        pos = [j + (i - (len(names) - 1) / 2) * width for j in range(len(xs))]
        ax.bar(pos, vals, width, label=name, color=series_color(name, order))
        for p, v in zip(pos, vals):
            if pd.isna(v):
                ax.text(p, 0.02, "n/a", rotation=90, fontsize=6, ha="center", va="bottom", transform=ax.get_xaxis_transform())
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
    ax.grid(axis="y", alpha=0.3)


def line_panel(ax, data: pd.DataFrame, x: str, y: str, series: str, title: str, order=None, log=True,
               xlabel=None, ylabel="seconds per epoch"):
    names = [n for n in (order or list(dict.fromkeys(data[series]))) if n in set(data[series])]
    for name in names:
        sub = data[data[series] == name].sort_values(x)
        ax.plot(sub[x], sub[y], marker="o", label=name, color=series_color(name, order))
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
    ax.grid(alpha=0.3)


def table_figure(data: pd.DataFrame, title: str, caption: str, col_width: float = 1.6):
    """A table rendered as an image (the CSV next to it holds the full-precision numbers)."""
    shown = data.map(lambda v: "" if pd.isna(v) else (f"{v:.3g}" if isinstance(v, float) else str(v)))
    fig, ax = plt.subplots(figsize=(max(6.0, col_width * len(shown.columns)), 0.45 * len(shown) + 1.4))
    ax.axis("off")
    tab = ax.table(cellText=shown.values, colLabels=list(shown.columns), loc="center", cellLoc="center")
    tab.auto_set_font_size(False)
    tab.set_fontsize(8)
    tab.scale(1, 1.3)
    ax.set_title(title, fontsize=11)
    return finish(fig, caption)
