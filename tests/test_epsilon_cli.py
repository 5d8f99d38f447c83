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
