"""Review 62 (a newcomer's path): make_private took noise_multiplier=5.0 with target_epsilon and silently trained at
the calibrated 0.25; r=4 with method_options={"r": 8} silently ran r = 4 (epsilon inf instead of 16.1). Both are
refused in one line now, as the CLI refuses sigma= with target_epsilon= and r= against method.r=. And the Makefile
echoed `$(test -x ...)` instead of the interpreter it runs."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import dprun
from runner.errors import DprunError

ROOT = Path(__file__).resolve().parents[1]


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(200, 5, generator=g), torch.randint(0, 3, (200,), generator=g)


def private(**kw):
    model = nn.Linear(5, 3)
    return dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data(), batch_size=20, **kw)


def test_noise_multiplier_with_target_epsilon_is_refused_in_one_line():
    with pytest.raises(DprunError, match=r"^noise_multiplier=5.0 and target_epsilon=50.0 both set the noise[^\n]*"
                                         r"give one of them$"):
        private(noise_multiplier=5.0, target_epsilon=50.0, epochs=1)


def test_target_epsilon_alone_calibrates_and_the_default_sigma_is_one():
    calibrated = private(target_epsilon=50.0, epochs=1)
    assert calibrated.noise_multiplier < 1.0 and calibrated.planned_epsilon <= 50.0
    assert private().noise_multiplier == 1.0
    assert private(noise_multiplier=2.5).noise_multiplier == 2.5


def test_r_and_method_options_r_that_disagree_are_refused_in_one_line():
    with pytest.raises(DprunError, match=r"^r=4 and method_options\['r'\]=8 disagree: r= is a shorthand for "
                                         r"method_options\['r'\]; give one of them$"):
        private(method="jl", r=4, method_options={"r": 8})
    for kw in ({"r": 8}, {"method_options": {"r": 8}}, {"r": 8, "method_options": {"r": 8}}):
        assert private(method="jl", **kw).method.r == 8


@pytest.mark.parametrize("r", [4.7, True, "abc", 0])
def test_r_that_is_not_a_whole_number_is_refused_in_one_line(r):
    """Review 68: r=4.7 ran r = 4, r=True r = 1, r="abc" raised a bare ValueError."""
    with pytest.raises(DprunError, match=r"^r=.* is not (valid: a whole number >= 1|a number)$"):
        private(method="jl", r=r)


def test_make_echoes_the_interpreter_it_runs():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under `make test`
    out = subprocess.run(["make", "--no-print-directory", "-n", "lint", "VENV=/nonexistent"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "python -m ruff check .", out


