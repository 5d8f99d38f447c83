"""The JL paper's tables and figures (jl-projections-dpsgd): Table 1 (method summary from the registries),
Figure 2 (distribution of sqrt(chi^2_r / r)), Figure 3 (MNIST), Table 2 and Figure 4 (CIFAR-10), Table 3 and
Figures 5-6 (IMDB), and the epsilon-vs-r figure of appendix C (from the JL accountant).

    python -m runner.plots jl_table2 --scale smoke      # after: make fig-jl_table2 (sweep + dprun-report)
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

from runner.figures.spec import Figure, add, newest_per, seconds_per_epoch, threshold
from runner.figures.style import finish, jl_label, panels, plain_log_axis, table_figure

# The paper's seconds per epoch (Tesla P100), placed next to ours in Tables 2 and 3.
PAPER_TABLE2 = {"Non-DP SGD": (12, 2.5), "DP-SGD-Vanilla": (None, 434), "DP-SGD-Outer": (17, None),
                "DP-SGD-JL(1)": (78, 6.6), "DP-SGD-JL(10)": (657, 38)}  # (PyTorch, TensorFlow)
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
def trajectories(runs, epochs, scale) -> pd.DataFrame:
    """One row per run and epoch: label, cumulative training time, test accuracy, epsilon."""
    if epochs.empty:
        return pd.DataFrame(columns=["label", "epoch", "time_s", "test_acc", "epsilon"])
    runs = one_run_per_label(runs)
    ep = epochs[epochs["run_dir"].isin(set(runs["run_dir"]))].sort_values(["run_dir", "epoch"]).copy()
    ep["time_s"] = ep.groupby("run_dir")["epoch_time_s"].cumsum()
    ep = labelled(ep)
    return ep[["label", "method", "r", "epoch", "time_s", "test_acc", "epsilon", "run_dir"]].reset_index(drop=True)


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
    their value; epsilon = inf (no finite guarantee) as red triangles on an "inf" band at the top (or right) of the
    epsilon axis; non-private (no epsilon) as a dashed grey line at its position."""
    finite = [e for _, e, _ in points if pd.notna(e) and np.isfinite(e)]
    top = max(finite) * 1.3 if finite else 1.0
    inf_at = top * 0.93
    for pos, eps, label in points:
        if pd.isna(eps):
            (ax.axvline if eps_axis == "y" else ax.axhline)(pos, color="0.5", ls="--", lw=1)
            xy = (pos, top * 0.02) if eps_axis == "y" else (0.0, pos)
            ax.annotate(f"{label} (no privacy)", xy, fontsize=7, color="0.4", xytext=(2, 2),
                        textcoords="offset points", rotation=90 if eps_axis == "y" else 0)
            continue
        inf = np.isinf(eps)
        value = inf_at if inf else eps
        xy = (pos, value) if eps_axis == "y" else (value, pos)
        if inf:
            ax.scatter(*xy, marker="^", color="tab:red", s=36, zorder=3)
            ax.annotate(label + r" ($\epsilon=\infty$)", xy, fontsize=7, color="tab:red",
                        xytext=(3, -9) if eps_axis == "y" else (-4, 3), ha="left" if eps_axis == "y" else "right",
                        textcoords="offset points")
        else:
            ax.scatter(*xy, zorder=3)
            ax.annotate(label, xy, fontsize=7, xytext=(3, 3), textcoords="offset points")
    if any(pd.notna(e) and np.isinf(e) for _, e, _ in points):
        (ax.axhspan if eps_axis == "y" else ax.axvspan)(top * 0.88, top, color="tab:red", alpha=0.08)
    (ax.set_ylim if eps_axis == "y" else ax.set_xlim)(0, top)


def draw_tradeoff(data, caption, scale, title, paper_acc):
    import matplotlib.lines as mlines
    from matplotlib import colors

    fig, (left, right) = panels(1, 2, title, 5.2, 4)
    vmax = finite_max(data["epsilon"])
    norm = colors.Normalize(vmin=0, vmax=vmax if np.isfinite(vmax) and vmax > 0 else 1.0)
    cmap = plt_cmap("viridis")
    handles = {}
    for label in sorted(data["label"].unique(), key=label_order):
        sub = data[data["label"] == label]
        left.plot(sub["time_s"], sub["test_acc"], "-", color="0.7", lw=0.8, zorder=1)
        e = pd.to_numeric(sub["epsilon"], errors="coerce")
        finite = np.isfinite(e)
        if finite.any():
            left.scatter(sub["time_s"][finite], sub["test_acc"][finite], c=e[finite], cmap=cmap, norm=norm, s=18,
                         zorder=2)
        if np.isinf(e).any():
            left.scatter(sub["time_s"][np.isinf(e)], sub["test_acc"][np.isinf(e)], marker="^", color="tab:red",
                         s=18, zorder=2)
            handles["inf"] = mlines.Line2D([], [], color="tab:red", marker="^", ls="", label=INF_NOTE)
        if e.isna().all():
            left.scatter(sub["time_s"], sub["test_acc"], marker="x", color="k", s=18, zorder=2)
            handles["nan"] = mlines.Line2D([], [], color="k", marker="x", ls="", label="non-private (no epsilon)")
        left.annotate(label, (sub["time_s"].iloc[-1], sub["test_acc"].iloc[-1]), fontsize=7)
    left.set_xscale("log")
    plain_log_axis(left.xaxis)
    left.set_xlabel("training time (s)")
    left.set_ylabel("test accuracy")
    left.set_title("accuracy vs training time (colour: epsilon)", fontsize=10)
    if handles:
        left.legend(handles=list(handles.values()), fontsize=6, loc="best")
    from matplotlib.cm import ScalarMappable

    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=left, label=r"$\epsilon$ ($\delta=10^{-5}$)")
    target, text = threshold(paper_acc, data.groupby("label")["test_acc"].max(), scale)
    hits = at_accuracy(data, target)
    reached = hits[hits["reached"]]
    eps_panel(right, list(zip(reached["time_s"], pd.to_numeric(reached["epsilon"], errors="coerce"),
                              reached["label"])))
    missed = [r for r, ok in zip(hits["label"], hits["reached"]) if not ok]
    if missed:
        right.text(0.02, 0.02, "not reached: " + ", ".join(missed), transform=right.transAxes, fontsize=6)
    if not np.isfinite(finite_max(reached["epsilon"])):
        right.text(0.5, 0.5, "no method with a finite epsilon reached it", transform=right.transAxes, fontsize=7,
                   ha="center", color="0.4")
    right.set_xlabel("training time to reach it (s)")
    right.set_ylabel(r"$\epsilon$")
    right.set_title(f"fixing accuracy at {text}", fontsize=9)
    right.grid(alpha=0.3)
    return finish(fig, caption)


def plt_cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name]


def make_tradeoff(name, title, experiment, paper_acc):
    def draw(data, caption, scale):
        return draw_tradeoff(data, caption, scale, title, paper_acc)
    return add(Figure(name, "JL", title, "figure", experiment, trajectories, draw))


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
        row = {"method": label, "ours s/epoch": float(ours.iloc[0]) if len(ours) else None,
               "ours / non-private": float(ours.iloc[0]) / base if len(ours) else None}
        if two_columns:
            row["paper PyTorch"], row["paper TensorFlow"] = ref if ref else (None, None)
        else:
            row["paper s/epoch"] = ref
        rows.append(row)
    return pd.DataFrame(rows)


def table2(runs, epochs, scale):
    return seconds_table(runs, PAPER_TABLE2, two_columns=True)


def table3(runs, epochs, scale):
    return seconds_table(runs, PAPER_TABLE3, two_columns=False)


# -- Figure 6 (IMDB trade-offs at fixed accuracy, time, epsilon) ----------------------------------------------
def draw_fig6(data, caption, scale):
    fig, axes = panels(1, 3, "JL paper Figure 6: accuracy, privacy and training time trade-off (RNN on IMDB)")
    data = data.assign(epsilon=pd.to_numeric(data["epsilon"], errors="coerce"))
    acc, acc_text = threshold(0.70, data.groupby("label")["test_acc"].max(), scale)
    hits = at_accuracy(data, acc)
    reached = hits[hits["reached"]]
    eps_panel(axes[0], list(zip(reached["time_s"], pd.to_numeric(reached["epsilon"], errors="coerce"),
                                reached["label"])))
    missed = [r for r, ok in zip(hits["label"], hits["reached"]) if not ok]
    if missed:
        axes[0].text(0.02, 0.02, "not reached: " + ", ".join(missed), transform=axes[0].transAxes, fontsize=6)
    axes[0].set(xlabel="training time (s)", ylabel=r"$\epsilon$", title=f"fixing accuracy at {acc_text}")
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
            axes[2].scatter(last["time_s"], last["test_acc"])
            axes[2].annotate(label, (last["time_s"], last["test_acc"]), fontsize=7)
        else:
            left_out.append(label + (" (no privacy)" if sub["epsilon"].isna().all() else ""))
    eps_panel(axes[1], at_time, eps_axis="x")
    if left_out:
        import textwrap

        never = "\n".join(textwrap.wrap("epsilon never within it: " + ", ".join(left_out), 60))
    axes[1].set(xlabel=r"$\epsilon$", ylabel="test accuracy", title=f"fixing training time at {t_text} s")
    axes[2].set(ylabel="test accuracy", title=f"fixing epsilon at {e_text}")
    axes[2].set_xlabel("training time (s)" + (f"\n{never}" if left_out else ""), fontsize=10 if not left_out else 7)
    for ax in axes:
        ax.title.set_fontsize(8)
        ax.grid(alpha=0.3)
    return finish(fig, caption)


# -- epsilon vs r (appendix C, Figure 8) -----------------------------------------------------------------------
EPS_PANELS = ((60000, 256, 1.3), (25000, 64, 0.5))  # (N, B, sigma) of the upper and lower panels
EPS_R = {"smoke": (1, 4, 10), "paper": (1, 2, 4, 6, 8, 10, 20, 30)}


def epsilon_needs():
    from runner.accountants import ACCOUNTANTS

    missing = [a for a in ("jl", "pld") if a not in ACCOUNTANTS]
    return f"accountant(s) {', '.join(missing)} not registered yet" if missing else None


def epsilon_r(runs, epochs, scale) -> pd.DataFrame:
    from runner.accountants import ACCOUNTANTS, SubsampledGaussian, SubsampledJL

    rows = []
    for n, b, sigma in EPS_PANELS:
        q, steps = b / n, round(n / b)
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
        for r, line in sub.groupby("r", sort=False):
            if np.isinf(line["epsilon"]).all() and line["epsilon_lower_bound"].notna().any():
                ax.plot(line["epoch"], line["epsilon_lower_bound"], marker="^", ls=":",
                        label=f"r={r}: $\\epsilon=\\infty$ (lower bound shown)")
                continue
            ax.plot(line["epoch"], line["epsilon"], marker="o", ls="--" if r == "No JL" else "-",
                    label=r if r == "No JL" else f"r={r}")
        ax.set(xlabel="epoch", ylabel=r"$\epsilon$ ($\delta=10^{-5}$)", title=f"N={n}, B={b}, $\\sigma$={s}")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return finish(fig, caption)


add(Figure("jl_table1", "JL", "Summary of different methods for DP training", "table", None, table1, draw_table1))
add(Figure("jl_fig2", "JL", "Distribution of sqrt(chi^2_r / r)", "figure", None, fig2, draw_fig2))
make_tradeoff("jl_fig3", "JL paper Figure 3: 2-layer CNN on MNIST (left); time and epsilon at 95% accuracy (right)",
              "jl_fig3", 0.95)
add(Figure("jl_table2", "JL", "Seconds per epoch, Papernot et al. CNN on CIFAR-10", "table", "jl_table2", table2,
           lambda d, c, s: table_figure(d, "JL paper Table 2: seconds per epoch, CIFAR-10 (sigma=0.9, C=2, B=256)", c)))
make_tradeoff("jl_fig4", "JL paper Figure 4: Papernot et al. CNN on CIFAR-10; time and epsilon at 55% accuracy",
              "jl_table2", 0.55)
add(Figure("jl_table3", "JL", "Seconds per epoch, BiLSTM on IMDB", "table", "jl_table3", table3,
           lambda d, c, s: table_figure(d, "JL paper Table 3: seconds per epoch, BiLSTM on IMDB (DP-Adam, B=256)", c)))
make_tradeoff("jl_fig5", "JL paper Figure 5: performance of the RNN on IMDB with different Adam; at 70% accuracy",
              "jl_table3", 0.70)
add(Figure("jl_fig6", "JL", "Accuracy, privacy and training time trade-off on IMDB", "figure", "jl_table3",
           trajectories, draw_fig6))
add(Figure("jl_epsilon_r", "JL", "Privacy loss of DP-SGD-JL vs JL dimension", "figure", None, epsilon_r,
           draw_epsilon_r, needs=epsilon_needs))
