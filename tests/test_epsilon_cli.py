"""`dprun-eps`: the steps it counts are the steps a run takes; bad values are one line naming only the bad value."""
from __future__ import annotations

import pytest
import torch

from runner.data.sampler import Sampler
from runner.epsilon_cli import main


@pytest.mark.parametrize("n,b,epochs", [(25000, 256, 20), (60000, 256, 15), (50000, 256, 20), (1797, 64, 20),
                                        (100, 100, 3), (100, 75, 2)])
def test_dprun_eps_counts_the_steps_a_run_takes(n, b, epochs):
    from runner.epsilon_cli import total_steps

    run = Sampler("poisson", n, b, torch.Generator()).steps_per_epoch * epochs  # what runner/train.py steps
    assert total_steps(n, b, epochs) == run


def test_the_header_shows_the_runs_step_count(capsys):
    assert main(["--n", "25000", "--batch-size", "256", "--epochs", "20", "--sigma", "1.0"]) == 0
    assert "steps=1960 (98 per epoch)" in capsys.readouterr().out  # 98 x 20, not round(20 x 25000 / 256) = 1953


BASE = {"--n": "25000", "--batch-size": "256", "--epochs": "1", "--sigma": "1.0"}


@pytest.mark.parametrize("flag,value,accepted", [
    ("--sigma", "-1", "> 0"), ("--sigma", "0", "> 0"), ("--epochs", "0.001", "--epochs >= 0.0102"),
    ("--epochs", "-2", "positive"), ("--epochs", "nan", "positive"), ("--n", "0", "positive"),
    ("--batch-size", "30000", "between 1 and --n=25000"), ("--delta", "1", "(0, 1)"), ("--n", "abc", "int"),
])
def test_a_bad_value_is_one_line_naming_only_it(capsys, flag, value, accepted):
    argv = [x for k, v in {**BASE, flag: value}.items() for x in (k, v)]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own type errors
        code = e.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("dprun-eps: ") and flag in lines[0] and accepted in lines[0]
    others = [k for k in BASE if k != flag and not (flag == "--batch-size" and k == "--n")]
    assert not any(f"{k}=" in lines[0] for k in others), lines[0]  # only the bad value is named


@pytest.mark.parametrize("extra,line", [
    (["--accountant", "none"], "dprun-eps: --accountant=none computes no epsilon; valid for r=inf (the exact "
                               "Gaussian): gdp, pld, rdp"),
    (["--accountant", "foo"], "dprun-eps: --accountant=foo is not valid; valid for r=inf (the exact Gaussian): gdp, "
                              "pld, rdp"),
    (["--accountant", "rdp", "--r", "4"], "dprun-eps: --accountant=rdp is not valid; valid for JL dimensions (finite "
                                          "--r): jl"),
])
def test_an_accountant_that_computes_nothing_here_is_one_line_before_the_header(capsys, extra, line):
    """--accountant none printed the header, then crashed (AttributeError: 'NoneType' object has no attribute
    'step')."""
    argv = [x for k, v in BASE.items() for x in (k, v)] + extra
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.strip() == line


def test_jl_dimensions_use_jl_beside_another_accountant_for_r_inf(capsys):
    """--accountant rdp --r 4 inf: rdp for r = inf, jl for r = 4 (as the docstring says); it stopped at r = 4."""
    argv = [x for k, v in BASE.items() for x in (k, v)] + ["--accountant", "rdp", "--r", "4", "inf"]
    assert main(argv) == 0
    rows = capsys.readouterr().out.strip().splitlines()[2:]
    assert [r.split()[0] for r in rows] == ["4", "inf"]


def test_a_delta_not_below_one_over_n_is_warned_about_as_dprun_does(capsys):
    from runner.accountants.published import delta_note

    assert main(["--n", "100", "--batch-size", "10", "--sigma", "1.3", "--epochs", "1", "--delta", "0.5"]) == 0
    err = capsys.readouterr().err
    assert err.strip() == f"dprun-eps: warning: {delta_note(0.5, 100)}"
    assert main([x for k, v in BASE.items() for x in (k, v)]) == 0 and capsys.readouterr().err == ""


def test_the_epsilon_column_is_what_a_run_publishes_under_gdp_too(capsys):
    """Review 43: --accountant gdp printed the central-limit approximation (1.501) as the epsilon, where a run with
    accountant=gdp publishes the certified PLD value of the same steps (2.295); the approximation is shown beside it,
    labelled."""
    argv = ["--n", "1437", "--batch-size", "64", "--sigma", "1", "--epochs", "2"]
    assert main(argv) == 0
    pld = capsys.readouterr().out.splitlines()[-1].split()[1]
    assert main(argv + ["--accountant", "gdp"]) == 0
    row = capsys.readouterr().out.splitlines()[-1]
    assert row.split()[1] == pld == "2.295" and "gdp_approx 1.501: not a guarantee" in row, row
