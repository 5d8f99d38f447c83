"""`make audit`: claimed vs audited epsilon, one training run per point (docs/audit.md).

    python -m runner.figures.audit        # digits, CPU minutes -> outputs/figures/audit.png, outputs/tables/audit.csv
    python -m runner.figures.audit --dataset mnist --epochs 15 --device cuda   # MNIST files in data_dir

Arms: non-private, exact DP-SGD (method=reweight) calibrated to several epsilons, DP-SGD-JL(10) and DP-SBCD; each
with gradient (white-box) and input (black-box) canaries, audit.canaries=1000 (DP-SBCD: input only, its step is no
clipped gradient sum). A private point must lie below the diagonal (audited <= claimed); the non-private run has no
claim (drawn at "inf") and should audit high; the dashed line is the ceiling of m canaries (perfect guessing).
"""
from __future__ import annotations

import argparse
import logging
import math
from pathlib import Path

import pandas as pd

from runner.epsilon_shown import shown_epsilon
from runner.figures.style import plt

ARMS = [  # (label, overrides); target_epsilon calibrates sigma
    ("Non-private", ["method=nonprivate"]),
    ("DP-SGD eps=1", ["method=reweight", "target_epsilon=1"]),
    ("DP-SGD eps=4", ["method=reweight", "target_epsilon=4"]),
    ("DP-SGD eps=8", ["method=reweight", "target_epsilon=8"]),
    ("DP-SGD-JL(10)", ["method=jl", "r=10", "target_epsilon=8"]),
    ("DP-SBCD", ["method=sbcd"]),
]
KINDS = ("gradient", "input")
COLORS = {"Non-private": "#444444", "DP-SGD eps=1": "#98df8a", "DP-SGD eps=4": "#2ca02c", "DP-SGD eps=8": "#145214",
          "DP-SGD-JL(10)": "#9467bd", "DP-SBCD": "#e377c2"}


def run_grid(out: Path, dataset: str, epochs: int, canaries: int, device: str) -> pd.DataFrame:
    """Train every arm with each canary kind; one row per run: label, kind, claimed, audited (both bounds), ceiling."""
    from runner.paths import compose, register_resolvers
    from runner.train import train

    register_resolvers()
    rows = []
    for label, overrides in ARMS:
        for kind in KINDS:
            if kind == "gradient" and "method=sbcd" in overrides:
                continue
            name = f"{label}_{kind}".replace(" ", "_").replace("=", "")
            cfg = compose([f"dataset={dataset}", f"epochs={epochs}", f"device={device}", "progress=false",
                           "audit=one_run", f"audit.canary={kind}", f"audit.canaries={canaries}", *overrides])
            audit = train(cfg, out / name)["audit"]
            rows.append({"label": label, "kind": kind, "claimed": audit["epsilon_claimed"],
                         "audited": audit["epsilon_lower_bound"], "audited_fdp": audit["epsilon_lower_bound_fdp"],
                         "ceiling": audit["ceiling"], "ceiling_fdp": audit["ceiling_fdp"],
                         "correct": audit["correct"], "guesses": audit["guesses"]})
    return pd.DataFrame(rows)


def draw(data: pd.DataFrame, title: str):
    """Two panels (gradient, input canaries): per arm, the claimed epsilon (hollow bar; hatched to the top where
    nothing is claimed) and the audited lower bounds (filled: f-DP, dark: Steinke et al.), each value written."""
    claimed = pd.to_numeric(data["claimed"], errors="coerce").fillna(math.inf)
    finite = claimed[claimed < math.inf]
    top = max(finite.max() if len(finite) else 1.0, data["audited_fdp"].max(), 1.0) * 1.15
    labels = [label for label, _ in ARMS]
    fig, axes = plt.subplots(1, len(KINDS), figsize=(12, 4.8), sharey=True)
    for ax, kind in zip(axes, KINDS):
        part = data[data["kind"] == kind].set_index("label")
        for i, label in enumerate(labels):
            if label not in part.index:
                ax.text(i, 0.02 * top, "n/a: no\ngradient sum", ha="center", fontsize=7, color="gray")
                continue
            row, color = part.loc[label], COLORS.get(label, "#1f77b4")
            eps = claimed[data[(data["kind"] == kind) & (data["label"] == label)].index[0]]
            no_claim = not math.isfinite(eps)
            ax.bar(i - 0.2, top if no_claim else eps, width=0.38, facecolor="none", edgecolor=color,
                   hatch="//" if no_claim else None, lw=1.5)
            ax.text(i - 0.2, (0.5 * top if no_claim else eps), "no claim" if no_claim else shown_epsilon(eps, 3),
                    ha="center", va="bottom", fontsize=7, rotation=90 if no_claim else 0)
            ax.bar(i + 0.2, row["audited_fdp"], width=0.38, color=color, alpha=0.55)
            ax.bar(i + 0.2, row["audited"], width=0.38, color=color)
            ax.text(i + 0.2, row["audited_fdp"] + 0.01 * top, f"{row['audited_fdp']:.2g}", ha="center",
                    va="bottom", fontsize=7, fontweight="bold")
        ax.axhline(part["ceiling_fdp"].iloc[0], color="gray", ls="--", lw=1)
        ax.text(len(labels) - 0.5, part["ceiling_fdp"].iloc[0], "ceiling of m canaries (f-DP)", color="gray",
                fontsize=7, ha="right", va="bottom")
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylim(0, top)
        ax.set_title(f"{kind} canaries ({'white-box' if kind == 'gradient' else 'black-box: the final model only'})",
                     fontsize=10)
    axes[0].set_ylabel("epsilon at delta = 1e-5")
    fig.text(0.5, 0.005, "hollow bar: claimed epsilon (accountant); filled bar: audited lower bound at 95% "
             "(light: f-DP, dark: Steinke et al.). A private run passes when its filled bar stays below its hollow "
             "one.", ha="center", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runner.figures.audit", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="digits")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--canaries", type=int, default=1000)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="outputs")
    p.add_argument("--redraw", action="store_true", help="redraw from <out>/tables/audit.csv (no training)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    table = out / "tables" / "audit.csv"
    if args.redraw:
        data = pd.read_csv(table)
    else:
        data = run_grid(out / "runs" / "audit", args.dataset, args.epochs, args.canaries, args.device)
        table.parent.mkdir(parents=True, exist_ok=True)
        data.to_csv(table, index=False)
    title = (f"Claimed vs audited epsilon, one run each: {args.dataset}, {args.epochs} epochs, m = {args.canaries} "
             f"canaries, delta = 1e-5")
    fig = draw(data, title)
    png = out / "figures" / "audit.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    print(f"audit: {table} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
