"""An epsilon shown to a reader is never below the certified one (review 19: dprun-report printed 2.2943 as 2.29,
dprun-eps as 2.294): rounded up to its digits everywhere it is printed; the tables keep the full value."""
from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pytest

from runner.epsilon_shown import shown_epsilon
from runner.report import epsilon_text


@pytest.mark.parametrize("digits", [2, 3, 4])
def test_shown_epsilon_is_never_below_and_within_one_unit_of_its_last_digit(digits):
    rng = np.random.default_rng(0)
    values = np.concatenate([10.0 ** rng.uniform(-8, 12, 20000), [2.294312584, 0.86381, 9.99951, 1.0, 0.1, 5.0,
                                                                   np.nextafter(2.0, 3.0), np.nextafter(2.0, 1.0)]])
    for v in map(float, values):
        shown = shown_epsilon(v, digits)
        assert Decimal(shown) >= Decimal(repr(v)), (v, shown)
        unit = 10.0 ** (math.floor(math.log10(v)) - digits + 1)
        assert float(shown) - v <= unit * (1 + 1e-9), (v, shown)
        assert len(Decimal(shown).normalize().as_tuple().digits) <= digits, (v, shown)


def test_numpy_scalars_are_shown_as_their_float():
    """Review 43: numpy 2's repr of a float64 is "np.float64(2.2943)", which Decimal refused, so the audit figure (its
    claimed epsilons a numpy column) could not be drawn."""
    from runner.epsilon_shown import shown_lower_bound

    assert shown_epsilon(np.float64(2.2943)) == shown_epsilon(2.2943) == "2.295"
    assert shown_epsilon(np.float32(0.5), 3) == "0.5" and shown_lower_bound(np.float64(9.99951), 3) == "9.99"


def test_a_shown_sigma_is_rounded_down_in_the_report_too():
    """Review 43: a calibrated sigma of 0.968686 was shown as 0.9687, and an epsilon recomputed from the shown value
    came out below the run's (1.997221 against 1.997290). Shown sigmas are rounded down: the log, dprun-report."""
    import pandas as pd

    from runner.epsilon_shown import shown_noise
    from runner.report import summary_columns

    assert shown_noise(0.968686) == "0.9686" and shown_noise(1.0) == "1" and shown_noise(2.99999) == "2.999"
    view = summary_columns(pd.DataFrame({"sigma": [0.968686, None], "epsilon": [3.0, None]}))
    assert list(view["sigma"]) == ["0.9686", ""], list(view["sigma"])


def test_the_report_and_the_logs_round_up():
    assert epsilon_text(2.294312584, float("nan")) == "2.3"
    assert shown_epsilon(2.294312584) == "2.295"
    assert shown_epsilon(6.1736) == "6.174" and shown_epsilon(6.1736, 3) == "6.18"
    assert shown_epsilon(2.29) == "2.29" and shown_epsilon(5.0) == "5" and shown_epsilon(9.99951) == "10"
    assert shown_epsilon(math.inf) == "inf" and shown_epsilon(0.0) == "0"


@pytest.mark.parametrize("table", [True, False])
def test_the_clis_last_lines_round_up(tmp_path, capsys, table):
    """Review 21: the interactive CLI's table (a terminal's default) printed metrics.csv's 1.208330843788459 as
    1.208; the plain last line already said 1.209."""
    import pandas as pd

    from runner.cli import print_result

    pd.DataFrame([{"epoch": 1, "train_loss": 0.5, "test_acc": 0.9, "epoch_time_s": 1.0,
                   "epsilon": 1.208330843788459}]).to_csv(tmp_path / "metrics.csv", index=False)
    summary = {"method": "reweight", "config": {"dataset": {"name": "digits"}},
               "final": {"epsilon": 1.208330843788459, "test_acc": 0.9}}
    print_result(summary, tmp_path, table=table)
    out = capsys.readouterr().out
    assert "1.209" in out and "1.208" not in out, out


def test_a_lower_bound_is_shown_rounded_down():
    """Review 22: the epoch line and the CLI's table rounded epsilon_lower_bound up (1.0584e8 as 1.059e+08) and the
    jl note to nearest (> 1.06e+08): a lower bound shown must not exceed itself."""
    from runner.epsilon_shown import shown_lower_bound, shown_value

    assert shown_lower_bound(1.0584e8, 3) == "1.05e+08" and shown_lower_bound(2.0, 3) == "2"
    assert shown_value("epsilon_lower_bound", 1.0584e8) == "1.058e+08"
    assert shown_value("epsilon", 1.0584e8) == "1.059e+08"
    assert epsilon_text(math.inf, 1.0584e8) == "inf (> 1.05e+08)"
    rng = np.random.default_rng(1)
    for v in map(float, 10.0 ** rng.uniform(-3, 12, 5000)):
        assert Decimal(shown_lower_bound(v, 3)) <= Decimal(repr(v)), v
