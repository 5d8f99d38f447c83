"""An epsilon as a reader sees it, rounded up: never shown below the certified value (review 19). No heavy
imports: `dprun --help` and the CLI's printing stay free of torch and the accountants.

    shown_epsilon(2.294312584)      # "2.295"
    shown_epsilon(2.294312584, 3)   # "2.3"
    shown_lower_bound(1.0584e8, 3)  # "1.05e+08": a lower bound, rounded down
    shown_value("epsilon_lower_bound", 1.0584e8)   # by a column's name: the lower bound down, any other epsilon up
    shown_noise(0.968686)           # "0.9686": a sigma, rounded down (its epsilon never below the run's)
"""
from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal


def shown_epsilon(eps: float, digits: int = 4) -> str:
    """An epsilon as a reader sees it (logs, dprun-report, dprun-eps, figure labels): `digits` significant digits,
    rounded UP, so a shown epsilon is never below the certified one (review 19: 2.2943 was shown as 2.29). The
    tables (metrics.csv, summary.json) keep the full value."""
    return _rounded(eps, digits, ROUND_CEILING)


def shown_lower_bound(bound: float, digits: int = 4) -> str:
    """A certified LOWER bound (epsilon_lower_bound: "inf (> bound)"), rounded down: never shown above itself."""
    return _rounded(bound, digits, ROUND_FLOOR)


def shown_noise(sigma: float, digits: int = 4) -> str:
    """A noise multiplier as shown (the calibration's log line, dprun-report, the paper runs' setups), rounded DOWN:
    an epsilon recomputed from the shown sigma is never below the run's (review 43: 0.968686 shown as 0.9687 gave
    1.997221 where the run's is 1.997290)."""
    return _rounded(sigma, digits, ROUND_FLOOR)


def shown_value(column: str, value: float, digits: int = 4) -> str:
    """An epsilon column's value as shown: epsilon_lower_bound rounded down, every other epsilon up."""
    return (shown_lower_bound if column == "epsilon_lower_bound" else shown_epsilon)(value, digits)


def _rounded(eps: float, digits: int, rounding: str) -> str:
    """`digits` significant digits of eps's shortest decimal, rounded as `rounding` (decimal's ROUND_CEILING or
    ROUND_FLOOR); inf, nan and 0 as they are."""
    eps = float(eps)  # a numpy scalar's repr is "np.float64(0.1)" under numpy 2 (review 43: the audit figure crashed)
    if not math.isfinite(eps) or eps == 0:
        return f"{eps:g}"
    shortest = Decimal(repr(eps))  # the float's shortest decimal (0.1, not 0.1000000000000000055...)
    step = Decimal(1).scaleb(shortest.adjusted() - digits + 1)
    # back to a float within an ulp of that decimal, which the format then prints as that decimal: "10", not "1E+1"
    return f"{float(shortest.quantize(step, rounding=rounding)):.{digits}g}"
