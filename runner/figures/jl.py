"""The JL paper's tables and figures (jl-projections-dpsgd): Table 1 (method summary from the registries),
Figure 2 (distribution of sqrt(chi^2_r / r)), Figure 3 (MNIST), Table 2 and Figure 4 (CIFAR-10), Table 3 and
Figures 5-6 (IMDB), and the epsilon-vs-r figure of appendix C (from the JL accountant).

    python -m runner.plots jl_table2 --scale smoke      # after: make fig-jl_table2 (sweep + dprun-report)
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

from runner.epsilon_shown import shown_epsilon
from runner.figures.spec import FIGURES, Figure, newest_per, seconds_per_epoch, threshold
from runner.figures.style import (INF_EDGE, data_name, epsilon_tex, finish, jl_label, method_legend, method_style,
                                  model_name, panels, plain_log_axis, table_figure, values)

# The paper's seconds per epoch (Tesla P100), placed next to ours in Tables 2 and 3.
PAPER_TABLE2 = {"Non-DP SGD": (12, 2.5), "DP-SGD-Vanilla": (None, 434), "DP-SGD-Outer": (17, None),
                "DP-SGD-JL(1)": (78, 6.6), "DP-SGD-JL(10)": (657, 38)}  # (PyTorch, TensorFlow)
PAPER_TABLE5 = {"Non-DP SGD": (13, 12), "DP-SGD-Vanilla": (None, 1625), "DP-SGD-Outer": ("out of memory", None),
                "DP-SGD-JL(1)": (212, 20), "DP-SGD-JL(10)": (1946, 106)}  # VGG13, (PyTorch, TensorFlow)
PAPER_TABLE3 = {"Non-DP Adam": 12, "DP-Adam-Vanilla": 13931, "DP-Adam-JL(1)": 38, "DP-Adam-JL(4)": 100,
                "DP-Adam-JL(10)": 243, "DP-Adam-JL(30)": 669}
# Table 1 of the paper: (privacy, speed, memory, generalizability), by our method name
PAPER_TABLE1 = {"nonprivate": ("Non-DP SGD", "✗✓✓✓"), "nxbp": ("DP-SGD-Vanilla", "✓✗✓✓"),
                "multiloss": ("DP-SGD-Multiple", "✓✓✗✓"), "opacus": ("DP-SGD-Outer", "✓✓✓✗"),
                "jl": ("DP-SGD-JL", "✓✓✓✓")}
FIG2_R = (1, 2, 5, 10, 20, 50)


def labelled(runs: pd.DataFrame) -> pd.DataFrame:
    out = runs.copy()
    out["label"] = [jl_label(m, r, o) for m, r, o in zip(out["method"], out["r"], out["optimizer"])]
    return out


def one_run_per_label(runs: pd.DataFrame) -> pd.DataFrame:
    """The newest run of each method label (a rerun with other settings must not draw a second line)."""
    return newest_per(labelled(runs), ["label"]) if len(runs) else runs


def label_order(label: str) -> tuple:
    """Non-DP, Vanilla, Outer, then JL by r."""
    for i, key in enumerate(("Non-DP", "Vanilla", "Multiple", "Outer", "ReweightGP")):
        if key in label:
            return (i, 0)
    return (9, int(label.split("(")[-1].rstrip(")"))) if "JL(" in label else (10, 0)


# -- Table 1 ---------------------------------------------------------------------------------------------------
def table1(runs, epochs, scale) -> pd.DataFrame:
    from runner import accountants, methods  # noqa: F401  (accountants: the registry the column reads)

    rows = []
    for name, cls in methods.METHODS.items():
        paper_name, marks = PAPER_TABLE1.get(name, ("", "    "))
        rows.append({"method": name, "paper name": paper_name, "private": "✓" if cls.private else "✗",
                     "exact norms": "✓" if cls.exact else "✗", "accountant": cls.default_accountant,
                     "paper: priv/speed/mem/gen": " ".join(marks).strip(), "summary": cls.summary})
    return pd.DataFrame(rows)


def draw_table1(data, caption, scale):
    fig = table_figure(data.drop(columns=["summary"]), "JL paper Table 1: summary of methods for DP training",
                       caption + " | from the method registry (Method.summary in the CSV)", col_width=1.9)
    return fig


# -- Figure 2 --------------------------------------------------------------------------------------------------
def fig2(runs, epochs, scale) -> pd.DataFrame:
    x = np.linspace(0.0, 3.0, 601)
    rows = []
    for r in FIG2_R:
        # Y = sqrt(chi2_r / r) = chi_r / sqrt(r): density sqrt(r) * chi.pdf(sqrt(r) * y; r)
        dens = np.sqrt(r) * stats.chi.pdf(np.sqrt(r) * x, r)
        rows.append(pd.DataFrame({"r": r, "x": x, "density": dens}))
    return pd.concat(rows, ignore_index=True)


def draw_fig2(data, caption, scale):
    fig, (ax,) = panels(1, 1, r"JL paper Figure 2: distribution of $\sqrt{\chi^2_r / r}$ for different r", 6, 4)
    for r, sub in data.groupby("r"):
        ax.plot(sub["x"], sub["density"], label=f"r={r}")
    ax.set_xlabel(r"$\sqrt{\chi^2_r / r}$  (estimated norm / true norm)")
    ax.set_ylabel("density")
    ax.set_ylim(0, min(4.0, data["density"].max() * 1.05))
    ax.legend()
    ax.grid(alpha=0.3)
    return finish(fig, caption)


# -- accuracy / time / epsilon figures (3, 4, 5) -------------------------------------------------------------
CLASSES = {"mnist": 10, "fmnist": 10, "cifar10": 10, "imdb": 2, "digits": 10, "lsun": 10}


def trajectories(runs, epochs, scale) -> pd.DataFrame:
    """One row per run and epoch: label, cumulative training time, test accuracy, epsilon, and what ran (data, model,
    B, sigma). The time is the tables' estimate (runner.figures.spec.seconds_per_epoch): each epoch's median step time
    (warm-up excluded) x the expected steps per epoch, so a first epoch that carries the process warm-up, or a capped
    epoch, is not misplaced on the time axis."""
    cols = ["label", "method", "r", "epoch", "time_s", "test_acc", "epsilon", "run_dir", "dataset", "like", "model",
            "batch_size", "sigma", "lr", "delta", "time_basis"]
    if epochs.empty:
        return pd.DataFrame(columns=cols)
    runs = one_run_per_label(runs)
    ep = epochs[epochs["run_dir"].isin(set(runs["run_dir"]))].sort_values(["run_dir", "epoch"]).copy()
    info = runs.set_index("run_dir")
    full_steps = 1.0 / pd.to_numeric(info.get("sample_rate", pd.Series(dtype=float)), errors="coerce")
    if "step_time_s" in ep:
        est = ep["step_time_s"] * ep["run_dir"].map(full_steps)
        ep["epoch_s"] = est.where(est.notna(), ep["epoch_time_s"])
    else:
        ep["epoch_s"] = ep["epoch_time_s"]
    ep["time_s"] = ep.groupby("run_dir")["epoch_s"].cumsum()
    ep["time_basis"] = "estimated"
    for col in ("dataset", "like", "model", "batch_size", "sigma", "lr", "delta"):
        if col not in ep or ep[col].isna().all():
            ep[col] = ep["run_dir"].map(info[col]) if col in info else None
    ep = labelled(ep)
    return ep[cols].reset_index(drop=True)


def what_ran(data: pd.DataFrame, scale: str | None = None) -> str:
    """"ran: MLP on real digits (scikit-learn 8x8), B=64, sigma=1.3, lr 0.5 (Non-DP SGD: 0.2), scale=smoke": the
    model, data and settings of the runs a figure draws, from its own table (never the paper's setting)."""
    b = "/".join(values(data, "batch_size")) or "?"
    text = f"ran: {model_name(data)} on {data_name(data)}, B={b}, sigma={'/'.join(values(data, 'sigma')) or '?'}"
    return text + lr_text(data) + (f", scale={scale}" if scale else "")


def lr_text(data: pd.DataFrame) -> str:
    """', lr 0.5' or, where a method has its own (the non-private baseline), ', lr 0.5 (Non-DP SGD: 0.2)'."""
    if "lr" not in data or data["lr"].isna().all():
        return ""
    per = {label: "/".join(values(sub, "lr")) for label, sub in data.groupby("label", sort=False)} if "label" in data \
        else {}
    common = pd.Series(list(per.values())).mode()
    main = common.iloc[0] if len(common) else "/".join(values(data, "lr"))
    own = [f"{label}: {v}" for label, v in sorted(per.items(), key=lambda kv: label_order(kv[0])) if v != main]
    return f", lr {main}" + (f" ({'; '.join(own)})" if own else "")


def optimizer_of(data: pd.DataFrame) -> str:
    labels = " ".join(values(data, "label"))
    return "DP-Adam" if "Adam" in labels else "DP-SGD"


def chance_level(data: pd.DataFrame) -> float | None:
    """1/classes where the labels are random by construction (synthetic data), else None."""
    if "dataset" not in data or not (data["dataset"] == "synthetic").all():
        return None
    like = data["like"].dropna().iloc[0] if "like" in data and data["like"].notna().any() else None
    return 1.0 / CLASSES.get(str(like), 10)


def mark_chance(ax, chance: float, axis: str = "y"):
    """Say ON the panel that accuracy is chance by construction; show accuracy on its full 0-1 range."""
    (ax.axhline if axis == "y" else ax.axvline)(chance, color="tab:red", ls=":", lw=1)
    (ax.set_ylim if axis == "y" else ax.set_xlim)(0, 1)
    ax.text(0.5, 0.2 if chance >= 0.3 else 0.62,
            f"SYNTHETIC RANDOM LABELS:\naccuracy = chance ({chance:g}) by construction.\n"
            "This panel checks the code path,\nnot the methods' accuracy.", transform=ax.transAxes, ha="center",
            va="center", fontsize=8, color="tab:red", bbox=dict(facecolor="white", edgecolor="tab:red", alpha=0.9))


def at_accuracy(traj: pd.DataFrame, target: float) -> pd.DataFrame:
    """Per method: the first epoch reaching the target accuracy (time and epsilon there)."""
    rows = []
    for label, sub in traj.groupby("label"):
        hit = sub[sub["test_acc"] >= target]
        first = hit.iloc[0] if len(hit) else None
        rows.append({"label": label, "time_s": None if first is None else first["time_s"],
                     "epsilon": None if first is None else first["epsilon"], "reached": first is not None})
    return pd.DataFrame(rows)


INF_NOTE = r"$\epsilon=\infty$: no finite guarantee (full tail of $Z_r$, docs/privacy.md)"


def finite_max(values) -> float:
    v = pd.to_numeric(pd.Series(values), errors="coerce")
    v = v[np.isfinite(v)]
    return float(v.max()) if len(v) else float("nan")


def eps_panel(ax, points, eps_axis: str = "y"):
    """Methods on a panel with epsilon on one axis, from (position on the other axis, epsilon, label): finite at
    their value; epsilon = inf (no finite guarantee) in the method's marker with a black edge on a red band at the top
    (or right) of the epsilon axis, whose one tick reads infinity; non-private (no epsilon) as a dashed grey line at
    its position."""
    finite = [e for _, e, _ in points if pd.notna(e) and np.isfinite(e)]
    n_inf = n_finite = 0
    top = max(finite) * 1.3 if finite else 1.0
    inf_at = top * 0.93
    for pos, eps, label in points:
        if pd.isna(eps):
            (ax.axvline if eps_axis == "y" else ax.axhline)(pos, color=method_style(label)["color"], ls="--", lw=1,
                                                            label=label)
            xy = (pos, top * 0.02) if eps_axis == "y" else (0.0, pos)
            ax.annotate(f"{label} (no privacy)", xy, fontsize=7, color="0.4", xytext=(2, 2),
                        textcoords="offset points", rotation=90 if eps_axis == "y" else 0)
            continue
        inf = np.isinf(eps)
        value = inf_at if inf else eps
        xy = (pos, value) if eps_axis == "y" else (value, pos)
        if inf:
            ax.scatter(*xy, s=40, zorder=3, edgecolors=INF_EDGE, linewidths=1.5, label=label, **method_style(label))
            n_inf += 1
            ax.annotate(label + r" ($\epsilon=\infty$)", xy, fontsize=7, color="tab:red",
                        xytext=(3, -9 * n_inf) if eps_axis == "y" else (-4, 3 + 9 * (n_inf - 1)),
                        ha="left" if eps_axis == "y" else "right",
                        textcoords="offset points")
        else:
            ax.scatter(*xy, zorder=3, s=40, label=label, **method_style(label))
            n_finite += 1  # alternate above / below: two methods close together keep readable labels
            ax.annotate(label, xy, fontsize=7, xytext=(3, 3) if n_finite % 2 else (3, -10), textcoords="offset points")
    (ax.set_ylim if eps_axis == "y" else ax.set_xlim)(0, top)
    if any(pd.notna(e) and np.isinf(e) for _, e, _ in points):
        (ax.axhspan if eps_axis == "y" else ax.axvspan)(top * 0.88, top, color="tab:red", alpha=0.08)
        # the band's one tick reads "inf": a finite tick beside it read as the infinite epsilon's value (review 66:
        # JL(1) read as epsilon ~17 on jl_fig4's 0-18 axis)
        axis = ax.yaxis if eps_axis == "y" else ax.xaxis
        ticks = [t for t in axis.get_major_locator().tick_values(0, top) if 0 <= t < top * 0.85]
        axis.set_ticks(ticks + [inf_at], labels=[f"{t:g}" for t in ticks] + [r"$\infty$"])


def tradeoff_left(ax, fig, data, norm, cmap):
    """Accuracy vs training time: one line per method in its colour and marker; each epoch's marker filled with its
    epsilon's colour (white with a black edge: epsilon = inf; hollow: non-private)."""
    for label in sorted(data["label"].unique(), key=label_order):
        sub = data[data["label"] == label]
        style = method_style(label)
        ax.plot(sub["time_s"], sub["test_acc"], "-", color=style["color"], lw=1.2, zorder=1, label=label,
                marker=style["marker"], markersize=0)
        e = pd.to_numeric(sub["epsilon"], errors="coerce")
        finite, inf = np.isfinite(e), np.isinf(e)
        if finite.any():
            ax.scatter(sub["time_s"][finite], sub["test_acc"][finite], c=e[finite], cmap=cmap, norm=norm, s=30,
                       marker=style["marker"], edgecolors=style["color"], linewidths=1.0, zorder=2)
        if inf.any():
            ax.scatter(sub["time_s"][inf], sub["test_acc"][inf], marker=style["marker"], facecolors="white",
                       edgecolors=INF_EDGE, linewidths=1.5, s=30, zorder=2)
        if e.isna().all():
            ax.scatter(sub["time_s"], sub["test_acc"], marker=style["marker"], facecolors="none",
                       edgecolors=style["color"], s=30, zorder=2)
    ax.set_xscale("log")
    plain_log_axis(ax.xaxis)
    measured = "time_basis" in data and (data["time_basis"] == "measured").any()
    ax.set_xlabel("training time (s, measured epoch times)" if measured else
                  "training time (s, estimated: median step x steps per epoch)")
    ax.set_ylabel("test accuracy")
    from matplotlib.cm import ScalarMappable

    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=f"marker fill: {epsilon_tex(data)}")
    chance = chance_level(data)
    if chance is not None:
        mark_chance(ax, chance)


def eps_norm(data):
    from matplotlib import colors

    vmax = finite_max(data["epsilon"])
    return colors.Normalize(vmin=0, vmax=vmax if np.isfinite(vmax) and vmax > 0 else 1.0), plt_cmap("viridis")


def draw_tradeoff(data, caption, scale, prefix, paper_acc):
    fig, (left, right) = panels(1, 2, f"{prefix}: {optimizer_of(data)}, accuracy vs training time; time and epsilon "
                                f"at a fixed accuracy\n" + what_ran(data, scale), 5.4, 4)
    norm, cmap = eps_norm(data)
    tradeoff_left(left, fig, data, norm, cmap)
    left.set_title("accuracy vs training time\n(marker fill: $\\epsilon$; white, black edge: $\\epsilon=\\infty$; "
                   "hollow: non-private)", fontsize=9)
    chance = chance_level(data)
    if chance is not None:  # no accuracy target on random labels: where each method ends instead
        last = data.sort_values("epoch").groupby("label").tail(1)
        eps_panel(right, list(zip(last["time_s"], pd.to_numeric(last["epsilon"], errors="coerce"), last["label"])))
        right.set_title("time and epsilon after the last epoch\n(no accuracy target: the labels are random)",
                        fontsize=9)
    else:
        target, text = threshold(paper_acc, data.groupby("label")["test_acc"].max(), scale)
        hits = at_accuracy(data, target)
        reached = hits[hits["reached"]]
        eps_panel(right, list(zip(reached["time_s"], pd.to_numeric(reached["epsilon"], errors="coerce"),
                                  reached["label"])))
        missed = [r for r, ok in zip(hits["label"], hits["reached"]) if not ok]
        if missed:
            right.text(0.02, 0.02, "not reached: " + ", ".join(missed), transform=right.transAxes, fontsize=6)
        if not np.isfinite(finite_max(reached["epsilon"])):
            right.text(0.5, 0.5, "no method with a finite epsilon reached it", transform=right.transAxes,
                       fontsize=7, ha="center", color="0.4")
        right.set_title(f"time and epsilon at accuracy {text}", fontsize=9)
    right.set_xscale("log")
    plain_log_axis(right.xaxis)
    right.set_xlabel(left.get_xlabel().split(":")[0].rstrip(")") + ")")
    right.set_ylabel(epsilon_tex(data))
    right.grid(alpha=0.3)
    method_legend(fig, [left])
    return finish(fig, caption, top=0.9)


def draw_fig1(data, caption, scale):
    fig, (ax,) = panels(1, 1, f"JL paper Figure 1: {optimizer_of(data)}, accuracy vs training time, epsilon as "
                        "colour\n" + what_ran(data, scale), 7.5, 4.4)
    norm, cmap = eps_norm(data)
    tradeoff_left(ax, fig, data, norm, cmap)
    ax.set_title("marker fill: $\\epsilon$; white, black edge: $\\epsilon=\\infty$; hollow: non-private", fontsize=9)
    ax.grid(alpha=0.3)
    method_legend(fig, [ax])
    return finish(fig, caption, top=0.9)


def plt_cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name]


def make_tradeoff(name, prefix, paper_title, experiment, paper_acc):
    """paper_title: the paper's caption (`python -m runner.plots --list`); the drawn title says what ran instead."""
    def draw(data, caption, scale):
        return draw_tradeoff(data, caption, scale, prefix, paper_acc)
    return FIGURES.register(name)(Figure("JL", paper_title, "figure", experiment, trajectories, draw))


# -- seconds-per-epoch tables (2, 3) -------------------------------------------------------------------------
def seconds_table(runs, paper: dict, two_columns: bool) -> pd.DataFrame:
    runs = one_run_per_label(runs)
    runs["s_per_epoch"] = seconds_per_epoch(runs)
    base = runs.loc[runs["method"] == "nonprivate", "s_per_epoch"]
    base = float(base.iloc[0]) if len(base) else float("nan")
    rows = []
    for label in sorted(set(runs["label"]) | set(paper), key=label_order):
        ours = runs.loc[runs["label"] == label, "s_per_epoch"]
        ref = paper.get(label)
        b = runs.loc[runs["label"] == label, "batch_size"] if "batch_size" in runs else pd.Series(dtype=float)
        row = {"method": label, "ours B": int(b.iloc[0]) if len(b) and pd.notna(b.iloc[0]) else None,
               **{col: what_of(runs, label, col) for col in RAN_COLUMNS},
               "ours s/epoch": float(ours.iloc[0]) if len(ours) else None,
               "ours / non-private": float(ours.iloc[0]) / base if len(ours) else None}
        if two_columns:
            row["paper PyTorch"], row["paper TensorFlow"] = ref if ref else (None, None)
        else:
            row["paper s/epoch"] = ref
        rows.append(row)
    return pd.DataFrame(rows)


RAN_COLUMNS = ("dataset", "like", "model")  # what ran, in a seconds table's CSV: its title is drawn from them


def what_of(runs: pd.DataFrame, label: str, col: str):
    """The run's dataset / like / model for a method label (None for a paper-only row)."""
    v = runs.loc[runs["label"] == label, col] if col in runs else pd.Series(dtype=object)
    return v.iloc[0] if len(v) and pd.notna(v.iloc[0]) else None


def table2(runs, epochs, scale):
    return seconds_table(runs, PAPER_TABLE2, two_columns=True)


def draw_seconds(prefix: str):
    """A seconds-per-epoch table titled with what ran (its dataset / like / model columns, its B); a private method
    timed faster than non-private is flagged ON the figure as timing noise (a private step does at least the
    non-private step's work)."""
    def draw(data, caption, scale):
        ran = data.dropna(subset=["ours s/epoch"]) if "ours s/epoch" in data else data
        b = "/".join(values(ran, "ours B")) or "?"
        title = (f"{prefix}: seconds per epoch at scale={scale}\nran: {model_name(ran)} on "
                 f"{data_name(ran, synthetic_note='')}, B={b}")
        fig = table_figure(data.drop(columns=[c for c in RAN_COLUMNS if c in data]), title, caption)
        ratio = pd.to_numeric(data.get("ours / non-private"), errors="coerce")
        private = ~data["method"].str.startswith("Non")
        bad = data.loc[private & (ratio < 1.0), "method"].tolist()
        if bad:
            import textwrap

            note = ("TIMING NOISE: " + ", ".join(bad) + " timed faster than non-private, which a private step cannot "
                    "be; these timings are not trustworthy (too few timed steps, or a loaded machine)")
            fig.text(0.5, 0.09, "\n".join(textwrap.wrap(note, 80)), ha="center", fontsize=8, color="tab:red")
        return fig
    return draw


def table5(runs, epochs, scale):
    return seconds_table(runs, PAPER_TABLE5, two_columns=True)


def table3(runs, epochs, scale):
    return seconds_table(runs, PAPER_TABLE3, two_columns=False)


# -- Figure 6 (IMDB trade-offs at fixed accuracy, time, epsilon) ----------------------------------------------
def draw_fig6(data, caption, scale):
    fig, axes = panels(1, 3, f"JL paper Figure 6: {optimizer_of(data)}, accuracy, privacy and training time trade-off"
                       "\n" + what_ran(data, scale))
    data = data.assign(epsilon=pd.to_numeric(data["epsilon"], errors="coerce"))
    acc, acc_text = threshold(0.70, data.groupby("label")["test_acc"].max(), scale)
    hits = at_accuracy(data, acc)
    reached = hits[hits["reached"]]
    eps_panel(axes[0], list(zip(reached["time_s"], pd.to_numeric(reached["epsilon"], errors="coerce"),
                                reached["label"])))
    missed = [r for r, ok in zip(hits["label"], hits["reached"]) if not ok]
    if missed:
        axes[0].text(0.02, 0.02, "not reached: " + ", ".join(missed), transform=axes[0].transAxes, fontsize=6)
    axes[0].set(xlabel="training time (s)", ylabel=epsilon_tex(data), title=f"fixing accuracy at {acc_text}")
    t, t_text = threshold(720.0, data.groupby("label")["time_s"].max(), scale)
    finite_eps = data["epsilon"].where(np.isfinite(data["epsilon"]))
    eps_cap, e_text = threshold(8.0, finite_eps.groupby(data["label"]).max(), scale)
    left_out, at_time = [], []
    for label, sub in sorted(data.groupby("label"), key=lambda kv: label_order(kv[0])):
        within = sub[sub["time_s"] <= t]
        if len(within):
            last = within.iloc[-1]
            at_time.append((last["test_acc"], last["epsilon"], label))
        private = sub[sub["epsilon"] <= eps_cap]
        if len(private):
            last = private.iloc[-1]
            axes[2].scatter(last["time_s"], last["test_acc"], s=40, label=label, **method_style(label))
            axes[2].annotate(label, (last["time_s"], last["test_acc"]), fontsize=7)
        else:
            left_out.append(label + (" (no privacy)" if sub["epsilon"].isna().all() else ""))
    eps_panel(axes[1], at_time, eps_axis="x")
    if left_out:
        import textwrap

        never = "\n".join(textwrap.wrap("epsilon never within it: " + ", ".join(left_out), 60))
    axes[1].set(xlabel=epsilon_tex(data), ylabel="test accuracy", title=f"fixing training time at {t_text} s")
    axes[2].set(ylabel="test accuracy", title=f"fixing epsilon at {e_text}")
    axes[2].set_xlabel("training time (s)" + (f"\n{never}" if left_out else ""), fontsize=10 if not left_out else 7)
    chance = chance_level(data)
    if chance is not None:
        mark_chance(axes[1], chance, axis="y")
        mark_chance(axes[2], chance, axis="y")
        axes[0].text(0.5, 0.45, "fixed accuracy: not meaningful on random labels\n(every method sits at chance)",
                     transform=axes[0].transAxes, ha="center", fontsize=8, color="tab:red")
    for ax in axes:
        ax.title.set_fontsize(8)
        ax.grid(alpha=0.3)
    method_legend(fig, axes)
    return finish(fig, caption, top=0.88)


# -- epsilon vs r (appendix C, Figure 8) -----------------------------------------------------------------------
EPS_PANELS = ((60000, 256, 1.3), (25000, 64, 0.5))  # (N, B, sigma) of the upper and lower panels
EPS_R = {"smoke": (1, 4, 10), "paper": (1, 2, 4, 6, 8, 10, 20, 30)}


def epsilon_r(runs, epochs, scale) -> pd.DataFrame:
    from runner.accountants import ACCOUNTANTS, SubsampledGaussian, SubsampledJL
    from runner.data.sampler import poisson_steps_per_epoch

    rows = []
    for n, b, sigma in EPS_PANELS:
        q, steps = b / n, poisson_steps_per_epoch(n, b)  # a run's steps per epoch
        for r in (None, *EPS_R[scale]):
            acc = ACCOUNTANTS.build("pld" if r is None else "jl")
            mech = SubsampledGaussian(q, sigma) if r is None else SubsampledJL(q, sigma, int(r))
            for epoch in range(1, 6):
                acc.step(mech, steps)
                eps = acc.epsilon(1e-5)
                # inf: no finite epsilon is certified (Z_r's heavy tail); the accountant's certified lower bound
                bound = acc.epsilon_lower_bound(1e-5) if np.isinf(eps) and hasattr(acc, "epsilon_lower_bound") else None
                rows.append({"N": n, "B": b, "sigma": sigma, "r": "No JL" if r is None else str(r),
                             "epoch": epoch, "epsilon": eps, "epsilon_lower_bound": bound})
    return pd.DataFrame(rows)


def draw_epsilon_r(data, caption, scale):
    fig, axes = panels(1, 2, "JL paper Figure 8: privacy loss of DP-SGD-JL up to 5 epochs", 5.2, 4)
    for ax, ((n, b, s), sub) in zip(axes, data.groupby(["N", "B", "sigma"], sort=False)):
        shown = []  # every plotted value: the axis starts at the decade below the smallest, so it has a tick there
        for r, line in sub.groupby("r", sort=False):
            name = "No JL (exact norms, pld)" if r == "No JL" else f"JL({r})"
            style = {"color": "0.3", "marker": "o"} if r == "No JL" else method_style(name)
            if np.isinf(line["epsilon"]).all() and line["epsilon_lower_bound"].notna().any():
                ax.plot(line["epoch"], line["epsilon_lower_bound"], ls=":", label=f"{name}: $\\epsilon=\\infty$ "
                        "(certified lower bound shown)", **style)
                shown.extend(line["epsilon_lower_bound"].dropna())
                continue
            ax.plot(line["epoch"], line["epsilon"], ls="--" if r == "No JL" else "-", label=name, **style)
            shown.extend(line["epsilon"])
        ax.set(xlabel="epoch", ylabel=r"$\epsilon$ ($\delta=10^{-5}$, log)", title=f"N={n}, B={b}, $\\sigma$={s}")
        ax.set_xticks(sorted(set(sub["epoch"])))
        ax.set_yscale("log")
        finite = [v for v in shown if np.isfinite(v) and v > 0]
        if finite:  # (a wide range ticks every other decade: the lowest curve could sit below the first label)
            ax.set_ylim(bottom=10.0 ** np.floor(np.log10(min(finite))))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return finish(fig, caption)


FIGURES.register("jl_table1")(
    Figure("JL", "Summary of different methods for DP training", "table", None, table1, draw_table1))
FIGURES.register("jl_fig2")(
    Figure("JL", "Distribution of sqrt(chi^2_r / r)", "figure", None, fig2, draw_fig2))
make_tradeoff("jl_fig3", "JL paper Figure 3", "2-layer CNN on MNIST, DP-SGD; time and epsilon at 95% accuracy",
              "jl_fig3", 0.95)
FIGURES.register("jl_table2")(
    Figure("JL", "Seconds per epoch, Papernot et al. CNN on CIFAR-10", "table", "jl_table2", table2,
           draw_seconds("JL paper Table 2")))
make_tradeoff("jl_fig4", "JL paper Figure 4", "Papernot et al. CNN on CIFAR-10; time and epsilon at 55% accuracy",
              "jl_table2", 0.55)
FIGURES.register("jl_table3")(
    Figure("JL", "Seconds per epoch, BiLSTM on IMDB", "table", "jl_table3", table3,
           draw_seconds("JL paper Table 3")))
make_tradeoff("jl_fig5", "JL paper Figure 5", "BiLSTM on IMDB, DP-Adam; time and epsilon at 70% accuracy",
              "jl_table3", 0.70)
FIGURES.register("jl_fig6")(
    Figure("JL", "Accuracy, privacy and training time trade-off on IMDB", "figure", "jl_table3",
           trajectories, draw_fig6))
FIGURES.register("jl_epsilon_r")(
    Figure("JL", "Privacy loss of DP-SGD-JL vs JL dimension", "figure", None, epsilon_r,
           draw_epsilon_r))
FIGURES.register("jl_table5")(
    Figure("JL", "Seconds per epoch, VGG13 on CIFAR-10", "table", "jl_table5", table5,
           draw_seconds("JL paper Table 5")))
FIGURES.register("jl_fig1")(
    Figure("JL", "Accuracy vs training time on CIFAR-10, epsilon as colour (= Figure 4, left)", "figure",
           "jl_table2", trajectories, draw_fig1))


# -- Figure 7 (duality of f-DP and (epsilon, delta)-DP) ------------------------------------------------------------
FIG7_SETTING = (60000, 256, 0.7, 30, 15)  # N, B, sigma, r, epochs: DP-SGD-JL(30) on MNIST at a lower noise,
# so that f bows visibly away from 1 - alpha (at sigma=1.3 for one epoch it hugged the diagonal)
FIG7_EPS = np.concatenate([np.linspace(0.0, 4.0, 41), np.linspace(4.5, 12.0, 16)])
FIG7_TANGENT_DELTAS = (0.3, 0.1, 1e-2, 1e-5)  # tangents where delta(epsilon) crosses these (those in range)


def fig7(runs, epochs, scale) -> pd.DataFrame:
    """delta(epsilon) of the jl accountant's composed PLD, and the trade-off curve it certifies:
    f(alpha) = sup_eps max(0, 1 - delta(eps) - e^eps alpha, e^-eps (1 - delta(eps) - alpha)) (Dong et al.)."""
    from runner.accountants import ACCOUNTANTS, SubsampledJL
    from runner.data.sampler import poisson_steps_per_epoch

    n, b, sigma, r, ep = FIG7_SETTING
    acc = ACCOUNTANTS.build("jl")
    acc.step(SubsampledJL(b / n, sigma, r), ep * poisson_steps_per_epoch(n, b))
    deltas = np.array([acc.delta(float(e)) for e in FIG7_EPS])
    alpha = np.linspace(0.0, 1.0, 401)
    lines = 1.0 - deltas[:, None] - np.exp(FIG7_EPS)[:, None] * alpha[None, :]
    mirrored = np.exp(-FIG7_EPS)[:, None] * (1.0 - deltas[:, None] - alpha[None, :])
    f = np.clip(np.maximum(lines, mirrored).max(axis=0), 0.0, 1.0)
    curve = pd.DataFrame({"kind": "tradeoff", "alpha": alpha, "f": f})
    dual = pd.DataFrame({"kind": "epsilon_delta", "epsilon": FIG7_EPS, "delta": deltas})
    return pd.concat([curve, dual], ignore_index=True).assign(N=n, B=b, sigma=sigma, r=r, epochs=ep)


def draw_fig7(data, caption, scale):
    n, b, sigma, r, ep = FIG7_SETTING
    curve, dual = data[data["kind"] == "tradeoff"], data[data["kind"] == "epsilon_delta"]
    fig, (ax, dax) = panels(1, 2, "JL paper Figure 7: duality of f-DP and ($\\epsilon, \\delta$)-DP, from dprun's jl "
                            f"accountant\nDP-SGD-JL(r={r}), N={n}, B={b}, $\\sigma$={sigma}, "
                            f"{ep} epoch{'s' if ep > 1 else ''}", 5.2, 4.4)
    ax.plot(curve["alpha"], curve["f"], color=method_style(f"JL({r})")["color"], lw=2, label=f"f (JL({r}))")
    ax.plot([0, 1], [1, 0], color="0.6", ls=":", lw=1, label="no privacy lost (f = 1 - alpha)")
    eps, dl = dual["epsilon"].to_numpy(float), dual["delta"].to_numpy(float)
    crossings = [t for t in FIG7_TANGENT_DELTAS if dl.min() < t < dl.max()]
    for i, t in enumerate(crossings):
        e = float(np.interp(-np.log(t), -np.log(dl), eps))  # where delta(epsilon) crosses t
        d = float(np.interp(e, eps, dl))
        xs = np.linspace(0, 1, 50)
        # the pair named: epsilon rounded up, so delta there is at most t (rounded to nearest, (0.69, 0.1) named a
        # point whose delta is 0.10063: review 22)
        se = shown_epsilon(e, 2)
        ax.plot(xs, 1 - d - np.exp(e) * xs, color=f"C{i + 1}", lw=0.9, ls="--",
                label=f"tangent: slope $-e^{{{e:.2g}}}$, intercept 1-{d:.2g}: ($\\epsilon$={se}, $\\delta$={t:g})")
        dax.scatter([e], [d], color=f"C{i + 1}", zorder=3, s=30)
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel=r"type I error $\alpha$", ylabel=r"type II error $f(\alpha)$",
           title="trade-off curve and tangents", aspect="equal")
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    ax.grid(alpha=0.3)
    dax.plot(dual["epsilon"], dual["delta"], color=method_style(f"JL({r})")["color"], marker=".")
    dax.axhline(1e-5, color="0.5", ls=":", lw=1)
    dax.annotate(r"$\delta=10^{-5}$", (dual["epsilon"].max() * 0.7, 1e-5), fontsize=7, xytext=(0, 3),
                 textcoords="offset points")
    dax.set_yscale("log")
    dax.set(xlabel=r"$\epsilon$", ylabel=r"$\delta(\epsilon)$ (log)", title="the same guarantee as ($\\epsilon$, "
            "$\\delta(\\epsilon)$): one point per tangent")
    dax.title.set_fontsize(9)
    ax.title.set_fontsize(9)
    dax.grid(alpha=0.3, which="both")
    return finish(fig, caption, top=0.88)


FIGURES.register("jl_fig7")(
    Figure("JL", "Duality of f-DP and (epsilon, delta)-DP (jl accountant)", "figure", None, fig7, draw_fig7))


# -- Table 4 (memory and time of jvp vs double-vjp) ----------------------------------------------------------------
# The paper's Table 4: (sec/epoch 2-layer CNN B=256, sec/epoch AlexNet B=64, memory % of 16 GB (AlexNet))
PAPER_TABLE4 = {"Non-DP SGD": (1, 14, "12%"), "DP-SGD-Vanilla": (50, 332, "38%"), "DP-SGD-Outer": (12, 85, "75%"),
                "DP-SGD-JL(1) (jvp)": (3, 43, "15%"), "DP-SGD-JL(10) (jvp)": (20, 182, "15%"),
                "DP-SGD-JL(1) (double vjp)": (14, 26, "22%"), "DP-SGD-JL(10) (double vjp)": (22, 105, "22%")}
TABLE4_CONTENDERS = [("Non-DP SGD", "nonprivate", {}, 1), ("DP-SGD-Vanilla", "nxbp", {}, 1),
                     ("DP-SGD-Outer", "opacus", {}, 1),
                     ("DP-SGD-JL(1) (jvp)", "jl", {"jvp": "forward"}, 1),
                     ("DP-SGD-JL(10) (jvp)", "jl", {"jvp": "forward"}, 10),
                     ("DP-SGD-JL(1) (double vjp)", "jl", {"jvp": "double_vjp"}, 1),
                     ("DP-SGD-JL(10) (double vjp)", "jl", {"jvp": "double_vjp"}, 10)]
TABLE4_BATCH = {"smoke": 16, "paper": 256}
TABLE4_STEPS = (1, 10)  # warm-up steps, timed steps


def table4(runs, epochs, scale) -> pd.DataFrame:
    """Measured here, one process (runner.bench): the MNIST CNN (bu_cnn, MNIST-shaped synthetic batch), each
    contender's median step time over 10 steps after a warm-up step and its peak memory above the step's start."""
    import copy
    import time

    import torch

    from runner.bench.common import MNIST, step_memory_bytes, synthetic_batch
    from runner.bench.jl import Workload, jl_contender
    from runner.metrics import synchronize
    from runner.models import MODELS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b = TABLE4_BATCH[scale]
    w = Workload("cnn_mnist", "bu_cnn", MNIST, b, "sgd", 0.25)
    torch.manual_seed(0)
    base = MODELS.build(w.model, w.info).to(device)
    x, y = synthetic_batch(w.info, b, device)
    steps_per_epoch = w.info.train_size / b
    rows = []
    for label, method, options, r in TABLE4_CONTENDERS:
        c, note = jl_contender(method, options, r, copy.deepcopy(base), w, x, y)
        paper = PAPER_TABLE4[label]
        row = {"method": label, "ours s/epoch": None, "ours step MB": None, "note": note,
               "paper s/epoch (CNN, TF/PyTorch)": paper[0], "paper s/epoch (AlexNet)": paper[1],
               "paper memory (AlexNet, of 16 GB)": paper[2]}
        if c is not None:
            step, zero = c.step, c.zero_grad
            for _ in range(TABLE4_STEPS[0]):
                step()
            times = []
            for _ in range(TABLE4_STEPS[1]):
                zero()
                synchronize(device)
                t0 = time.perf_counter()
                step()
                synchronize(device)
                times.append(time.perf_counter() - t0)
            row["ours s/epoch"] = float(np.median(times)) * steps_per_epoch
            row["ours step MB"] = step_memory_bytes(step, device, before=zero) / 2**20
        rows.append(row)
    out = pd.DataFrame(rows)
    base_mb = out.loc[out["method"] == "Non-DP SGD", "ours step MB"]
    out.insert(3, "ours memory / non-private", out["ours step MB"] / float(base_mb.iloc[0]) if len(base_mb) and
               pd.notna(base_mb.iloc[0]) else None)
    out["setting"] = f"bu_cnn, MNIST-shaped batch of {b}, {device.type}"
    return out


def draw_table4(data, caption, scale):
    shown = data.drop(columns=["setting", "note"])
    setting = data["setting"].iloc[0] if len(data) else "?"
    fig = table_figure(shown, "JL paper Table 4: time and memory, jvp vs double-vjp (ours: " + setting + ";\n"
                       "step MB = peak memory of one step above its start; s/epoch = median of 10 steps x 60000/B)",
                       caption + " | measured in one process (runner.bench), not from runs", col_width=2.2)
    if setting.endswith("cpu"):
        fig.text(0.5, 0.12, "On a CPU the memory columns are the result; the s/epoch column is this machine's "
                 "(a shared, loaded CPU: not comparable with the paper's GPU seconds)", ha="center", fontsize=8,
                 color="tab:red")
    return fig


FIGURES.register("jl_table4")(
    Figure("JL", "Memory and time of DP-SGD-JL with jvp vs double-vjp", "table", None, table4,
           draw_table4))
