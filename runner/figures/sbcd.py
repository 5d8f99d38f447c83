"""DP-SBCD's three slide figures (hidden-state-dp-sbcd-slides), computed by runner/sbcd_curves.py, no training:
privacy loss vs epochs under the hidden-state analysis vs composition, the per-epoch contribution to the final
privacy loss, and adaptive vs constant noise.

    python -m runner.plots sbcd_hsa_vs_composition sbcd_epoch_contribution sbcd_adaptive_noise

Every title states the setting the curves are computed for (N, B, epochs, sigma, delta: runner.sbcd_curves.CurveSetup).
"""
from __future__ import annotations

import pandas as pd

from runner.epsilon_shown import shown_epsilon
from runner.figures.spec import FIGURES, Figure
from runner.figures.style import finish, panels, plain_log_axis

ADAPTIVE_TARGET_EPSILON = 3.0


def _setup():
    from runner.sbcd_curves import CurveSetup

    return CurveSetup()


def setting(s, sigma: str | None = None) -> str:
    """N=60000, B=3000 (fixed disjoint batches), 50 epochs, sigma=2, delta=1e-05, D=1 hidden layer."""
    return (f"N={s.n}, B={s.batch_size} (fixed disjoint batches), {s.epochs} epochs, "
            f"$\\sigma$={sigma or f'{s.sigma:g}'}, $\\delta$={s.delta:g}, D={s.depth} hidden layer(s)")


def hsa_table(runs, epochs, scale) -> pd.DataFrame:  # epoch, eps_hidden, eps_composition
    from runner.sbcd_curves import privacy_vs_epochs

    return privacy_vs_epochs(_setup())[["epoch", "eps_hidden", "eps_composition", "sigma"]]


def draw_hsa(data, caption, scale):
    s = _setup()
    fig, (ax,) = panels(1, 1, "DP-SBCD: privacy loss of the released model vs epochs\n" + setting(s), 7, 4.2)
    ax.plot(data["epoch"], data["eps_composition"], color="0.3", ls="--", marker=".",
            label="composition: certified, what a run publishes as epsilon")
    ax.plot(data["epoch"], data["eps_hidden"], color="#e377c2", marker="*", label="hidden-state bound: assumes a Lipschitz step that\ndprun's sbcd does not meet (docs/sbcd.md): NOT certified")
    ax.set_yscale("log")
    plain_log_axis(ax.yaxis)
    lo = min(data["eps_hidden"].min(), data["eps_composition"].min())
    ax.set_ylim(bottom=min(ax.get_ylim()[0], lo / 1.5))
    last = data.iloc[-1]
    for col, name in (("eps_hidden", "hidden-state bound (assumed)"), ("eps_composition", "composition")):
        ax.annotate(f"{name}: $\\epsilon$={shown_epsilon(float(last[col]), 3)}", (last["epoch"], last[col]), xytext=(-10, 6),
                    textcoords="offset points", ha="right", fontsize=8)
    ax.set(xlabel="epochs trained", ylabel=r"$\epsilon$ (log)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return finish(fig, caption, top=0.9)


def contribution_table(runs, epochs, scale) -> pd.DataFrame:
    from runner.sbcd_curves import epoch_contributions

    return epoch_contributions(_setup())[["epoch", "share"]]


def draw_contribution(data, caption, scale):
    s = _setup()
    fig, (ax,) = panels(1, 1, "DP-SBCD: share of the final privacy loss (HSA) spent on each epoch's noise\n"
                        + setting(s), 7, 4.2)
    # the last epoch holds almost everything: a linear axis shows one bar; a log axis with markers (no bars: a bar
    # on a log axis has no baseline)
    ax.plot(data["epoch"], data["share"], color="#e377c2", marker="*", ls="-", lw=0.8)
    ax.set_yscale("log")
    ax.set(xlabel="epoch", ylabel="share of the final privacy loss (log)")
    last = data.iloc[-1]
    ax.annotate(f"last epoch: {last['share']:.3g}", (last["epoch"], last["share"]), xytext=(-120, -5),
                textcoords="offset points", fontsize=8, arrowprops=dict(arrowstyle="->", lw=0.6))
    ax.grid(alpha=0.3, axis="y", which="both")
    return finish(fig, caption, top=0.9)


def _adaptive_setup(scale: str):
    """The curves' setting; at smoke scale 10 epochs (the schedules are calibrated for it), so the two trained runs
    take about a minute on a CPU; at paper scale the slides' 50."""
    from dataclasses import replace

    return replace(_setup(), epochs=10) if scale != "paper" else _setup()


def mnist_available() -> str | None:
    """The data folder holding MNIST (DPRUN_DATA_DIR or the per-user cache), or None."""
    from pathlib import Path

    from runner.data.base import default_data_dir
    from runner.data.mnist import SPECS, find_folder

    root = default_data_dir()
    return root if find_folder(Path(root), SPECS["mnist"][0]) else None


def utility_runs(s, sigmas: dict[str, float]) -> pd.DataFrame:
    """Train DP-SBCD once per schedule at the calibrated last-epoch sigma (same final hidden-state epsilon):
    schedule, epoch, test_acc, train_loss, epsilon (certified: composition), epsilon_hsa_assumed, data. MNIST when
    its files are found (DPRUN_DATA_DIR), else synthetic MNIST-shaped data with random labels (chance)."""
    import tempfile

    from runner.paths import compose
    from runner.train import train

    root = mnist_available()
    data = ["dataset=mnist", f"data_dir={root}"] if root else ["dataset=synthetic", "dataset.like=mnist"]
    frames = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule, sigma in sigmas.items():
            cfg = compose(["method=sbcd", *data, f"batch_size={s.batch_size}", f"epochs={s.epochs}",
                           f"sigma={sigma}", f"method.noise_schedule={schedule}", f"method.noise_decay={s.decay}",
                           f"method.noise_floor={s.floor}", f"delta={s.delta}", "progress=false",
                           "checkpoint=false", "device=cpu"])
            train(cfg, f"{tmp}/{schedule}")
            m = pd.read_csv(f"{tmp}/{schedule}/metrics.csv")
            m = m.assign(schedule=schedule, data="mnist" if root else "synthetic (random labels: chance)")
            frames.append(m[["schedule", "epoch", "test_acc", "train_loss", "epsilon", "epsilon_hsa_assumed",
                             "data"]])
    return pd.concat(frames, ignore_index=True)


def adaptive_table(runs, epochs, scale) -> pd.DataFrame:
    from runner.sbcd_curves import constant_vs_adaptive

    s = _adaptive_setup(scale)
    curves = constant_vs_adaptive(s, target_epsilon=ADAPTIVE_TARGET_EPSILON).assign(kind="privacy")
    last = curves.sort_values("epoch").groupby("schedule").tail(1).set_index("schedule")["sigma"]
    utility = utility_runs(s, {k: float(v) for k, v in last.items()}).assign(kind="utility")
    return pd.concat([curves, utility], ignore_index=True).assign(epochs_total=s.epochs)


def draw_adaptive(data, caption, scale):
    s = _adaptive_setup(scale)
    curves = data[data["kind"] == "privacy"] if "kind" in data else data
    utility = data[data["kind"] == "utility"] if "kind" in data else data.iloc[0:0]
    last = curves.sort_values("epoch").groupby("schedule").tail(1).set_index("schedule")["sigma"]
    sig = ", ".join(f"{k} {v:.3g}" for k, v in last.items())
    fig, (eps_ax, sig_ax, acc_ax) = panels(1, 3, f"DP-SBCD: adaptive vs constant noise, calibrated to the same final "
                                           f"hidden-state $\\epsilon$={ADAPTIVE_TARGET_EPSILON:g}\n"
                                           + setting(s, sigma=f"last epoch: {sig}"), 4.6, 4)
    data = curves
    styles = {"constant": dict(color="0.3", ls="--", marker="."), "adaptive": dict(color="#e377c2", marker="*")}
    for schedule, sub in data.groupby("schedule", sort=False):
        eps_ax.plot(sub["epoch"], sub["eps_hidden"], label=schedule, **styles.get(schedule, {}))
        sig_ax.plot(sub["epoch"], sub["sigma"], label=schedule, **styles.get(schedule, {}))
    eps_ax.set(xlabel="epochs trained", ylabel=r"$\epsilon$ so far (hidden-state bound, assumed)",
               title="privacy loss, hidden-state bound (NOT certified)")
    sig_ax.set(xlabel="epoch", ylabel=r"noise multiplier $\sigma$", title="noise added per epoch")
    sig_ax.set_ylim(bottom=0)
    eps_ax.set_ylim(bottom=0)
    for schedule, sub in utility.groupby("schedule", sort=False):
        end = sub.sort_values("epoch").iloc[-1]
        acc_ax.plot(sub["epoch"], sub["test_acc"], **styles.get(schedule, {}),
                    label=f"{schedule}: {end['test_acc']:.1%}; certified $\\epsilon$={shown_epsilon(float(end['epsilon']), 3)} "
                          f"(hidden-state {shown_epsilon(float(end['epsilon_hsa_assumed']), 3)}, assumed)")
    where = str(utility["data"].iloc[0]) if len(utility) else "not trained"
    acc_ax.set(xlabel="epoch", ylabel="test accuracy", title=f"utility: DP-SBCD trained on {where}")
    if len(utility) and "chance" in where:
        acc_ax.text(0.5, 0.5, "random labels: accuracy is chance\nby construction (no MNIST files found)",
                    transform=acc_ax.transAxes, ha="center", color="tab:red", fontsize=8)
    for ax in (eps_ax, sig_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.title.set_fontsize(9)
    fig.text(0.5, 0.075, "Under composition (the certified epsilon a run publishes) the adaptive schedule's small early "
             "noise costs more: compare the certified epsilons in the legend, not only the hidden-state ones.",
             ha="center", fontsize=8, color="0.25", wrap=True)
    fig.tight_layout(rect=(0, 0.12, 1, 0.9))
    fig.text(0.01, 0.005, caption, fontsize=7, color="0.35", ha="left", va="bottom", wrap=True)
    return fig


FIGURES.register("sbcd_hsa_vs_composition")(
    Figure("DP-SBCD", "Privacy loss: hidden state assumption vs composition", "figure",
           None, hsa_table, draw_hsa))
FIGURES.register("sbcd_epoch_contribution")(
    Figure("DP-SBCD", "Contribution of each epoch's noise to the final privacy loss",
           "figure", None, contribution_table, draw_contribution))
FIGURES.register("sbcd_adaptive_noise")(
    Figure("DP-SBCD", "Adaptive vs constant noise at equal final epsilon", "figure", None,
           adaptive_table, draw_adaptive))
