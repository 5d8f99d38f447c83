"""Shared drawing helpers: paper method labels, captions, log-scale bar/line panels, tables rendered as PNG.

    fig, axes = panels(1, 3, "Lee & Kifer Figure 6: execution time by batch size")
    line_panel(axes[0], data, x="batch_size", y="epoch_time_est_s", series="label", title="MLP")
    finish(fig, caption)
"""
from __future__ import annotations

import math

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


# One colour and marker per method in every figure (both papers' names map to the same key). JL arms get one colour
# per r. Epsilon, where a figure encodes it as colour, fills the marker; the method keeps its edge colour and shape.
METHOD_STYLE = {
    "nonprivate": ("#444444", "o"), "nxbp": ("#d62728", "s"), "opacus": ("#8c564b", "D"),
    "multiloss": ("#ff7f0e", "v"), "reweight": ("#2ca02c", "P"), "sbcd": ("#e377c2", "*"),
    "jl(1)": ("#1f77b4", "^"), "jl(2)": ("#4e9ad0", "^"), "jl(4)": ("#17becf", "^"), "jl(6)": ("#6b8fd6", "^"),
    "jl(8)": ("#3d5a99", "^"), "jl(10)": ("#9467bd", "^"), "jl(20)": ("#5c3d8f", "^"), "jl(30)": ("#bcbd22", "^"),
}
INF_EDGE = "black"  # the edge of a marker whose epsilon is inf (no finite guarantee): no method has this colour
_ALIASES = {"non": "nonprivate", "nxbp": "nxbp", "vanilla": "nxbp", "outer": "opacus", "opacus": "opacus",
            "multiloss": "multiloss", "multiple": "multiloss", "reweight": "reweight", "sbcd": "sbcd"}


def delta_tex(data: pd.DataFrame) -> str:
    """The delta the runs' epsilons are at, for a label: "$\\delta=10^{-5}$" (review 43: a figure wrote a hard-coded
    10^-5 beside a run's epsilon at delta 0.01). Runs at several deltas in one epsilon scale are refused in one line
    (runner/plots.py same_settings keeps one unless a preset sweeps it); none known (every run non-private): ""."""
    from runner.errors import DprunError

    deltas = sorted({float(d) for d in pd.to_numeric(data.get("delta", pd.Series(dtype=float)), errors="coerce")
                     if pd.notna(d)})
    if len(deltas) > 1:
        raise DprunError(f"the runs' epsilons are at different deltas ({', '.join(f'{d:g}' for d in deltas)}): one "
                         f"epsilon axis cannot show them; draw the runs of one delta")
    if not deltas:
        return ""
    exponent = math.log10(deltas[0])
    if deltas[0] > 0 and exponent == round(exponent):
        return f"$\\delta=10^{{{int(round(exponent))}}}$"
    return f"$\\delta$={deltas[0]:g}"


def epsilon_tex(data: pd.DataFrame) -> str:
    """An epsilon axis's label: "$\\epsilon$ ($\\delta=10^{-5}$)", or "$\\epsilon$" where no run has a delta."""
    delta = delta_tex(data)
    return f"$\\epsilon$ ({delta})" if delta else "$\\epsilon$"


def method_key(label: str) -> str | None:
    """The METHOD_STYLE key of a series label in either paper's naming ("DP-SGD-JL(10)", "JL(10)", "nxBP",
    "DP-Adam-Vanilla", "Non-private", "Non-DP SGD"), or None for a series that is not a method."""
    low = str(label).lower()
    if "jl(" in low:
        return "jl(" + low.split("jl(")[-1].split(")")[0] + ")"
    for key, name in _ALIASES.items():
        if key in low.replace("-", "").replace(" ", "") or (key == "non" and low.startswith("non")):
            return name
    return None


def method_style(label: str) -> dict:
    """matplotlib keywords (color, marker) of a method label; a grey dot for anything unknown."""
    color, marker = METHOD_STYLE.get(method_key(label) or "", ("0.5", "."))
    return {"color": color, "marker": marker}


def jl_label(method: str, r, optimizer: str = "sgd") -> str:
    opt = "Adam" if str(optimizer).lower() == "adam" else "SGD"
    return JL_LABELS.get(method, method).format(opt=opt, r=int(r) if pd.notna(r) else "?")


def lk_label(method: str, r=None) -> str:
    return LK_LABELS.get(method, method).format(r=int(r) if pd.notna(r) else "?")


def caption_for(runs: pd.DataFrame, scale: str, computed: str | None = None) -> str:
    """One line under each figure: data source, device, scale, versions."""
    if computed:
        return f"computed ({computed}){'' if 'trained' in computed else '; no training'} | scale={scale}"
    def uniq(col):
        vals = sorted({str(v) for v in runs.get(col, pd.Series(dtype=object)).dropna()})
        return ", ".join(vals) if vals else "?"
    data = sorted({f"{d} ({'synthetic ' + str(l) + '-shaped' if d == 'synthetic' else s})"
                   for d, l, s in zip(runs.get("dataset", []), runs.get("like", []), runs.get("data_source", []))})
    capped = runs["max_steps_per_epoch"].notna().any() if "max_steps_per_epoch" in runs else False
    return (f"data: {', '.join(data) or '?'} | device: {uniq('device_name')} | scale={scale}"
            f"{' (steps capped; s/epoch estimated from the median step)' if capped else ''}"
            f" | torch {uniq('torch_version')} | {len(runs)} runs")


# What ran, in a figure's title: the model and the data named from the run's own columns (never the paper's setting)
MODEL_NAMES = {"bu_cnn": "2-layer CNN (bu_cnn)", "mlp": "MLP", "cnn": "CNN", "papernot_cnn": "Papernot et al. CNN",
               "papernot_cnn_fc": "Papernot et al. CNN (FC)", "bilstm": "BiLSTM", "rnn": "RNN", "lstm": "LSTM",
               "gru": "GRU", "transformer": "Transformer", "vgg11": "VGG-11", "vgg13": "VGG-13", "vgg16": "VGG-16",
               "resnet18": "ResNet-18", "resnet34": "ResNet-34", "resnet50": "ResNet-50", "resnet101": "ResNet-101"}
DATA_NAMES = {"mnist": "MNIST", "fmnist": "FMNIST", "cifar10": "CIFAR-10", "imdb": "IMDB", "lsun": "LSUN",
              "digits": "digits (scikit-learn 8x8)"}


def values(data: pd.DataFrame, col: str) -> list[str]:
    """The distinct values of a column as text (1.0 -> 1), empty where the column is absent or all NaN."""
    if col not in data:
        return []
    out = []
    for v in data[col].dropna():
        text = f"{v:g}" if isinstance(v, float) else str(v)
        if text not in out:
            out.append(text)
    return out


def model_name(data: pd.DataFrame, col: str = "model") -> str:
    return "/".join(MODEL_NAMES.get(m, m) for m in values(data, col)) or "?"


def data_name(data: pd.DataFrame, synthetic_note: str = " (random labels)") -> str:
    """'real MNIST', 'synthetic CIFAR-10-shaped data (random labels)' from the dataset / like (/ data_source)
    columns of a figure's table."""
    names = []
    sources = values(data, "data_source")
    for ds in values(data, "dataset") or values(data, "data"):
        if ds == "synthetic":
            likes = [DATA_NAMES.get(x, x) for x in values(data, "like")] or ["?"]
            names.append(f"synthetic {'/'.join(likes)}-shaped data{synthetic_note}")
        elif sources == ["synthetic"]:
            names.append(f"synthetic {DATA_NAMES.get(ds, ds)}-shaped data{synthetic_note}")
        else:
            names.append(f"real {DATA_NAMES.get(ds, ds)}")
    return ", ".join(names) or "?"


def series_color(name: str, order=None):
    """The method's colour from METHOD_STYLE (the same in every figure and panel)."""
    return method_style(name)["color"]


def plain_log_axis(axis):
    """Log-axis tick labels as plain numbers at 1, 2 and 5 x 10^k (0.2, 0.5, 1, 2, 5, 10), never crowded minor
    labels or 3x10^-1; unlabelled minor ticks stay."""
    from matplotlib import ticker

    def label(x, _):
        """Over more than 2.5 decades only the powers of ten are labelled (2 and 5 x 10^k would crowd them)."""
        lo, hi = sorted(axis.get_view_interval())
        if x <= 0 or lo <= 0:
            return f"{x:g}"
        mantissa = x / 10 ** math.floor(math.log10(x) + 1e-9)
        return "" if math.log10(hi / lo) > 2.5 and abs(mantissa - 1) > 1e-6 else f"{x:g}"

    axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(label))
    axis.set_minor_locator(ticker.LogLocator(base=10, subs=tuple(range(1, 10))))
    axis.set_minor_formatter(ticker.NullFormatter())


def method_legend(fig, axes, **kw):
    """One legend for the whole figure holding every labelled series of every panel (each method once), so a
    panel that leaves a method out never leaves its colour unexplained."""
    seen = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(list(seen.values()), list(seen.keys()), loc="lower center", ncol=min(len(seen), 6), fontsize=8,
                   bbox_to_anchor=(0.5, 0.045), frameon=False, **kw)
        fig._dprun_legend_below = True  # finish() leaves room for it
    return seen


def panels(rows: int, cols: int, title: str, width: float = 4.2, height: float = 3.4):
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.8), squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, axes.ravel()


def finish(fig, caption: str, top: float = 0.95):
    """Caption line at the bottom; `top` leaves room for the title (and a figure legend: method_legend)."""
    fig.text(0.01, 0.005, caption, fontsize=7, color="0.35", ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.13 if getattr(fig, "_dprun_legend_below", False) else 0.05, 1, top))
    return fig


def dominated(values) -> bool:
    """True where one value dominates the others (max / min > 10): a log axis then shows them all."""
    v = pd.to_numeric(pd.Series(list(values)), errors="coerce")
    v = v[(v > 0) & v.notna()]
    return len(v) > 1 and float(v.max() / v.min()) > 10


def bar_panel(ax, data: pd.DataFrame, x: str, y: str, series: str, title: str, order=None, log=None,
              ylabel="seconds per epoch"):
    """Grouped values: one group per x value, one per series; a missing value is marked n/a. Linear bars from zero,
    unless one value dominates (log=None: max/min > 10) or log=True: then a log axis with markers only, since a bar
    on a log axis has no baseline and its length misstates the ratio."""
    xs = list(dict.fromkeys(data[x]))
    names = order or list(dict.fromkeys(data[series]))
    names = [n for n in names if n in set(data[series])]
    log = dominated(data[y]) if log is None else log
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        sub = data[data[series] == name].set_index(x)[y]
        vals = [sub.get(v, float("nan")) for v in xs]
        pos = [j + (i - (len(names) - 1) / 2) * width for j in range(len(xs))]
        style = method_style(name)
        if log:
            ax.scatter(pos, vals, s=36, label=name, zorder=3, **style)
            ax.vlines(pos, [v * 0.92 if pd.notna(v) else float("nan") for v in vals], vals, color=style["color"],
                      lw=0.6, alpha=0.5)
        else:
            ax.bar(pos, vals, width, label=name, color=style["color"])
        for p, v in zip(pos, vals):
            if pd.isna(v):
                ax.text(p, 0.02, "n/a", rotation=90, fontsize=6, ha="center", va="bottom", transform=ax.get_xaxis_transform())
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel + (" (log)" if log else ""))
    if log:
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
        ax.grid(axis="y", which="both", alpha=0.3)
    else:
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)


def line_panel(ax, data: pd.DataFrame, x: str, y: str, series: str, title: str, order=None, log=None,
               xlabel=None, ylabel="seconds per epoch"):
    """One line per series in its method style; a log y axis where one value dominates (log=None) or log=True."""
    names = [n for n in (order or list(dict.fromkeys(data[series]))) if n in set(data[series])]
    for name in names:
        sub = data[data[series] == name].sort_values(x)
        ax.plot(sub[x], sub[y], label=name, **method_style(name))
    log = dominated(data[y]) if log is None else log
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel or x)
    ax.set_ylabel(ylabel + (" (log)" if log else ""))
    if log:
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
    else:
        ax.set_ylim(bottom=0, top=max(1e-12, float(pd.to_numeric(data[y], errors="coerce").max()) * 1.08))
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
