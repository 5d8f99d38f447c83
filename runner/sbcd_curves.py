"""The three privacy curves of the DP-SBCD slides, as pandas DataFrames (and CSV files) for the figures.

    from runner.sbcd_curves import CurveSetup, privacy_vs_epochs, epoch_contributions, constant_vs_adaptive
    setup = CurveSetup(n=60000, batch_size=3000, epochs=50, sigma=2.0)    # an MNIST-like DP-SBCD run
    privacy_vs_epochs(setup)        # epoch, eps_hidden, eps_composition      (hidden state vs composition)
    epoch_contributions(setup)      # epoch, cost, share                      (the last epochs dominate)
    constant_vs_adaptive(setup, 3)  # schedule, epoch, sigma, eps_hidden      (equal final epsilon)

    python -m runner.sbcd_curves outputs/reference/sbcd      # writes the three CSVs there

Nothing is trained: the curves come from the mechanisms DP-SBCD would report (runner/methods/sbcd/, the same bounds.hidden_state_step), fed to the
hidden-state accountant (runner/accountants/hsa.py).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from runner.accountants.hsa import HiddenStateAccountant
from runner.accountants.mechanisms import HiddenStateStep
from runner.methods.sbcd.bounds import hidden_state_step, network_constants
from runner.methods.sbcd.schedule import noise_multiplier


@dataclass(frozen=True)
class CurveSetup:
    n: int = 60000
    batch_size: int = 3000
    epochs: int = 50
    depth: int = 1  # hidden layers D (D + 1 weight blocks)
    sigma: float = 2.0  # last-epoch noise multiplier
    eta: float = 1.5
    gamma: float = 1.0
    x_radius: float = 1.0
    u_radius: float = 1.0
    reg: str = "l2"
    reg_lambda: float = 0.05
    delta: float = 1e-5
    schedule: str = "constant"
    decay: float = 0.9
    floor: float = 0.25


def run_steps(s: CurveSetup, epochs: int | None = None) -> list[HiddenStateStep]:
    """The HiddenStateSteps of the first `epochs` epochs of a run with fixed batches of size b (the last smaller)."""
    consts = network_constants(depth=s.depth, gamma=s.gamma, x_radius=[s.x_radius] * (s.depth + 1),
                               u_radius=[s.u_radius] * s.depth, eta=s.eta, reg=s.reg, lam=s.reg_lambda)
    nb = math.ceil(s.n / s.batch_size)
    steps = []
    for k in range(s.epochs if epochs is None else epochs):
        sig = noise_multiplier(s.schedule, sigma=s.sigma, epoch=k, epochs=s.epochs, decay=s.decay, floor=s.floor)
        for j in range(nb):
            size = min(s.batch_size, s.n - j * s.batch_size)
            steps.append(hidden_state_step(consts, eta=s.eta, sigma_k=sig, b=s.batch_size, n=s.n, epoch=k, batch=j,
                                           batch_size=size))
    return steps


def privacy_vs_epochs(s: CurveSetup) -> pd.DataFrame:
    """Epsilon of the model released after each epoch: hidden state vs every intermediate model released."""
    acc, rows, nb = HiddenStateAccountant(), [], math.ceil(s.n / s.batch_size)
    steps = run_steps(s)
    for k in range(s.epochs):
        for m in steps[k * nb:(k + 1) * nb]:
            acc.step(m)
        rows.append({"epoch": k + 1, "eps_hidden": acc.epsilon(s.delta),
                     "eps_composition": acc.epsilon_composition(s.delta), "schedule": s.schedule, "sigma": s.sigma})
    return pd.DataFrame(rows)


def epoch_contributions(s: CurveSetup) -> pd.DataFrame:
    """Per epoch k, the hidden-state RDP cost (eps_K(alpha) = alpha * sum_k cost_k) spent on the noise of epoch k,
    for the key example in the batch with the largest total cost; `share` sums to 1."""
    acc = HiddenStateAccountant()
    for m in run_steps(s):
        acc.step(m)
    C, _ = acc.costs("hidden")
    cost = acc.epoch_costs(int(np.argmax(C[:-1])))
    return pd.DataFrame({"epoch": np.arange(1, len(cost) + 1), "cost": cost, "share": cost / cost.sum()})


def final_epsilon(s: CurveSetup) -> float:
    acc = HiddenStateAccountant()
    for m in run_steps(s):
        acc.step(m)
    return acc.epsilon(s.delta)


def calibrate_sigma(s: CurveSetup, target: float, iters: int = 40) -> float:
    """The last-epoch sigma at which the run's final hidden-state epsilon equals `target` (bisection in log sigma)."""
    lo, hi = 1e-2, 1e3
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if final_epsilon(replace(s, sigma=mid)) > target else (lo, mid)
    return hi


def constant_vs_adaptive(s: CurveSetup, target_epsilon: float) -> pd.DataFrame:
    """Both schedules calibrated to the same final epsilon: per epoch its noise multiplier and epsilon so far.
    The adaptive schedule adds less noise in the early epochs for the same final guarantee."""
    frames = []
    for schedule in ("constant", "adaptive"):
        t = replace(s, schedule=schedule)
        t = replace(t, sigma=calibrate_sigma(t, target_epsilon))
        df = privacy_vs_epochs(t)
        df["sigma"] = [noise_multiplier(schedule, sigma=t.sigma, epoch=k, epochs=t.epochs, decay=t.decay,
                                        floor=t.floor) for k in range(t.epochs)]
        frames.append(df)
    return pd.concat(frames, ignore_index=True)[["schedule", "epoch", "sigma", "eps_hidden", "eps_composition"]]


def write_curves(out_dir: str | Path, s: CurveSetup = CurveSetup(), target_epsilon: float = 3.0) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = {"sbcd_privacy_vs_epochs.csv": privacy_vs_epochs(s), "sbcd_epoch_contributions.csv":
              epoch_contributions(s), "sbcd_constant_vs_adaptive.csv": constant_vs_adaptive(s, target_epsilon)}
    for name, df in tables.items():
        df.to_csv(out / name, index=False)
    return [out / name for name in tables]


if __name__ == "__main__":
    for path in write_curves(sys.argv[1] if len(sys.argv) > 1 else "outputs/sbcd_curves"):
        print(path)
