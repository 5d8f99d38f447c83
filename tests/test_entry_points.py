"""Every entry point handles a user's mistake the way `dprun` does (runner/entry.py): ONE line naming the bad
value, exit 2, no traceback; --help prints usage. dprun's own cases are in tests/test_cli.py."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from runner.entry import run_entry

# (module, prog, argv, what the one line says)
CASES = [
    ("runner.epsilon_cli", "dprun-eps", ["--n", "0", "--batch-size", "1", "--sigma", "1", "--epochs", "1"],
     r"--n=0 must be a positive integer"),
    ("runner.epsilon_cli", "dprun-eps", ["--bogus"], r"arguments are required: --n"),
    ("runner.report", "dprun-report", ["--root", "{tmp}/nope"], r"no outputs folder"),
    ("runner.report", "dprun-report", ["--bogus"], r"unrecognized arguments: --bogus"),
    ("runner.signal_check", "python -m runner.signal_check", ["dataset=nope"], r"dataset.*nope"),
    ("runner.signal_check", "python -m runner.signal_check", ["dataset=imdb", "data_dir={tmp}"], r"imdb"),
    ("runner.signal_check", "python -m runner.signal_check", ["lr=[1"], r"."),
    ("runner.memory_study", "python -m runner.memory_study", ["--scale", "huge"], r"invalid choice: 'huge'"),
    ("runner.plots", "python -m runner.plots", [], r"name a figure"),
    ("runner.bench.clip", "python -m runner.bench.clip", ["--device", "tpu"], r"unknown device 'tpu'"),
    ("runner.bench.clip", "python -m runner.bench.clip", ["--workloads", "nope"], r"unknown workload 'nope'"),
    ("runner.bench.jl", "python -m runner.bench.jl", ["--device", "tpu"], r"unknown device 'tpu'"),
    ("runner.bench.logical", "python -m runner.bench.logical", ["--bogus"], r"unrecognized arguments: --bogus"),
    ("runner.bench.distributed", "python -m runner.bench.distributed", ["--nproc", "1,x"], r"--nproc=1,x must be"),
    ("runner.bench.adversarial", "python -m runner.bench.adversarial", ["--eps", "x"], r"invalid float value: 'x'"),
    ("runner.bench.overclip", "python -m runner.bench.overclip", ["--batch", "x"], r"invalid int value: 'x'"),
]


@pytest.mark.parametrize("module, prog, argv, says", CASES, ids=[f"{c[0]}:{' '.join(c[2])}" for c in CASES])
def test_bad_input_is_one_line(module, prog, argv, says, tmp_path, capsys):
    main = importlib.import_module(module).main
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = main(argv) if module in ("runner.epsilon_cli", "runner.report") else run_entry(main, prog, argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"{prog}: "), err
    assert re.search(says, err), err


@pytest.mark.parametrize("module", sorted({c[0] for c in CASES}))
def test_each_module_runs_its_main_through_run_entry(module):
    """`python -m <module>` goes through runner/entry.py (dprun-eps and dprun-report: their main calls it)."""
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    main_block = source.split('if __name__ == "__main__":')[-1]
    assert "run_entry(" in main_block or ("run_entry(" in source and "sys.exit(main())" in main_block), module


def test_the_readme_signal_check_line_without_the_data_and_help(tmp_path, capsys):
    """README's `python -m runner.signal_check dataset=imdb` where the data is missing: one line, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "runner.signal_check", "dataset=imdb", f"data_dir={tmp_path}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("python -m runner.signal_check: ")
    # --help: what `python -m runner.signal_check --help` runs (its __main__ block, checked above), in this process
    from runner.signal_check import main

    assert run_entry(main, "python -m runner.signal_check", ["--help"]) == 0
    helped = capsys.readouterr()
    assert "Usage:" in helped.out and helped.err == "", helped.err
