"""DP-SBCD's three slide figures (hidden-state-dp-sbcd-slides), computed by runner/sbcd_curves.py, no training:
privacy loss vs epochs under the hidden-state analysis vs composition, the per-epoch contribution to the final
privacy loss, and adaptive vs constant noise.

    python -m runner.plots sbcd_hsa_vs_composition sbcd_epoch_contribution sbcd_adaptive_noise

Each curve function of runner.sbcd_curves returns a DataFrame; one numeric x column (the first column) and one
column per curve (wide), or x, a `curve` label column and a value column (long). Both draw as one line per curve.
"""
from __future__ import annotations

import pandas as pd

from runner.figures.spec import Figure, add
from runner.figures.style import finish, panels

def _privacy_vs_epochs() -> pd.DataFrame:  # epoch, eps_hidden, eps_composition
    from runner.sbcd_curves import CurveSetup, privacy_vs_epochs

    return privacy_vs_epochs(CurveSetup())[["epoch", "eps_hidden", "eps_composition"]]


def _epoch_contributions() -> pd.DataFrame:  # epoch, share of the final hidden-state RDP cost
    from runner.sbcd_curves import CurveSetup, epoch_contributions

    return epoch_contributions(CurveSetup())[["epoch", "share"]]


def _constant_vs_adaptive() -> pd.DataFrame:  # epoch, then eps_hidden and sigma per schedule, equal final epsilon
    from runner.sbcd_curves import CurveSetup, constant_vs_adaptive

    long = constant_vs_adaptive(CurveSetup(), target_epsilon=3.0)
    wide = long.pivot(index="epoch", columns="schedule", values=["eps_hidden", "sigma"])
    wide.columns = [f"{value} ({schedule})" for value, schedule in wide.columns]
    return wide.reset_index()


CURVES = {  # figure name -> (curve function, title, y label, log y); setup: runner.sbcd_curves.CurveSetup()
    "sbcd_hsa_vs_composition": (_privacy_vs_epochs, "DP-SBCD: privacy loss under the hidden state assumption vs "
                                "composition", r"privacy loss $\epsilon$", True),
    "sbcd_epoch_contribution": (_epoch_contributions, "DP-SBCD: contribution of each epoch's noise to the final "
                                "privacy loss (HSA)", "share of the final privacy loss", False),
    "sbcd_adaptive_noise": (_constant_vs_adaptive, "DP-SBCD: adaptive vs constant noise at equal final epsilon",
                            r"$\epsilon$ (hidden state) and noise multiplier $\sigma$", False),
}


def make(name: str, curve, title: str, ylabel: str, log: bool) -> Figure:
    def table(runs, epochs, scale) -> pd.DataFrame:
        return curve()

    def draw(data, caption, scale):
        fig, (ax,) = panels(1, 1, title, 6.5, 4)
        x = data.columns[0]
        label_col = next((c for c in ("curve", "series", "label", "method") if c in data), None)
        if label_col:
            y = [c for c in data.select_dtypes("number").columns if c != x][-1]
            for label, sub in data.groupby(label_col, sort=False):
                ax.plot(sub[x], sub[y], marker=".", label=str(label))
        else:
            for col in data.select_dtypes("number").columns:
                if col != x:
                    ax.plot(data[x], data[col], marker=".", label=str(col))
        ax.set(xlabel=str(x), ylabel=ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        return finish(fig, caption)

    return add(Figure(name, "DP-SBCD", title, "figure", None, table, draw))


for _name, _args in CURVES.items():
    make(_name, *_args)
