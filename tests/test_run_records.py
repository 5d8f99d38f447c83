"""Run records stay true: a folder holds one run, a stopped run says so, the report survives damaged folders, and
summary.json is standard JSON even when epsilon is infinite."""
from __future__ import annotations

import errno
import json
import math
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from conftest import compose_config, dprun_in_process
from test_report import make_run

TINY = ["dataset=digits", "epochs=1", "max_steps_per_epoch=2", "progress=false"]
ENDLESS = ["dataset=digits", "epochs=100000", "max_steps_per_epoch=2", "progress=false"]


def dprun(*args, cwd):
    return subprocess.run([sys.executable, "-m", "runner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


# Which folders a run keeps or refuses is checked in this process (conftest.dprun_in_process: the same code from argv
# to the exit status); a stopped run and a sweep's report of its failed job start `python -m runner.cli`.


def strict_json(text: str):
    """json.loads that rejects the non-standard Infinity / NaN tokens."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def tmp_files(folder):
    return [p.name for p in folder.rglob("*") if ".tmp" in p.name]


# --- one folder, one run ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["out_dir", "hydra.run.dir"])
def test_reusing_a_run_folder_is_refused(tmp_path, key):
    folder = tmp_path / "myrun"
    first = dprun_in_process(*TINY, f"{key}={folder}", cwd=tmp_path)  # hydra.run.dir: .hydra/ alone is a fresh folder
    assert first.returncode == 0, first.stderr
    before = (folder / "summary.json").read_text(), (folder / "metrics.csv").read_text()
    second = dprun_in_process(*TINY, "seed=1", f"{key}={folder}", cwd=tmp_path)
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dprun: ") and str(folder) in lines[0] and "fresh" in lines[0]
    assert ((folder / "summary.json").read_text(), (folder / "metrics.csv").read_text()) == before


def test_reusing_a_sweep_folder_is_refused(tmp_path):
    """A second sweep into the same hydra.sweep.dir: Hydra would rewrite each job's .hydra/ (and multirun.yaml)
    before the job refused its folder, so the earlier runs' config records would no longer match their results."""
    sweep = tmp_path / "sweep"
    first = dprun_in_process("-m", "seed=choice(0)", *TINY, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    records = {p: p.read_text() for p in sweep.rglob("*.yaml")}
    assert sweep / "0_seed=0" / ".hydra" / "config.yaml" in records
    # the same job folder (named by the swept key), another lr: the old .hydra/config.yaml would say lr=0.1
    second = dprun_in_process("-m", "seed=choice(0)", *TINY, "lr=0.1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert second.returncode == 2
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dprun: ") and str(sweep) in lines[0] and "fresh" in lines[0]
    assert {p: p.read_text() for p in sweep.rglob("*.yaml")} == records


@pytest.mark.parametrize("args,names", [
    (["-m", "seed=0,1", "out_dir={tmp}/X"], ["out_dir={tmp}/X", "hydra.sweep.dir={tmp}/X"]),
    (["-m", "out_dir={tmp}/X,{tmp}/X"], ["out_dir={tmp}/X,{tmp}/X", "hydra.sweep.dir="]),
    (["-m", "seed=0,1", "out_dir={tmp}/X,{tmp}/Y"], ["out_dir={tmp}/X,{tmp}/Y", "hydra.sweep.dir="]),
    (["-m", "seed=0,1", "hydra.run.dir={tmp}/X"], ["hydra.run.dir={tmp}/X", "hydra.sweep.dir={tmp}/X"]),
    (["-m", "seed=0,1", "hydra.sweep.dir={tmp}/S", "hydra.sweep.subdir=same"],
     ["hydra.sweep.subdir=same", "${{hydra.job.num}}"]),
    (["hydra.output_subdir=../a6/.hydra", "out_dir={tmp}/X"], ["hydra.output_subdir=../a6/.hydra", "plain folder name"]),
    (["hydra.output_subdir={tmp}/rec"], ["hydra.output_subdir={tmp}/rec", "plain folder name"]),
])
def test_jobs_that_would_share_a_folder_are_refused_before_hydra_writes(tmp_path, args, names):
    """Each wrote into another run's folder: job 1 of `-m seed=0,1 out_dir=X` appended its refusal to job 0's
    dprun.log; hydra.sweep.subdir=same let job 1 rewrite job 0's .hydra/overrides.yaml; hydra.output_subdir=../a6/.hydra
    rewrote a finished run's record."""
    line = one_line(dprun_in_process(*(a.format(tmp=tmp_path) for a in args), *TINY, cwd=tmp_path))
    assert all(name.format(tmp=tmp_path) in line for name in names), line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written: no X, no outputs/


@pytest.mark.parametrize("argv", [
    ["-m", "out_dir=a,b"], ["-m", "seed=0,1", "out_dir=runs/${seed}"], ["-m", "out_dir=x"], ["out_dir=x"],
    ["-m", "seed=0,1", "hydra.sweep.subdir=${hydra.job.num}_mine"], ["hydra.output_subdir=null"],
    ["hydra.output_subdir=record"], ["hydra.run.dir=x"], ["-m", "seed=0,1", "hydra.sweep.dir=s"],
])
def test_one_folder_per_job_lets_these_pass(argv):
    from runner.run_dir import check_job_folders

    check_job_folders(argv)


def test_a_run_refused_another_runs_folder_writes_nothing_into_it(tmp_path):
    """An interpolated out_dir (not checked before Hydra) naming a finished run: refused before the run's log is
    opened, so the finished run's dprun.log does not gain the refusal's ERROR line."""
    first = dprun_in_process(*TINY, f"out_dir={tmp_path}/run_nonprivate", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in (tmp_path / "run_nonprivate").iterdir() if p.is_file()}
    second = dprun_in_process(*TINY, "seed=1", f"out_dir={tmp_path}/run_${{method.name}}", cwd=tmp_path)
    assert "already holds a run" in one_line(second)
    assert {p.name: p.read_bytes() for p in (tmp_path / "run_nonprivate").iterdir() if p.is_file()} == before


def test_a_refused_run_removes_the_empty_folders_above_it_that_it_made(tmp_path):
    """outputs/runs/<date>/ made for a run refused before training goes with the run's folder; folders that were
    there before stay, even empty."""
    assert dprun_in_process(*TINY, "clip=0", cwd=tmp_path).returncode == 2
    assert not (tmp_path / "outputs").exists()
    (tmp_path / "outputs" / "runs").mkdir(parents=True)
    assert dprun_in_process(*TINY, "clip=0", cwd=tmp_path).returncode == 2
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == ["outputs", "outputs/runs"]
    assert dprun_in_process(*TINY, "clip=0", f"out_dir={tmp_path}/a/b/run", cwd=tmp_path).returncode == 2
    assert not (tmp_path / "a").exists()


def one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("dprun: "), proc.stderr
    return lines[0]


def test_train_refuses_a_used_folder_before_loading_data(tmp_path, monkeypatch):
    import runner.train
    from runner.errors import DprunError

    (tmp_path / "metrics.csv").write_text("epoch\n1\n")
    monkeypatch.setattr(runner.train, "load_dataset", lambda *a: pytest.fail("data loaded into a used folder"))
    with pytest.raises(DprunError, match="already holds a run"):
        runner.train.train(compose_config(TINY), tmp_path)


def test_a_refused_run_leaves_no_folder(tmp_path):
    """Refused before training (a bad value; missing data files): no folder is left behind, not Hydra's run folder
    and not a new out_dir; an out_dir that existed before stays."""
    for bad in (["clip=0"], ["dataset=mnist", f"data_dir={tmp_path / 'nowhere'}"]):
        proc = dprun_in_process(*TINY, *bad, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith("dprun: "), proc.stderr
        assert not [p for p in (tmp_path / "outputs").rglob("*") if p.name in (".hydra", "dprun.log")]
    proc = dprun_in_process(*TINY, "clip=0", f"out_dir={tmp_path / 'new'}", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "new").exists()
    assert not list((tmp_path / "outputs").rglob(".hydra"))
    (tmp_path / "mine").mkdir()
    assert dprun_in_process(*TINY, "clip=0", f"out_dir={tmp_path / 'mine'}", cwd=tmp_path).returncode == 2
    assert (tmp_path / "mine").is_dir()  # the user's folder; only the log of the refusal is in it
    assert not (tmp_path / "mine" / ".hydra").exists()


def test_a_sweeps_refused_job_keeps_its_folder_and_the_report_says_why(tmp_path):
    from runner.report import collect

    proc = dprun("-m", "clip=0,1.0", *TINY, cwd=tmp_path)
    assert proc.returncode != 0 and "dprun: clip=0" in proc.stderr  # Hydra reports the failed job at the end
    runs = collect(tmp_path / "outputs").set_index("folder")
    [refused] = [f for f in runs.index if f.endswith("0_clip=0")]
    assert runs.loc[refused, "status"] == "failed-to-start" and "clip=0" in runs.loc[refused, "error"]
    assert set(runs["status"]) == {"failed-to-start", "finished"}
    assert runs["started_at"].notna().all() and list(runs["started_at"]) == sorted(runs["started_at"])


def test_discard_unstarted_removes_only_a_folder_holding_hydras_record_and_the_log(tmp_path):
    from runner.run_dir import discard_unstarted

    def folder(name, *extra):
        f = tmp_path / name
        (f / ".hydra").mkdir(parents=True)
        for rel in ("dprun.log", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", *extra):
            (f / rel).write_text("x")
        return f

    assert discard_unstarted(folder("refused")) and not (tmp_path / "refused").exists()
    for name, extra in [("started", "summary.json"), ("notes", "notes.txt"), ("more", ".hydra/mine.yaml")]:
        assert not discard_unstarted(folder(name, extra)) and (tmp_path / name / extra).exists()
    linked = folder("linked")
    (linked / "dprun.log").unlink()
    (linked / "dprun.log").symlink_to(tmp_path / "notes" / "notes.txt")
    assert not discard_unstarted(linked) and (tmp_path / "notes" / "notes.txt").exists()
    assert not discard_unstarted(tmp_path / "absent")


# --- stopping a run: SIGTERM, Ctrl-C, a full disk ---------------------------------------------------------------

def start_and_signal(tmp_path, sig):
    """Start an endless run, send sig once an epoch is on disk; -> (completed process, run folder)."""
    folder = tmp_path / "run"
    # a child must not inherit an ignored SIGINT (background shells ignore it), or Python never raises Ctrl-C
    proc = subprocess.Popen([sys.executable, "-m", "runner.cli", *ENDLESS, f"out_dir={folder}"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not (folder / "metrics.csv").exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "no epoch finished in 240 s"
            time.sleep(0.2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), folder


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_ends_the_run_as_interrupted_with_one_line(tmp_path, sig, code, word):
    proc, folder = start_and_signal(tmp_path, sig)
    assert proc.returncode == code, proc.stderr[-2000:]
    summary = strict_json((folder / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["epochs_completed"] >= 1
    assert len(pd.read_csv(folder / "metrics.csv")) >= summary["epochs_completed"]
    assert "Traceback" not in proc.stderr
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("dprun: ")]
    assert len(ours) == 1 and word in ours[0] and "complete epoch" in ours[0] and str(folder) in ours[0]
    assert tmp_files(folder) == []
    assert "run interrupted" in (folder / "dprun.log").read_text()  # the log says how the run ended


def test_the_run_log_says_why_a_run_failed(tmp_path):
    """On Slurm the run folder's dprun.log is what one reads; a refused or crashed run's reason must be in it."""
    from runner.cli import run
    from runner.errors import DprunError

    cfg = compose_config(["dataset=digits", "epochs=1", "progress=false", "clip=0", f"out_dir={tmp_path / 'run'}"])
    with pytest.raises(DprunError):
        run(cfg)
    assert "run failed: DprunError: clip=0 is not valid" in (tmp_path / "run" / "dprun.log").read_text()


def enospc(*_):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_leaves_no_temp_file_and_keeps_the_old_version(tmp_path, monkeypatch):
    import runner.metrics as m

    m.write_json(tmp_path / "summary.json", {"status": "running"})
    monkeypatch.setattr(m.os, "fsync", enospc)  # the new bytes never reach the disk
    with pytest.raises(OSError):
        m.write_json(tmp_path / "summary.json", {"status": "finished"})
    assert tmp_files(tmp_path) == []
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "running"}


def test_full_disk_during_training_keeps_a_whole_summary_and_says_why(tmp_path, monkeypatch):
    """The disk fills after the first summary.json: metrics.csv's write fails, and so does the final summary.json's.
    The final one was written in place as a last resort, which on a real full disk cut it at 4096 bytes (invalid
    JSON: no resume, no report); now the earlier summary.json stays whole, and the error names both writes."""
    import runner.metrics as m
    from runner.train import train

    real_fsync, calls = m.os.fsync, {"n": 0}

    def fsync_until_full(fd):
        calls["n"] += 1
        return real_fsync(fd) if calls["n"] == 1 else enospc()

    monkeypatch.setattr(m.os, "fsync", fsync_until_full)
    with pytest.raises(OSError, match="No space left") as e:
        train(compose_config(TINY), tmp_path)
    assert f"{tmp_path / 'summary.json'} was not rewritten" in str(e.value)
    assert f"the run ended failed: OSError: [Errno 28] No space left on device: '{tmp_path / 'metrics.csv'}'" \
        in str(e.value)
    assert tmp_files(tmp_path) == []
    summary = strict_json((tmp_path / "summary.json").read_text())
    assert summary["status"] == "running" and summary["config"]["epochs"] == 1  # dprun-report: stale once it is gone


class FullDisk:
    """A disk that fills once `fill()` is called: torch.save's zip writer fails as it does on one (a RuntimeError
    from inline_container.cc, naming no file), and a text file written from then on keeps its first `fits` bytes
    and raises ENOSPC (what a tmpfs did to the final summary.json when it was written in place)."""

    def __init__(self, monkeypatch, fits=1000):
        import builtins
        import shutil

        import torch

        import runner.metrics as metrics

        self.full, self.fits, real_open, real_save = False, fits, builtins.open, torch.save
        disk = self

        class Cut:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, text):
                self.f.write(text[:disk.fits])
                self.f.flush()
                if len(text) > disk.fits:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return len(text)

            def __getattr__(self, name):
                return getattr(self.f, name)

        def cut_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            return Cut(f) if disk.full and "w" in mode else f

        def save(obj, f, *args, **kwargs):
            if disk.full:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2304 vs 2198")
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(metrics, "open", cut_open, raising=False)
        monkeypatch.setattr(torch, "save", save)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: type("Usage", (), {"free": 0})())

    def fill(self):
        self.full = True


def test_a_full_disk_never_damages_summary_json_and_the_run_resumes(tmp_path, monkeypatch):
    """On a full disk epoch 2's checkpoint fails (torch.save's RuntimeError: now an OSError naming checkpoint.pt and
    the full disk) and so does the final summary.json: the earlier one stays whole, so `dprun resume=` goes on
    once there is space, and dprun-report lists the run."""
    import runner.train as train_module
    from runner.report import collect

    run, disk, row = tmp_path / "run", FullDisk(monkeypatch), train_module.epoch_row

    def epoch_row(run_, epoch, stats):
        if epoch == 2:
            disk.fill()
        return row(run_, epoch, stats)

    with monkeypatch.context() as m:
        m.setattr(train_module, "epoch_row", epoch_row)
        proc = dprun_in_process(*TINY[:1], "epochs=3", *TINY[2:], f"out_dir={run}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = strict_json((run / "summary.json").read_text())  # the earlier version, whole
    assert summary["status"] == "running" and summary["config"]["epochs"] == 3
    assert f"No space left on device (0 bytes free): '{run / 'checkpoint.pt'}'" in proc.stderr
    assert f"{run / 'summary.json'} was not rewritten" in proc.stderr
    assert "the run ended failed: OSError: [Errno 28] No space left on device (0 bytes free)" in \
        (run / "dprun.log").read_text()
    assert tmp_files(run) == [] and pd.read_csv(run / "metrics.csv").epoch.tolist() == [1]
    assert collect(tmp_path)["status"].tolist() == ["running"]  # stale once its process is gone (here: the test's)
    disk.full = False
    proc = dprun_in_process(f"resume={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = strict_json((run / "summary.json").read_text())
    assert (summary["status"], summary["epochs_completed"]) == ("finished", 3)
    assert pd.read_csv(run / "metrics.csv").epoch.tolist() == [1, 2, 3]


# --- dprun-report on damaged folders ----------------------------------------------------------------------------

BAD_FILES = {
    "summary-list": ("summary.json", b"[]"),
    "summary-null": ("summary.json", b"null"),
    "summary-binary": ("summary.json", b"\x1f\x8b\x08\x00" + bytes(range(128, 256))),
    "summary-invalid": ("summary.json", b'{"status": "finished",'),
    "metrics-empty": ("metrics.csv", b""),
    "metrics-blank": ("metrics.csv", b"\n"),
    "metrics-binary": ("metrics.csv", b"\x1f\x8b\x08\x00" + bytes(range(128, 256))),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_report_skips_a_damaged_run_with_one_line(tmp_path, capsys, name):
    from runner.report import main

    make_run(tmp_path / "good", "jl")
    make_run(tmp_path / name, "jl")
    filename, data = BAD_FILES[name]
    (tmp_path / name / filename).write_bytes(data)
    assert main(["--root", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "1 runs, 1 rows" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "skipping" in lines[0] and str(tmp_path / name) in lines[0]


def test_report_lists_failed_interrupted_and_never_started_runs(tmp_path, capsys):
    from runner.report import main

    make_run(tmp_path / "ok", "jl")
    make_run(tmp_path / "oom", "jl", status="failed")
    make_run(tmp_path / "killed", "jl", status="interrupted")
    hydra = tmp_path / "nostart" / ".hydra"  # what Hydra leaves when the run fails before its first summary.json
    hydra.mkdir(parents=True)
    (hydra / "config.yaml").write_text("method:\n  name: reweight\ndataset:\n  name: mnist\nout_dir: null\n")
    (hydra.parent / "dprun.log").write_text("2026-01-01 10:00:00,000 ERROR run failed: DprunError: first\n"
                                            "2026-01-01 10:00:01,000 INFO more\n"
                                            "2026-01-01 10:00:02,000 ERROR run failed: MemoryError: the real one\n")
    assert main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    listed = out[out.index("did not finish"):]
    assert "failed-to-start" in listed and str(tmp_path / "nostart") in listed
    assert str(tmp_path / "oom") in listed and str(tmp_path / "killed") in listed
    assert str(tmp_path / "ok") not in listed
    runs = pd.read_csv(tmp_path / "tables" / "runs.csv")
    nostart = runs[runs["status"] == "failed-to-start"].iloc[0]
    assert (nostart["method"], nostart["dataset"]) == ("reweight", "mnist")
    assert nostart["error"] == "run failed: MemoryError: the real one"  # the last error line of its dprun.log
    assert "run failed: MemoryError: the real one" in listed


def test_report_does_not_list_the_hydra_folder_of_an_out_dir_run(tmp_path):
    """With out_dir=, Hydra's .hydra/ record is in out_dir (nothing outside it): no second folder, no failed start."""
    from runner.report import collect

    proc = dprun_in_process(*TINY, f"out_dir={tmp_path / 'mine'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "outputs").exists() and (tmp_path / "mine" / ".hydra" / "config.yaml").is_file()
    assert list(collect(tmp_path)["status"]) == ["finished"]


def test_report_reads_old_summaries_with_bare_infinity(tmp_path, capsys):
    from runner.report import collect

    make_run(tmp_path / "old", "jl")
    summary = json.loads((tmp_path / "old" / "summary.json").read_text())
    summary["final"]["epsilon"] = math.inf
    (tmp_path / "old" / "summary.json").write_text(json.dumps(summary))  # Python's default: bare Infinity
    assert "Infinity" in (tmp_path / "old" / "summary.json").read_text()
    assert list(collect(tmp_path)["status"]) == ["finished"]


# --- infinite epsilon -------------------------------------------------------------------------------------------

def test_infinite_epsilon_is_standard_json_with_the_certified_lower_bound(tmp_path):
    from runner import accountants
    from runner.accountants import SubsampledJL
    from runner.train import train

    train(compose_config(TINY + ["method=jl", "r=1"]), tmp_path)  # r=1: the JL analysis certifies no finite epsilon
    summary = strict_json((tmp_path / "summary.json").read_text())
    final = summary["final"]
    assert final["epsilon"] is None
    # the number dprun-eps prints as "inf (> ...)" for the same mechanism and steps
    acc = accountants.build("jl")
    acc.step(SubsampledJL(sample_rate=summary["sample_rate"], noise_multiplier=summary["sigma"], r=1), count=2)
    assert math.isinf(acc.epsilon(summary["config"]["delta"]))
    assert final["epsilon_lower_bound"] == pytest.approx(acc.epsilon_lower_bound(summary["config"]["delta"]))
    assert 0 < final["epsilon_lower_bound"] < math.inf
    metrics = pd.read_csv(tmp_path / "metrics.csv")
    assert math.isinf(metrics["epsilon"].iloc[-1]) and metrics["epsilon_lower_bound"].iloc[-1] > 0
    # and the line the CLI prints says why, and which r would give a finite epsilon for the same steps
    r = acc.smallest_finite_r(summary["config"]["delta"])
    assert summary["epsilon_note"].startswith("epsilon is inf: accountant=jl") and f"r={r} is the smallest" in summary["epsilon_note"]


def test_an_interrupted_runs_infinite_epsilon_is_explained_for_the_published_steps(tmp_path, monkeypatch):
    """Ctrl-C in epoch 2 after its steps: summary.json's mechanisms and epsilon_lower_bound counted epoch 2's steps
    too, while metrics.csv, epochs_completed and final stop at epoch 1; now they describe the published epoch."""
    import runner.train as train_module
    from runner import accountants
    from runner.accountants import SubsampledJL

    evaluate, calls = train_module.evaluate, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(train_module, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_module.train(compose_config(TINY[:1] + ["epochs=2"] + TINY[2:] + ["method=jl", "r=1"]), tmp_path)
    summary = strict_json((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["epochs_completed"]) == ("interrupted", 1)
    assert [m["steps"] for m in summary["mechanisms"]] == [2]
    acc = accountants.build("jl")
    acc.step(SubsampledJL(sample_rate=summary["sample_rate"], noise_multiplier=summary["sigma"], r=1), count=2)
    delta = summary["config"]["delta"]
    assert summary["epsilon_lower_bound"] == pytest.approx(acc.epsilon_lower_bound(delta), rel=1e-9)
    assert summary["final"]["epsilon_lower_bound"] == pytest.approx(summary["epsilon_lower_bound"], rel=1e-9)


# --- who is writing a run folder --------------------------------------------------------------------------------

@pytest.mark.parametrize("how", [KeyboardInterrupt, RuntimeError])
def test_the_run_lock_is_released_however_the_block_ends(tmp_path, how):
    from runner import run_lock

    with pytest.raises(how):
        with run_lock.holding(tmp_path / "run"):
            with run_lock.holding(tmp_path / "run"):  # re-entrant: the CLI's and train()'s
                assert (tmp_path / "run" / "dprun.lock").exists()
            assert (tmp_path / "run" / "dprun.lock").exists()
            raise how()
    assert not (tmp_path / "run" / "dprun.lock").exists()
    with run_lock.holding(tmp_path / "run"):
        pass


def test_a_killed_run_is_stale_in_the_report_not_running(tmp_path, capsys):
    """SIGKILL leaves summary.json at `running`: the report checks the pid and host the run recorded."""
    from runner.report import collect, main

    folder = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "runner.cli", *ENDLESS, f"out_dir={folder}"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (folder / "metrics.csv").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert collect(tmp_path)["status"].tolist() == ["running"]  # alive
    finally:
        proc.kill()
        proc.wait()
    assert json.loads((folder / "summary.json").read_text())["status"] == "running"
    assert main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert collect(tmp_path)["status"].tolist() == ["stale"]
    listed = out[out.index("did not finish"):]
    assert f"stale  {folder}" in listed and f"pid {proc.pid} on this host" in listed and "is gone" in listed


def test_a_run_on_another_host_stays_running_unchecked(tmp_path, capsys):
    from runner.report import main

    make_run(tmp_path / "there", "jl", status="running")
    summary = json.loads((tmp_path / "there" / "summary.json").read_text())
    (tmp_path / "there" / "summary.json").write_text(json.dumps({**summary, "pid": 1, "host": "elsewhere-node"}))
    assert main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    runs = pd.read_csv(tmp_path / "tables" / "runs.csv")
    assert runs["status"].tolist() == ["running"] and runs["host"].tolist() == ["elsewhere-node"]
    assert "pid 1 on host elsewhere-node: not checked from this host" in out
