"""`dprun-eps`: epsilon of a DP-SGD / DP-SGD-JL training run, without training.

    dprun-eps --n 60000 --batch-size 256 --sigma 1.3 --epochs 15                 # exact Gaussian, pld
    dprun-eps --n 60000 --batch-size 256 --sigma 1.3 --epochs 15 --r 1 2 4 10 30 inf   # a table over r
    dprun-eps ... --accountant rdp          # r = inf only; JL dimensions always use the jl accountant

Steps = round(epochs x steps per epoch), where an epoch is max(1, round(n / batch_size)) steps: the count a run takes
(runner/data/sampler.py), so `--epochs 20` gives the epsilon a 20-epoch run publishes. Poisson sampling at
q = batch_size / n. r = inf is the exact Gaussian
mechanism (accountant pld unless --accountant says otherwise). An infinite epsilon is printed with the certified
lower bound of the JL analysis, e.g. "inf (> 430)". A delta not below 1/N is warned about on stderr, as dprun does.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from runner.epsilon_shown import shown_epsilon, shown_lower_bound
from runner import accountants
from runner.accountants import SubsampledGaussian, SubsampledJL
from runner.accountants.published import delta_note
from runner.data.sampler import poisson_steps_per_epoch
from runner.entry import OneLineParser, run_entry
from runner.errors import DprunError


def parse_r(text: str) -> float:
    if text.lower() in ("inf", "none", "exact"):
        return math.inf
    try:
        r = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"r={text!r} is not a positive integer or 'inf'") from None
    if r < 1:
        raise argparse.ArgumentTypeError(f"r={text!r} is not a positive integer or 'inf'")
    return r


def total_steps(n: int, batch_size: int, epochs: float) -> int:
    """The steps of `epochs` epochs as a run counts them (a fraction of an epoch rounds to whole steps)."""
    return round(epochs * poisson_steps_per_epoch(n, batch_size))


def check_args(n: int, batch_size: int, sigma: float, epochs: float, delta: float) -> int:
    """The number of steps, or a one-line DprunError naming the one bad value and what is accepted."""
    if n < 1:
        raise DprunError(f"--n={n} must be a positive integer (the training set size)")
    if not 1 <= batch_size <= n:
        raise DprunError(f"--batch-size={batch_size} must be between 1 and --n={n}")
    if not 0 < sigma < math.inf:  # also NaN
        raise DprunError(f"--sigma={sigma} is not valid: the noise multiplier must be a finite number > 0" +
                         (" (sigma=0 adds no noise: no finite epsilon)" if sigma == 0 else ""))
    if not 0 < delta < 1:
        raise DprunError(f"--delta={delta} must be in (0, 1)")
    if not 0 < epochs < math.inf:
        raise DprunError(f"--epochs={epochs} must be a positive number")
    steps = total_steps(n, batch_size, epochs)
    if steps < 1:
        per_epoch = poisson_steps_per_epoch(n, batch_size)
        raise DprunError(f"--epochs={epochs} is 0 steps at {per_epoch} steps per epoch (N={n}, B={batch_size}); "
                         f"give at least one step: --epochs >= {1 / per_epoch:.3g}")
    return steps


def analysing(mechanism) -> list[str]:
    """The registered accountants that analyse `mechanism` (pld, rdp, gdp for the exact Gaussian; jl for JL)."""
    return [name for name, cls in accountants.ACCOUNTANTS.items() if cls().supports(mechanism)]


def check_accountant(name: str | None, rs: list[float]) -> None:
    """--accountant is r=inf's (the exact Gaussian; JL dimensions always use jl): one that analyses it, or, with only
    JL dimensions asked for, jl; a one-line DprunError otherwise (none computes no epsilon)."""
    if name is None:
        return
    exact = any(math.isinf(r) for r in rs)
    mech = SubsampledGaussian(0.5, 1.0) if exact else SubsampledJL(0.5, 1.0, 1)
    valid = analysing(mech)
    if name not in valid:
        where = "r=inf (the exact Gaussian)" if exact else "JL dimensions (finite --r)"
        what = "computes no epsilon" if name == "none" else "is not valid"
        raise DprunError(f"--accountant={name} {what}; valid for {where}: {', '.join(valid)}")


def epsilon_row(n: int, batch_size: int, sigma: float, epochs: float, delta: float, r: float,
                accountant: str | None) -> tuple[float, float, str]:
    """-> (epsilon, seconds, printable) for one r."""
    q, steps = batch_size / n, total_steps(n, batch_size, epochs)
    start = time.perf_counter()
    if math.isinf(r):
        name = accountant or "pld"
        mech = SubsampledGaussian(sample_rate=q, noise_multiplier=sigma)
    else:
        mech = SubsampledJL(sample_rate=q, noise_multiplier=sigma, r=int(r))
        name = accountant if accountant in analysing(mech) else "jl"  # JL dimensions: jl (--accountant is r=inf's)
    acc = accountants.build(name)
    acc.step(mech, count=steps)
    # what a run with this accountant publishes as `epsilon` (runner/accountants/published.py): the certified value;
    # gdp's central-limit number beside it, labelled (review 43: gdp's 1.501 was printed where a run publishes 2.295)
    eps = acc.certified_epsilon(delta)
    text = shown_epsilon(eps)  # rounded up: never below the certified value
    if math.isinf(eps) and hasattr(acc, "epsilon_lower_bound"):
        text = f"inf (> {shown_lower_bound(acc.epsilon_lower_bound(delta), 3)})"
    if not acc.certified:
        text += f" ({acc.label} {shown_epsilon(acc.epsilon(delta))}: not a guarantee)"
    return eps, time.perf_counter() - start, text


def main(argv: list[str] | None = None) -> int:
    """`dprun-eps`: bad input is one line (runner/entry.py)."""
    return run_entry(epsilon_table, "dprun-eps", argv)


def epsilon_table(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="dprun-eps", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, required=True, help="training set size N")
    p.add_argument("--batch-size", type=int, required=True, help="expected batch size B (q = B/N)")
    p.add_argument("--sigma", type=float, required=True, help="noise multiplier")
    p.add_argument("--epochs", type=float, required=True)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--r", type=parse_r, nargs="+", default=[math.inf], help="JL dimensions; 'inf' = exact Gaussian")
    p.add_argument("--accountant", default=None, help="rdp | pld | gdp for r=inf (default pld); finite r always uses jl")
    args = p.parse_args(argv)
    steps = check_args(args.n, args.batch_size, args.sigma, args.epochs, args.delta)
    check_accountant(args.accountant, args.r)  # before the header: a refused command prints one line only
    weak = delta_note(args.delta, args.n)  # as dprun warns
    if weak:
        print(f"dprun-eps: warning: {weak}", file=sys.stderr)
    print(f"N={args.n} B={args.batch_size} q={args.batch_size / args.n:.5g} steps={steps} "
          f"({poisson_steps_per_epoch(args.n, args.batch_size)} per epoch) sigma={args.sigma} delta={args.delta:g}")
    print(f"{'r':>5}  {'epsilon':>22}  {'seconds':>8}")
    for r in args.r:
        _, seconds, text = epsilon_row(args.n, args.batch_size, args.sigma, args.epochs, args.delta, r, args.accountant)
        print(f"{'inf' if math.isinf(r) else int(r):>5}  {text:>22}  {seconds:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
