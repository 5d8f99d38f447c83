"""User-path review 15: a sweep's refused job is one line; out_dir= a file or a sweep's folder is refused; summary.json
follows each epoch; the missing MNIST files named are the missing ones; final.epsilon is a number or null;
dprun-eps's --sigma is refused before any output; config.yaml's max_eval_batches comment."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import ROOT, dprun_in_process

TINY = ("epochs=1", "max_steps_per_epoch=2")


def one_line(proc) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_sweeps_refused_job_is_one_line_and_the_sweep_goes_on(tmp_path):
    from runner.report import collect

    proc = dprun_in_process("-m", "method=reweight", "clip=0,1", *TINY, cwd=tmp_path)
    assert proc.returncode == 1  # a job of the sweep did not run
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr
    assert "HYDRA_FULL_ERROR" not in proc.stderr
    assert proc.stderr.count("dprun: clip=0 is not valid") == 1
    runs = collect(tmp_path / "outputs")
    assert sorted(runs["status"]) == ["failed-to-start", "finished"]  # the other job ran


def test_sweep_status_reads_job_folders_of_other_processes(tmp_path):
    """A launcher's worker (joblib, Slurm) ran the refused job: the sweep's exit status comes from its folder."""
    from omegaconf import OmegaConf

    from runner.cli import SweepStatus

    sweep = tmp_path / "sweep"
    (sweep / "0_clip=0" / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"method": {"name": "reweight"}, "clip": 0}),
                   sweep / "0_clip=0" / ".hydra" / "config.yaml")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    with pytest.raises(SystemExit) as e:
        SweepStatus().on_multirun_end(config=config)
    assert e.value.code == 1
    (sweep / "0_clip=0" / "summary.json").write_text(json.dumps({"status": "finished", "config": {}}))
    SweepStatus().on_multirun_end(config=config)  # every job finished: no exit


def test_out_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "g.txt").write_text("mine\n")
    proc = dprun_in_process(f"out_dir={tmp_path / 'g.txt'}", *TINY, cwd=tmp_path)
    assert proc.returncode == 2
    assert "is a file" in one_line(proc) and "g.txt" in proc.stderr
    assert files_under(tmp_path) == ["g.txt"] and (tmp_path / "g.txt").read_text() == "mine\n"
    proc = dprun_in_process("out_dir=g.txt/run", *TINY, cwd=tmp_path)
    assert proc.returncode == 2 and "is a file" in one_line(proc)
    assert files_under(tmp_path) == ["g.txt"]


def test_out_dir_holding_a_sweep_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "0_model=mlp").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "0_model=mlp" / "summary.json").write_text("{}")
    before = files_under(sweep)
    proc = dprun_in_process(f"out_dir={sweep}", *TINY, cwd=tmp_path)
    assert proc.returncode == 2 and "holds a sweep" in one_line(proc)
    assert files_under(sweep) == before


def test_summary_json_is_written_as_each_epoch_is_published(tmp_path, monkeypatch):
    import runner.train as train

    out_dir, seen = tmp_path / "run", []
    run_epoch = train.run_epoch

    def spy(run, epoch):  # what a reader of summary.json sees as each epoch starts
        seen.append(json.loads((out_dir / "summary.json").read_text()).get("epochs_completed"))
        return run_epoch(run, epoch)

    monkeypatch.setattr(train, "run_epoch", spy)
    proc = dprun_in_process(f"out_dir={out_dir}", "epochs=3", "max_steps_per_epoch=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert seen == [None, 1, 2]
    assert not list(out_dir.glob(".summary.json.tmp*"))  # replaced atomically, no temp file left


@pytest.mark.parametrize("args", [("method=nonprivate",), ("method=reweight", "sampling=shuffle"),
                                  ("method=reweight", "accountant=none")])
def test_final_epsilon_is_null_where_it_is_no_number(tmp_path, args):
    from runner.report import collect

    proc = dprun_in_process(f"out_dir={tmp_path / 'new'}", *args, *TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "new" / "summary.json").read_text())
    assert "epsilon" in summary["final"] and summary["final"]["epsilon"] is None
    # dprun-report reads both the new file and an old one with the empty string
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.csv").write_bytes((tmp_path / "new" / "metrics.csv").read_bytes())
    summary["final"]["epsilon"] = ""
    (old / "summary.json").write_text(json.dumps(summary))
    runs = collect(tmp_path)
    assert len(runs) == 2 and all(math.isnan(e) for e in runs["epsilon"])


def test_missing_mnist_files_names_only_the_missing_ones(tmp_path):
    from runner.data import mnist
    from runner.errors import DprunError

    for stem in mnist.FILES[:3]:
        (tmp_path / (stem + ".gz")).write_bytes(b"x")
    with pytest.raises(DprunError) as e:
        mnist.load_idx_dataset("mnist", {}, tmp_path)
    msg = str(e.value)
    assert "t10k-labels-idx1-ubyte" in msg and f"in {tmp_path};" in msg
    assert not any(stem in msg for stem in mnist.FILES[:3]), msg


def test_an_empty_mnist_file_is_named_empty(tmp_path):
    from runner.data import mnist
    from runner.errors import DprunError

    for stem in mnist.FILES:
        (tmp_path / (stem + ".gz")).write_bytes(b"")
    with pytest.raises(DprunError, match=r"train-images-idx3-ubyte\.gz is empty \(0 bytes\)"):
        mnist.load_idx_dataset("mnist", {}, tmp_path)


@pytest.mark.parametrize("sigma", ["inf", "nan", "-1"])
def test_dprun_eps_bad_sigma_is_one_line_before_any_output(capsys, sigma):
    from runner.epsilon_cli import main

    assert main(["--n", "1000", "--batch-size", "10", "--epochs", "1", "--sigma", sigma]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().count("\n") == 0 and f"--sigma={float(sigma)}" in err and "finite number > 0" in err, err
    assert "sigma=0 adds no noise" not in err


def test_config_comment_on_max_eval_batches_says_stratified_subset():
    text = (ROOT / "conf" / "config.yaml").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("max_eval_batches:"))
    assert "first" not in line and "stratified random subset" in line
