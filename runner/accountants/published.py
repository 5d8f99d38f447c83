"""What a run publishes as its epsilon: only a certified upper bound, under the sampling it really used.

    cols = epsilon_columns(accountant, delta=1e-5, sampling="poisson")   # {"epsilon": 0.86}
    epsilon_columns(gdp_acc, 1e-5, "poisson")      # {"epsilon": <PLD>, "epsilon_gdp_approx": <CLT>}
    epsilon_columns(hsa_acc, 1e-5, "fixed")        # {"epsilon": <composition>, "epsilon_hsa_assumed": <bound>}
    epsilon_columns(pld_acc, 1e-5, "shuffle")      # {"epsilon": "", "epsilon_poisson_assumed": <PLD>}

The column `epsilon` (metrics.csv, summary.json, the report and the figures) is always a guarantee or empty:
  - a non-certified accountant (gdp, hsa) contributes its own number only in `epsilon_<label>`, next to the
    certified epsilon of the same steps;
  - a run whose sampling differs from what the accountant's analysis assumes (sampling=shuffle|fixed with the
    Poisson-subsampled accountants) has an empty `epsilon`; the number that would hold under the assumed sampling
    goes to `epsilon_<assumed>_assumed`, since no accountant here analyses that sampling.
"""
from __future__ import annotations

import math

from runner.accountants.base import Accountant
from runner.randomness import guarantee_note


def epsilon_columns(accountant: Accountant, delta: float, sampling: str) -> dict[str, float | str]:
    certified = accountant.certified_epsilon(delta)
    cols: dict[str, float | str] = {}
    if sampling == accountant.assumes_sampling:
        cols["epsilon"] = certified
    else:
        cols["epsilon"] = ""
        cols[f"epsilon_{accountant.assumes_sampling}_assumed"] = certified
    if not accountant.certified:
        cols[f"epsilon_{accountant.label}"] = accountant.epsilon(delta)
    return {**cols, **accountant.extra_metrics(delta)}


def privacy_notes(accountant: Accountant | None, sampling: str, log_norms: bool = False, rng: str = "seeded",
                  seed: int | None = None) -> list[str]:
    """Plain-language statements for summary.json: what the published epsilon covers and what it does not."""
    if accountant is None:
        return ["non-private run: no epsilon"]
    notes = [guarantee_note(rng, seed),  # who the guarantee holds against (runner/randomness.py)
             "train_loss, train_acc and nonfinite_records (records whose loss or gradient was not finite: they "
             "added nothing) are computed on the private training data without noise: they are outside the privacy "
             "accounting; publish test metrics only",
             "epsilon covers this run alone: publishing or choosing among several runs trained on the same data (a "
             "sweep over hyperparameters) composes their privacy losses; the timings (epoch_time_s, step_time_s) "
             "and peak_mem_bytes depend on the sampled batches (their sizes; for jl and twopass the records whose gradient "
             "is not finite, left out by bisection) and are outside the accounting too; so does a "
             "`diverged` status (a step in which no example was finite ends the run, docs/privacy.md)"]
    if accountant.name == "hsa":  # DP-SBCD's analysis (docs/sbcd.md): S_g = 2G, one record replaced
        notes.append("neighbouring datasets: accountant=hsa's epsilon (DP-SBCD) is for one record replaced, the other "
                     "accountants' (pld, rdp, gdp, jl) for one record added or removed: not the same privacy unit, "
                     "so compare the two with care")
    if log_norms:
        notes.append("log_norms: the per-example gradient norm quantiles (norm_p10 .. norm_max) and unclipped_frac "
                     "are computed on the private training data without noise: NOT differentially private, outside "
                     "the privacy accounting; do not publish them")
    if sampling != accountant.assumes_sampling:
        notes.append(f"sampling={sampling}: no accountant here analyses it, so `epsilon` is empty; "
                     f"epsilon_{accountant.assumes_sampling}_assumed holds only under {accountant.assumes_sampling} "
                     f"sampling (docs/privacy.md)")
    if accountant.name == "gdp":
        notes.append("epsilon_gdp_approx is the Gaussian-DP central-limit approximation and can underestimate; "
                     "`epsilon` is the PLD epsilon of the same steps (certified)")
    if accountant.name == "hsa":
        notes.append("epsilon_hsa_assumed is the hidden-state bound under assumptions the implemented DP-SBCD step "
                     "does not satisfy (the theta-step map is not Lipschitz: docs/sbcd.md); it is NOT a guarantee. "
                     "`epsilon` is the composition epsilon (every intermediate model released), which holds")
    return notes


def delta_note(delta: float | None, n: int) -> str | None:
    """A warning when delta >= 1/n: an (epsilon, delta) guarantee that weak is met by a mechanism that publishes one
    of the n training records outright, at random (the usual advice, e.g. TF Privacy's and Opacus's: delta well
    below 1/n). None when delta < 1/n, or no delta or no data."""
    if delta is None or n <= 0 or float(delta) < 1.0 / n:
        return None
    return (f"delta={float(delta):g} is not below 1/N = 1/{n} = {1.0 / n:.3g}: an (epsilon, delta) guarantee that "
            f"weak allows publishing a training record outright; use delta < 1/N (e.g. {10 ** -math.ceil(math.log10(n) + 1):g})")

