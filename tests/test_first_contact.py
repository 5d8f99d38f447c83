"""A new user's first commands (issue 28): resume across world sizes, one line for a refused multi-process run,
nothing written outside out_dir, and one place (runner/speaker.py) deciding what each rank prints and writes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, compose_config, dprun_in_process
from runner import launch
from runner.checkpoint import MAY_CHANGE, SET_BY_RESUME, resumed_config
from runner.speaker import REPORT_DIR, Speaker, read_reports
from runner.train import train


def dprun(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "runner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def dprun_lines(proc) -> list[str]:
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("dprun")]


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    train(compose_config(["method=nxbp", "epochs=1", "max_steps_per_epoch=2", "progress=false",
                          f"out_dir={run_dir}"]), run_dir)
    return run_dir


# -- 1. resume across world sizes -----------------------------------------------------------------------------
def test_a_one_process_run_resumes_on_two(one_process_run, tmp_path):
    cfg = resumed_config(one_process_run, ["distributed.nproc_per_node=2", "epochs=2"])
    assert cfg["distributed"]["nproc_per_node"] == 2 and cfg["distributed"]["backend"] == "auto"  # merged, nested
    assert launch.processes([f"resume={one_process_run}", "distributed.nproc_per_node=2"]) == 2
    assert launch.processes([f"resume={one_process_run}"]) == 1  # it recorded one process


def test_a_plain_resume_continues_on_the_processes_the_run_recorded(one_process_run, tmp_path):
    two = tmp_path / "two"
    two.mkdir()
    summary = json.loads((one_process_run / "summary.json").read_text())
    summary["config"]["distributed"]["nproc_per_node"] = 2  # as a `distributed.nproc_per_node=2` run records it
    (two / "summary.json").write_text(json.dumps(summary))
    assert launch.processes([f"resume={two}"]) == 2
    assert launch.processes([f"resume={two}", "distributed.nproc_per_node=1"]) == 1  # unless told otherwise


def test_readme_and_docs_list_what_a_resume_may_change():
    row = next(ln for ln in (ROOT / "README.md").read_text().splitlines() if ln.startswith("| `checkpoint`, `resume`"))
    for key in (k for k in MAY_CHANGE if k not in SET_BY_RESUME):
        assert f"`{key}" in row, key
    assert "any world size" in row and "either launcher" in row
    assert "any world size, from either launcher" in (ROOT / "docs" / "distributed.md").read_text()


def test_a_refused_resume_on_two_processes_is_one_line_before_any_rank_starts(one_process_run, tmp_path):
    # refused before any rank starts, so in this process (conftest.dprun_in_process); a started rank would say "rank"
    proc = dprun_in_process(f"resume={one_process_run}", "method=jl", "distributed.nproc_per_node=2", cwd=tmp_path)
    assert proc.returncode == 2
    assert len(dprun_lines(proc)) == 1 and "method=jl would change the run" in proc.stderr, proc.stderr
    assert "rank" not in proc.stderr


# -- 2. a bad value on several ranks: one line -------------------------------------------------------------------
def test_a_bad_value_on_two_ranks_is_one_line(tmp_path):
    proc = dprun("distributed.nproc_per_node=2", "lr=abc", f"out_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2
    assert dprun_lines(proc) == ["dprun: lr='abc' is not valid: lr must be a finite number > 0"], proc.stderr
    assert list(tmp_path.iterdir()) == []  # refused: no folder left behind


class _Failure:
    def __init__(self, exitcode):
        self.exitcode = exitcode


class _Failed:
    """What torch.distributed.run raises: ChildFailedError's failures and first failure."""

    def __init__(self, codes: dict[int, int], first: int):
        self.failures = {r: _Failure(c) for r, c in codes.items()}
        self.first = first

    def get_first_failure(self):
        return self.first, self.failures[self.first]


def test_the_launcher_prints_one_line_for_the_job():
    refused = {"kind": "refused", "text": "lr='abc' is not valid"}
    assert launch.failure_line(_Failed({0: 2, 1: 2}, 1), {0: refused, 1: refused}) == ("dprun: lr='abc' is not valid", 2)
    failed = {1: {"kind": "failed", "text": "failed: RuntimeError: boom"},
              0: {"kind": "stopped", "text": "stopped: another rank stopped (its line says why)"}}
    line, code = launch.failure_line(_Failed({0: 1, 1: 1}, 0), failed)  # rank 0 ended first, rank 1 is the cause
    assert line.startswith("dprun: distributed run failed: rank 1 exit code 1: failed: RuntimeError: boom;") and code == 1
    line, code = launch.failure_line(_Failed({0: 1, 1: -9}, 0), {0: {"kind": "interrupted", "text": "interrupted"}})
    assert "rank 1 killed by SIGKILL (stopped from outside" in line and code == 137


# -- 3. out_dir: nothing outside it ------------------------------------------------------------------------------
def test_an_out_dir_run_writes_nothing_outside_out_dir(tmp_path):
    proc = dprun_in_process("epochs=1", "max_steps_per_epoch=2", "progress=false", f"out_dir={tmp_path / 'run'}",
                            cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no outputs/runs/<date>/... holding only .hydra/
    assert (tmp_path / "run" / ".hydra" / "config.yaml").exists()  # Hydra's record of the launch is in the run


# -- 14. one place decides what a rank prints and writes ---------------------------------------------------------
def test_one_place_decides_what_each_rank_prints_and_writes(tmp_path, monkeypatch, capsys):
    cli = (ROOT / "runner" / "cli.py").read_text()
    assert not re.search(r"launched_rank|launched_world_size|rank [!=]= 0", cli)  # runner/speaker.py decides
    assert Speaker(0, 1).main and not Speaker(1, 2).main and Speaker(1, 2).prefix == "dprun: rank 1: "
    Speaker(1, 2).last_line("interrupted", "interrupted; 0 complete epochs kept")  # rank 0 alone says it
    Speaker(1, 2).last_line("failed", "failed: RuntimeError: boom")  # torchrun: each rank names itself
    assert capsys.readouterr().err == "dprun: rank 1: failed: RuntimeError: boom\n"
    monkeypatch.setenv(REPORT_DIR, str(tmp_path))  # dprun's own launcher: the line goes to it
    Speaker(1, 2).last_line("refused", "bad value")
    assert capsys.readouterr().err == "" and read_reports(tmp_path) == {1: {"kind": "refused", "text": "bad value"}}


def test_distributed_has_no_dead_backend_for():
    import runner.distributed as distributed

    assert not hasattr(distributed, "backend_for")


# -- 6. messages in the caller's words, never cut mid-word ---------------------------------------------------------
def test_a_garbage_checkpoint_is_named_in_whole_words(tmp_path):
    import torch

    from runner.checkpoint import first_sentence, load
    from runner.errors import DprunError

    (tmp_path / "checkpoint.pt").write_bytes(b"garbage" * 50)
    try:
        torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    except Exception as e:  # noqa: BLE001  torch's own message, to compare with
        torch_says = str(e).splitlines()[0]
    with pytest.raises(DprunError) as refused:
        load(tmp_path)
    reason = re.search(r"damaged or truncated \((.*)\); the run's", str(refused.value)).group(1)
    whole = reason.removesuffix(" ...")
    assert torch_says.startswith(whole) and torch_says[len(whole):len(whole) + 1] in ("", " ", "."), reason
    assert first_sentence("word " * 40).endswith("word ...") and len(first_sentence("word " * 40)) <= 104


def test_dprun_help_starts_without_torch_or_the_accountants(tmp_path):
    """`dprun --help` (and every start, before a run begins) imports neither torch nor dp-accounting/scipy: they
    took 5 of its 7 seconds. A module imported at the top of the CLI's path that pulls them in fails this."""
    code = "import sys; sys.argv = ['dprun', '--help']; from runner.cli import main; main()"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "dprun" in proc.stdout, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "hydra" in imported  # the check can see imports
    assert not {"torch", "dp_accounting", "scipy"} & imported, sorted({"torch", "dp_accounting", "scipy"} & imported)


def test_a_refused_distributed_job_leaves_no_new_folder_even_when_rank_0_was_stopped_first(tmp_path, monkeypatch):
    """When another rank refuses first, the elastic agent stops rank 0 before it discards the run folder Hydra made
    for it (seen under load): the launcher discards the folders that are new to this command and hold only Hydra's
    record and dprun.log. A folder with anything else, or one that existed before, stays."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    new, other, used = tmp_path / "new", tmp_path / "with_results", tmp_path / "old"
    for folder in (new, other):
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "config.yaml").write_text("lr: abc\n")
        (folder / "dprun.log").write_text("refused\n")
    (other / "metrics.csv").write_text("epoch\n")

    def refused(args):
        reports = Path(os.environ[REPORT_DIR])
        for rank in (0, 1):
            (reports / f"rank{rank}.json").write_text(json.dumps({"kind": "refused", "text": "lr='abc' is not valid"}))
        failure = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file="")
        raise ChildFailedError("runner.cli", {1: failure})

    monkeypatch.setattr(torchrun, "run", refused)
    assert launch.launch(["lr=abc"], 2, new_dirs={new, other}) == 2
    assert not new.exists() and other.exists() and (other / "metrics.csv").exists()
    used.mkdir()
    monkeypatch.setattr(torchrun, "run", lambda args: None)  # a job that ran: nothing is discarded
    (used / "dprun.log").write_text("ran\n")
    assert launch.launch(["lr=0.1"], 2, new_dirs={used}) == 0 and (used / "dprun.log").exists()
