"""`dprun-eps`: epsilon of a DP-SGD / DP-SGD-JL training run, without training.

    dprun-eps --n 60000 --batch-size 256 --sigma 1.3 --epochs 15                 # exact Gaussian, pld
    dprun-eps --n 60000 --batch-size 256 --sigma 1.3 --epochs 15 --r 1 2 4 10 30 inf   # a table over r
    dprun-eps ... --accountant rdp          # r = inf only; JL dimensions always use the jl accountant

Steps = round(epochs * n / batch_size), Poisson sampling at q = batch_size / n. r = inf is the exact Gaussian
mechanism (accountant pld unless --accountant says otherwise). An infinite epsilon is printed with the certified
lower bound of the JL analysis, e.g. "inf (> 430)".
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from runner import accountants
from runner.accountants import SubsampledGaussian, SubsampledJL
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


def epsilon_row(n: int, batch_size: int, sigma: float, epochs: float, delta: float, r: float,
                accountant: str | None) -> tuple[float, float, str]:
    """-> (epsilon, seconds, printable) for one r."""
    q, steps = batch_size / n, int(round(epochs * n / batch_size))
    start = time.perf_counter()
    if math.isinf(r):
        name = accountant or "pld"
        mech = SubsampledGaussian(sample_rate=q, noise_multiplier=sigma)
    else:
        name = accountant or "jl"
        mech = SubsampledJL(sample_rate=q, noise_multiplier=sigma, r=int(r))
    acc = accountants.build(name)
    acc.step(mech, count=steps)
    eps = acc.epsilon(delta)
    text = f"{eps:.4g}"
    if math.isinf(eps) and hasattr(acc, "epsilon_lower_bound"):
        text = f"inf (> {acc.epsilon_lower_bound(delta):.3g})"
    elif getattr(acc, "approximate", False):
        text += " (approximate)"
    return eps, time.perf_counter() - start, text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dprun-eps", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, required=True, help="training set size N")
    p.add_argument("--batch-size", type=int, required=True, help="expected batch size B (q = B/N)")
    p.add_argument("--sigma", type=float, required=True, help="noise multiplier")
    p.add_argument("--epochs", type=float, required=True)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--r", type=parse_r, nargs="+", default=[math.inf], help="JL dimensions; 'inf' = exact Gaussian")
    p.add_argument("--accountant", default=None, help="rdp | pld | gdp for r=inf (default pld); jl for finite r")
    args = p.parse_args(argv)
    try:
        if args.n < 1 or not 1 <= args.batch_size <= args.n:
            raise DprunError(f"--batch-size={args.batch_size} must be in [1, --n={args.n}]")
        if args.sigma <= 0 or args.epochs <= 0:
            raise DprunError(f"--sigma={args.sigma} and --epochs={args.epochs} must be > 0")
        steps = int(round(args.epochs * args.n / args.batch_size))
        print(f"N={args.n} B={args.batch_size} q={args.batch_size / args.n:.5g} steps={steps} sigma={args.sigma} "
              f"delta={args.delta:g}")
        print(f"{'r':>5}  {'epsilon':>22}  {'seconds':>8}")
        for r in args.r:
            _, seconds, text = epsilon_row(args.n, args.batch_size, args.sigma, args.epochs, args.delta, r,
                                           args.accountant)
            print(f"{'inf' if math.isinf(r) else int(r):>5}  {text:>22}  {seconds:>8.2f}", flush=True)
    except DprunError as e:
        print(f"dprun-eps: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
