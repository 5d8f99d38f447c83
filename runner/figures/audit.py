"""`make audit`: claimed vs audited epsilon, one training run per point (docs/audit.md).

    python -m runner.figures.audit                       # digits, CPU minutes -> outputs/figures/audit.png, tables/audit.csv
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
    """Two panels (gradient, input canaries): audited vs claimed epsilon; filled = f-DP bound, hollow = Steinke."""
    claimed = pd.to_numeric(data["claimed"], errors="coerce").fillna(math.inf)
    finite = claimed[claimed < math.inf]
    top = max(finite.max() if len(finite) else 1.0, 1.0)
    inf_x = top * 1.35  # where "no claim" (non-private, or an infinite epsilon) is drawn
    fig, axes = plt.subplots(1, len(KINDS), figsize=(11, 4.6), sharey=True)
    ymax = max(data["audited_fdp"].max(), data["audited"].max(), top) * 1.1
    for ax, kind in zip(axes, KINDS):
        part = data[data["kind"] == kind]
        ax.plot([0, top * 1.2], [0, top * 1.2], color="black", lw=1)
        ax.fill_between([0, top * 1.2], [0, top * 1.2], ymax, color="#d62728", alpha=0.08)
        ax.text(0.05 * top, 0.93 * ymax, "above the diagonal: the claim is false (privacy bug)", color="#d62728",
                fontsize=8, va="top")
        for _, row in part.iterrows():
            x = inf_x if not math.isfinite(claimed[row.name]) else claimed[row.name]
            color = COLORS.get(row["label"], "#1f77b4")
            ax.scatter([x], [row["audited_fdp"]], color=color, s=60, zorder=3, label=row["label"])
            ax.scatter([x], [row["audited"]], facecolors="none", edgecolors=color, s=60, zorder=3)
            ax.plot([x, x], [row["audited"], row["audited_fdp"]], color=color, lw=1, zorder=2)
        if len(part):
            ax.axhline(part["ceiling_fdp"].iloc[0], color="gray", ls="--", lw=1)
            ax.text(0.05 * top, part["ceiling_fdp"].iloc[0], "ceiling of m canaries (f-DP)", color="gray",
                    fontsize=8, va="bottom")
        ax.axvline(top * 1.2, color="gray", lw=0.5)
        ticks = [t for t in ax.get_xticks() if 0 <= t <= top * 1.2]
        ax.set_xticks(ticks + [inf_x], [f"{t:g}" for t in ticks] + ["inf\n(no claim)"])
        ax.set_xlim(0, inf_x * 1.08)
        ax.set_ylim(0, ymax)
        ax.set_xlabel("claimed epsilon (accountant)")
        ax.set_title(f"{kind} canaries ({'white-box' if kind == 'gradient' else 'black-box, final model'})")
    axes[0].set_ylabel("audited epsilon lower bound (95%)\nfilled: f-DP (Gaussian), hollow: Steinke et al.")
    handles, labels = axes[0].get_legend_handles_labels()
    more_h, more_l = axes[-1].get_legend_handles_labels()
    seen = dict(zip(labels + more_l, handles + more_h))
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=len(seen), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runner.figures.audit", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="digits")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--canaries", type=int, default=1000)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="outputs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    table = out / "tables" / "audit.csv"
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
