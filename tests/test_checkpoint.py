"""Checkpoint and resume (runner/checkpoint.py): a run interrupted in epoch 3 (or finished after epoch 2) and resumed
to epoch 4 equals one that ran 4 epochs straight — weights, losses and epsilon per epoch."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config, dprun_in_process
from runner.checkpoint import FILE, RESUME_CONFIG, load, resume_argv
from runner.errors import DprunError
from runner.train import train

RUN = ["method=reweight", "sigma=1.0", "max_steps_per_epoch=4", "progress=false", "optimizer=adam", "lr=0.01"]


def weights(run_dir):
    return torch.load(run_dir / FILE, weights_only=True)["model"]


def stop_in_epoch_3(run_dir, monkeypatch):
    """Ctrl-C in epoch 3 after its steps, before its row: the steps' batches, noise and accounting are lost."""
    import runner.train as train_module

    evaluate, calls = train_module.evaluate, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(train_module, "evaluate", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(compose_config(RUN + ["epochs=4"]), run_dir)


@pytest.mark.parametrize("how", ["interrupted", "extended"])
def test_resumed_run_equals_uninterrupted(tmp_path, monkeypatch, how):
    """interrupted: stopped by Ctrl-C in epoch 3, resumed; extended: a finished 2-epoch run continued to epoch 4."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    train(compose_config(RUN + ["epochs=4"]), straight)
    if how == "interrupted":
        stop_in_epoch_3(stopped, monkeypatch)
        assert json.loads((stopped / "summary.json").read_text())["status"] == "interrupted"
    else:
        train(compose_config(RUN + ["epochs=2"]), stopped)
    assert torch.load(stopped / FILE, weights_only=True)["epoch"] == 2
    summary = train(compose_config(RUN + ["epochs=4", f"resume={stopped}"]), stopped)
    assert summary["status"] == "finished" and summary["epochs_completed"] == 4
    a, b = pd.read_csv(straight / "metrics.csv"), pd.read_csv(stopped / "metrics.csv")
    assert a.epoch.tolist() == b.epoch.tolist() == [1, 2, 3, 4]
    for col in ("train_loss", "test_acc", "epsilon"):
        assert a[col].tolist() == pytest.approx(b[col].tolist(), rel=1e-6), col
    assert b.epsilon.is_monotonic_increasing and b.epsilon.iloc[-1] > b.epsilon.iloc[1] > 0
    wa, wb = weights(straight), weights(stopped)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=1e-7, msg=k)


def test_resume_refuses_a_different_run_and_a_missing_checkpoint(tmp_path):
    train(compose_config(RUN + ["epochs=1"]), tmp_path / "a")
    with pytest.raises(DprunError, match=r"config differs \(sigma=1.0 -> 2.0\)"):
        train(compose_config(RUN + ["epochs=2", "sigma=2.0", f"resume={tmp_path / 'a'}"]), tmp_path / "a")
    with pytest.raises(DprunError, match="no checkpoint.pt there"):
        train(compose_config(RUN + ["epochs=2", f"resume={tmp_path}"]), tmp_path / "b")


def test_another_runs_checkpoint_is_never_resumed_as_this_run(tmp_path):
    """Review 42: a folder holding only another run's checkpoint.pt (results cleared to rerun there, or a checkpoint
    copied in to warm-start) took a new run; resumed, that run restored the other's model and steps as its own: a
    non-private checkpoint's 44 unnoised steps vanished behind a certified epsilon of 1.849. A fresh run now refuses
    such a folder, and a resume refuses a checkpoint whose run id is not its summary.json's; a run keeps its id."""
    nonprivate = ["method=nonprivate", "max_steps_per_epoch=4", "progress=false", "optimizer=adam", "lr=0.01"]
    train(compose_config(nonprivate + ["epochs=2"]), tmp_path / "np")
    (tmp_path / "left").mkdir()
    shutil.copy(tmp_path / "np" / FILE, tmp_path / "left" / FILE)
    with pytest.raises(DprunError, match=r"already holds a run \(summary.json, metrics.csv or checkpoint.pt\)"):
        train(compose_config(RUN + ["epochs=2"]), tmp_path / "left")
    first = train(compose_config(RUN + ["epochs=1"]), tmp_path / "private")
    shutil.copy(tmp_path / "np" / FILE, tmp_path / "private" / FILE)  # its own replaced by the other run's
    with pytest.raises(DprunError, match=r"^resume=.*: its checkpoint.pt belongs to another run than its summary"):
        train(compose_config(RUN + ["epochs=3", f"resume={tmp_path / 'private'}"]), tmp_path / "private")
    train(compose_config(RUN + ["epochs=1"]), tmp_path / "own")
    resumed = train(compose_config(RUN + ["epochs=2", f"resume={tmp_path / 'own'}"]), tmp_path / "own")
    own_id = json.loads((tmp_path / "own" / "summary.json").read_text())["run_id"]
    assert resumed["run_id"] == own_id == load(tmp_path / "own")["run_id"] != first["run_id"]


def test_a_swapped_checkpoint_without_run_ids_is_refused_by_its_published_epochs(tmp_path):
    """Review 45: runs written before run ids carry none, so check_run_id lets their pairs through; a non-private
    run's checkpoint copied over a private run's resumed it at epsilon 1.849 for a model behind 44 unnoised steps.
    The checkpoint's rows of the published epochs must be metrics.csv's: a swapped one is refused, an own one not."""
    nonprivate = ["method=nonprivate", "max_steps_per_epoch=4", "progress=false", "optimizer=adam", "lr=0.01"]
    train(compose_config(nonprivate + ["epochs=2"]), tmp_path / "np")
    train(compose_config(RUN + ["epochs=2"]), tmp_path / "p")
    for run in ("np", "p"):  # as stop 63's files were: no run id in either
        state = load(tmp_path / run)
        state.pop("run_id")
        torch.save(state, tmp_path / run / FILE)
        summary = json.loads((tmp_path / run / "summary.json").read_text())
        summary.pop("run_id")
        (tmp_path / run / "summary.json").write_text(json.dumps(summary))
    own = tmp_path / "own"
    shutil.copytree(tmp_path / "p", own)
    shutil.copy(tmp_path / "np" / FILE, tmp_path / "p" / FILE)
    before = files(tmp_path / "p")
    with pytest.raises(DprunError, match=r"^resume=.*: its checkpoint.pt does not hold the epochs metrics.csv "
                                         r"published \(epoch 1 differs\)"):
        train(compose_config(RUN + ["epochs=3", f"resume={tmp_path / 'p'}"]), tmp_path / "p")
    assert files(tmp_path / "p") == before
    assert train(compose_config(RUN + ["epochs=3", f"resume={own}"]), own)["epochs_completed"] == 3


def test_resume_cannot_lengthen_a_run_calibrated_to_a_target_epsilon(tmp_path):
    """sigma was calibrated to the target over the saved epochs and the resume restores it: more epochs spent more
    than the target (2 -> 3.09) while summary.json still said target_epsilon_met. The same epochs resume as before."""
    target = RUN[:1] + RUN[2:] + ["target_epsilon=2", "delta=1e-5"]
    train(compose_config(target + ["epochs=1"]), tmp_path)
    with pytest.raises(DprunError, match=r"^resume=.*calibrated sigma to target_epsilon=2 over epochs=1, so "
                                         r"epochs cannot change on resume \(epochs=2 would exceed"):
        train(compose_config(target + ["epochs=2", f"resume={tmp_path}"]), tmp_path)
    summary = train(compose_config(target + ["epochs=1", f"resume={tmp_path}"]), tmp_path)
    assert summary["target_epsilon_met"] and summary["final"]["epsilon"] <= 2.0


def test_a_method_whose_state_a_checkpoint_would_miss_writes_none_and_refuses_resume(tmp_path):
    """Method.not_resumable (DP-SBCD's per-example auxiliary variables): no checkpoint.pt, resume= refused."""
    sbcd = ["method=sbcd", "epochs=1", "progress=false"]
    train(compose_config(sbcd), tmp_path / "a")
    assert not (tmp_path / "a" / FILE).exists()
    with pytest.raises(DprunError, match=r"^resume: method=sbcd keeps auxiliary variables"):
        train(compose_config(sbcd + [f"resume={tmp_path / 'a'}"]), tmp_path / "a")


def test_resume_never_shortens_a_run_and_leaves_a_complete_one_as_it_is(tmp_path):
    """epochs below the completed ones: refused (the loop would train nothing and the records would call the run
    shorter); epochs equal: the saved summary back and not a byte written."""
    train(compose_config(RUN + ["epochs=2"]), tmp_path)
    before = files(tmp_path)
    with pytest.raises(DprunError, match=r"has completed 2 epochs, more than epochs=1"):
        train(compose_config(RUN + ["epochs=1", f"resume={tmp_path}"]), tmp_path)
    summary = train(compose_config(RUN + ["epochs=2", f"resume={tmp_path}"]), tmp_path)
    assert summary["epochs_completed"] == 2 and summary["config"]["epochs"] == 2
    assert files(tmp_path) == before


def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path):
    train(compose_config(RUN + ["epochs=1"]), tmp_path)
    (tmp_path / FILE).write_bytes((tmp_path / FILE).read_bytes()[:2000])
    for how in ({}, {"mmap": True}):
        with pytest.raises(DprunError, match=rf"^{tmp_path / FILE} is damaged or truncated \(.*\); the run's "
                                             r"metrics.csv and summary.json are intact") as e:
            load(tmp_path, **how)
        assert "\n" not in str(e.value)


def test_resume_argv_continues_the_run_from_its_summary_config(tmp_path):
    """The config is summary.json's with the command line's epochs on top, handed to Hydra as its primary config
    (so Hydra never parses the folder's name); Hydra runs in the folder and writes no .hydra/ there."""
    from hydra.core.config_store import ConfigStore

    run = tmp_path / "0_model=mlp,seed=0"
    train(compose_config(RUN + ["epochs=1"]), run)
    saved = json.loads((run / "summary.json").read_text())["config"]
    argv = resume_argv([f"resume={run}", "epochs=3", "method=reweight", "--cfg", "job"])  # restating is fine
    assert argv == ["--cfg", "job", f"--config-name={RESUME_CONFIG}"]
    node = OmegaConf.to_container(ConfigStore.instance().load(f"{RESUME_CONFIG}.yaml").node)
    assert node.pop("hydra") == {"run": {"dir": str(run)}, "output_subdir": None, "job": {"chdir": False}}
    assert node.pop("defaults") == [{"override hydra/job_logging": "disabled"}, "_self_"]
    assert node == {**saved, "epochs": 3, "resume": str(run)}
    assert resume_argv(["epochs=3"]) == ["epochs=3"]


# --- through the command line -----------------------------------------------------------------------------------

CLI_RUN = ["dataset=digits", "method=reweight", "max_steps_per_epoch=3", "progress=false", "seed=1"]


def dprun(*args, cwd):
    return subprocess.run([sys.executable, "-m", "runner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


# The CLI runs here go through conftest.dprun_in_process (the same code from argv to the exit status, in this
# process); test_after_a_refused_resume_the_documented_one_works starts `python -m runner.cli resume=...`.


def files(folder):
    """Every file under folder (.hydra/ included) -> its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """model=cnn (a sweep's job below), 2 epochs straight."""
    folder = tmp_path_factory.mktemp("straight")
    proc = dprun_in_process(*CLI_RUN, "model=cnn", "epochs=2", f"out_dir={folder / 'run'}", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    return folder / "run"


@pytest.mark.parametrize("made_with", ["out_dir", "sweep"])
def test_every_folder_dprun_writes_resumes_with_the_documented_command(tmp_path, straight, made_with):
    """An out_dir= run (its .hydra/ record inside it; made from another folder, with a relative path) and a sweep
    job's folder (`0_model=cnn,seed=1`: `=` and `,` that Hydra's parser rejects) resume from their summary.json to
    the same weights, losses and epsilon as the straight run."""
    (tmp_path / "a").mkdir()
    if made_with == "out_dir":
        proc = dprun_in_process(*CLI_RUN, "model=cnn", "epochs=1", "out_dir=runs/x", cwd=tmp_path / "a")
        run = tmp_path / "a/runs/x"
    else:
        proc = dprun_in_process("-m", *CLI_RUN, "model=choice(cnn)", "seed=choice(1)", "epochs=1", "hydra.sweep.dir=s",
                                cwd=tmp_path / "a")
        run = tmp_path / "a/s/0_model=cnn,seed=1"
    assert proc.returncode == 0, proc.stderr
    hydra_records = {k: v for k, v in files(run).items() if k.parts[0] == ".hydra"}
    assert hydra_records  # the record of how it was launched is in the run's own folder (nothing outside it)
    proc = dprun_in_process(f"resume={run}", "epochs=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert {k: v for k, v in files(run).items() if k.parts[0] == ".hydra"} == hydra_records  # as launched
    assert not (tmp_path / "outputs").exists()  # no Hydra folder of its own
    a, b = pd.read_csv(straight / "metrics.csv"), pd.read_csv(run / "metrics.csv")
    assert a.epoch.tolist() == b.epoch.tolist() == [1, 2]
    for col in ("train_loss", "test_acc", "epsilon"):
        assert a[col].tolist() == pytest.approx(b[col].tolist(), rel=1e-6), col
    wa, wb = weights(straight), weights(run)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-6, atol=1e-7, msg=k)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["epochs_completed"], summary["config"]["epochs"]) == ("finished", 2, 2)


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    """A finished 2-epoch run in a Hydra run folder (with its .hydra/ record)."""
    folder = tmp_path_factory.mktemp("two")
    proc = dprun_in_process(*CLI_RUN, "epochs=2", f"hydra.run.dir={folder / 'run'}", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    return folder / "run"


def truncate(run):
    (run / FILE).write_bytes((run / FILE).read_bytes()[:2000])


REFUSED = {  # case -> (what is done to the run first, the command line's arguments, the one line says)
    "fewer-epochs": (None, ["epochs=1"], "has completed 2 epochs, more than epochs=1"),
    "other-method": (None, ["method=nxbp", "epochs=3"], "method=nxbp would change the run (method='reweight' there)"),
    "truncated-checkpoint": (truncate, ["epochs=3"], f"{FILE} is damaged or truncated"),
    "no-checkpoint": (lambda run: (run / FILE).unlink(), ["epochs=3"], f"no {FILE} there"),
    "multirun": (None, ["-m", "epochs=3,4"], "resume= continues one run: leave out -m"),
}


@pytest.mark.parametrize("case", [*REFUSED, "complete"])
def test_a_refused_resume_leaves_every_file_of_the_run_as_it_was(tmp_path, two_epochs, case):
    """Refused: one line, exit 2. Already complete (epochs=2 of 2): one line, exit 0. Either way not a byte of the
    run's folder changes (Hydra would have rewritten .hydra/ before dprun's own checks ran)."""
    run = tmp_path / "run"
    shutil.copytree(two_epochs, run)
    damage, args, says = REFUSED.get(case, (None, ["epochs=2"], "the run is already complete (2 epochs, epochs=2)"))
    if damage:
        damage(run)
    before = files(run)
    proc = dprun_in_process(f"resume={run}", *args, cwd=tmp_path)
    assert proc.returncode == (0 if case == "complete" else 2), proc.stderr
    lines = (proc.stdout if case == "complete" else proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dprun: ") and says in lines[0], proc.stdout + proc.stderr
    assert files(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nor anything beside it


def test_after_a_refused_resume_the_documented_one_works(tmp_path, two_epochs):
    run = tmp_path / "run"
    shutil.copytree(two_epochs, run)
    assert dprun_in_process(f"resume={run}", "method=nxbp", cwd=tmp_path).returncode == 2
    proc = dprun(f"resume={run}", "epochs=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert pd.read_csv(run / "metrics.csv").epoch.tolist() == [1, 2, 3]


def start_endless(tmp_path):
    """`dprun` training on and on in another process, once it has a checkpoint: -> (process, its run folder)."""
    import time

    folder = tmp_path / "run"
    log = tmp_path / "endless.log"  # a file, not a pipe nobody reads: a full pipe would stall the run
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runner.cli", *CLI_RUN, "epochs=100000", f"out_dir={folder}"],
                                cwd=tmp_path, stdout=out, stderr=out)
    deadline = time.monotonic() + 240
    while not (folder / FILE).exists():
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, "no epoch finished in 240 s"
        time.sleep(0.2)
    return proc, folder


def test_resume_of_a_running_run_is_refused_until_its_process_is_gone(tmp_path):
    """Two processes must never write one folder: resume= of a run still training is one line naming its process,
    exit 2, and the folder gets nothing from it (not even a log line). Once that process is gone (SIGKILL: its lock
    file stays behind), the resume runs."""
    import socket

    proc, run = start_endless(tmp_path)
    try:
        # epochs=: bounded, so that where a second writer were let in the test would end (and fail), not train on
        refused = dprun_in_process(f"resume={run}", f"epochs={load(run)['epoch'] + 100}", cwd=tmp_path)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert refused.stderr.strip().splitlines() == [
            f"dprun: run {run.resolve()} is in use by pid {proc.pid} on host {socket.gethostname()}"]
        assert "in use" not in (run / "dprun.log").read_text()
        assert proc.poll() is None  # the running one goes on
    finally:
        proc.kill()
        proc.wait()
    assert (run / "dprun.lock").exists()  # left by the killed process: it must not block the resume
    done = load(run)["epoch"]
    resumed = dprun_in_process(f"resume={run}", f"epochs={done + 1}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "summary.json").read_text())["epochs_completed"] == done + 1
    assert not (run / "dprun.lock").exists()  # released when the run ended


def test_an_epoch_is_published_only_once_its_checkpoint_is_saved(tmp_path, monkeypatch):
    """metrics.csv was written before the checkpoint: a SIGTERM or a full disk in checkpoint.save published epoch 2's
    row, the resume went on from epoch 1 and (rng=secure) trained epoch 2 again with fresh noise: two releases, one
    accounted. Now the checkpoint comes first, and a run stopped between the two publishes that epoch on resume
    from the checkpoint's rows, without training it again."""
    import runner.checkpoint as checkpoint_module
    import runner.train as train_module

    save, write_csv = checkpoint_module.save, train_module.write_csv

    def full_disk(out_dir, *, epoch, **kw):
        if epoch == 2:
            raise OSError(28, "No space left on device")
        return save(out_dir, epoch=epoch, **kw)

    with monkeypatch.context() as m:
        m.setattr(checkpoint_module, "save", full_disk)
        with pytest.raises(OSError):
            train(compose_config(RUN + ["epochs=3"]), tmp_path / "disk")
    assert pd.read_csv(tmp_path / "disk" / "metrics.csv").epoch.tolist() == [1]
    assert json.loads((tmp_path / "disk" / "summary.json").read_text())["epochs_completed"] == 1

    def stopped_after_the_checkpoint(path, rows):
        if len(rows) == 2 and path.name == "metrics.csv":
            raise KeyboardInterrupt
        return write_csv(path, rows)

    with monkeypatch.context() as m:
        m.setattr(train_module, "write_csv", stopped_after_the_checkpoint)
        with pytest.raises(KeyboardInterrupt):
            train(compose_config(RUN + ["epochs=2"]), tmp_path / "sig")
    assert torch.load(tmp_path / "sig" / FILE, weights_only=True)["epoch"] == 2
    assert pd.read_csv(tmp_path / "sig" / "metrics.csv").epoch.tolist() == [1]
    def trained_again(*args, **kwargs):
        raise AssertionError("epoch 2 trained again")

    with monkeypatch.context() as m:
        m.setattr(train_module, "run_epoch", trained_again)
        summary = train(compose_config(RUN + ["epochs=2", f"resume={tmp_path / 'sig'}"]), tmp_path / "sig")
    assert summary["status"] == "finished" and summary["epochs_completed"] == 2
    assert pd.read_csv(tmp_path / "sig" / "metrics.csv").epoch.tolist() == [1, 2]
    straight = train(compose_config(RUN + ["epochs=2"]), tmp_path / "straight")
    assert summary["final"]["epsilon"] == pytest.approx(straight["final"]["epsilon"], rel=1e-9)


# --- what was published decides, not the checkpoint ---------------------------------------------------------------

SECURE = [*CLI_RUN, "rng=secure"]


def checkpoint_put_back(run, tmp_path):
    """checkpoint.pt at epoch 2 while metrics.csv and summary.json say 4 (a copy put back, an older release's)."""
    shutil.copy(tmp_path / "ck2", run / FILE)


def killed_in_a_resume(run, tmp_path):
    """As a SIGKILL during a resume leaves it: summary.json as the resume started it (no epochs_completed), metrics.csv
    with the epochs published since, the checkpoint older."""
    checkpoint_put_back(run, tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    for key in ("epochs_completed", "final"):
        summary.pop(key, None)
    (run / "summary.json").write_text(json.dumps({**summary, "status": "running"}))


@pytest.mark.parametrize("case", ["checkpoint=false", "checkpoint-put-back", "killed-in-a-resume"])
def test_published_epochs_are_never_trained_again(tmp_path, case):
    """`resume=R epochs=4 checkpoint=false` published epochs 3-4 and left checkpoint.pt at epoch 2; `resume=R epochs=5`
    then trained epochs 3-5 again (rng=secure: fresh noise), overwriting rows 3-4: 21 noisy steps released, 15
    accounted. A resume with checkpoint=false now removes the checkpoint before it publishes an epoch, and a resume
    whose checkpoint is behind what metrics.csv or summary.json published is refused in one line, nothing changed."""
    run = tmp_path / "run"
    assert dprun_in_process(*SECURE, "epochs=2", f"out_dir={run}", cwd=tmp_path).returncode == 0
    shutil.copy(run / FILE, tmp_path / "ck2")
    more = ["checkpoint=false"] if case == "checkpoint=false" else []
    proc = dprun_in_process(f"resume={run}", "epochs=4", *more, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert pd.read_csv(run / "metrics.csv").epoch.tolist() == [1, 2, 3, 4]
    if case == "checkpoint=false":
        assert not (run / FILE).exists()  # nothing left to resume from: `no checkpoint.pt there`
        says = f"no {FILE} there"
    else:
        {"checkpoint-put-back": checkpoint_put_back, "killed-in-a-resume": killed_in_a_resume}[case](run, tmp_path)
        says = f"the run published 4 epochs (metrics.csv, summary.json) but its {FILE} holds epoch 2"
    before = files(run)
    proc = dprun_in_process(f"resume={run}", "epochs=5", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dprun: ") and says in lines[0], proc.stderr
    assert files(run) == before


def test_a_run_stopped_after_its_last_checkpoint_publishes_it_on_resume(tmp_path, monkeypatch):
    """SIGTERM right after the last epoch's checkpoint.save, before its metrics.csv row: `dprun resume=` said
    "already complete (3 epochs)" (judged by the checkpoint) and epoch 3 was never published. Now the stopping run
    publishes it (review 38), and the resume finishes the run without training it again."""
    import runner.checkpoint as checkpoint_module
    import runner.train as train_module
    from runner.interrupt import Terminated

    run, save = tmp_path / "run", checkpoint_module.save

    def terminated_after(out_dir, *, epoch, **kw):
        save(out_dir, epoch=epoch, **kw)
        if epoch == 3:
            raise Terminated()

    with monkeypatch.context() as m:
        m.setattr(checkpoint_module, "save", terminated_after)
        proc = dprun_in_process(*SECURE, "epochs=3", f"out_dir={run}", cwd=tmp_path)
    assert proc.returncode == 143, proc.stderr
    # review 38: the stop publishes the saved epoch (checkpoint.pt is the run's model); the run is not finished
    assert pd.read_csv(run / "metrics.csv").epoch.tolist() == [1, 2, 3] and load(run)["epoch"] == 3
    stopped = json.loads((run / "summary.json").read_text())
    assert (stopped["status"], stopped["epochs_completed"]) == ("interrupted", 3)

    def trained_again(*args, **kwargs):
        raise AssertionError("epoch 3 trained again")

    with monkeypatch.context() as m:
        m.setattr(train_module, "run_epoch", trained_again)
        proc = dprun_in_process(f"resume={run}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = pd.read_csv(run / "metrics.csv")
    assert rows.epoch.tolist() == [1, 2, 3]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["epochs_completed"]) == ("finished", 3)
    assert summary["final"]["epsilon"] == pytest.approx(rows.epsilon.iloc[-1], rel=1e-12)
    assert sum(m["steps"] for m in summary["mechanisms"]) == rows.steps.sum() == 9
    proc = dprun_in_process(f"resume={run}", cwd=tmp_path)  # and now it is complete
    assert proc.returncode == 0 and "already complete (3 epochs" in proc.stdout, proc.stdout + proc.stderr


def test_an_interrupted_runs_summary_describes_the_published_epochs(tmp_path, monkeypatch):
    """Ctrl-C in epoch 3 after its steps: summary.json's mechanisms listed 12 steps (epoch 3's too) while
    metrics.csv, epochs_completed and final.epsilon stop at epoch 2 (8 steps); they now agree."""
    stop_in_epoch_3(tmp_path, monkeypatch)
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = pd.read_csv(tmp_path / "metrics.csv")
    assert summary["status"] == "interrupted" and summary["epochs_completed"] == len(rows) == 2
    assert sum(m["steps"] for m in summary["mechanisms"]) == rows.steps.sum() == 8
    assert summary["final"]["epsilon"] == pytest.approx(rows.epsilon.iloc[-1], rel=1e-12)


@pytest.mark.parametrize("where", ["metrics.csv", "rows_on_disk"])
def test_a_stop_after_an_epochs_checkpoint_publishes_that_epoch(tmp_path, monkeypatch, where):
    """Review 38: a signal after epoch 2's checkpoint was saved and before metrics.csv (or the count of its rows)
    took it left summary.json at epoch 1 (epsilon of 4 steps) beside checkpoint.pt, the run's model, at epoch 2 (8
    steps). The run now publishes the saved epoch as it stops: summary.json, metrics.csv and the checkpoint agree,
    and a resume goes on from there."""
    import runner.train as train_module

    real, calls = train_module.write_csv, []

    def stopped(path, rows):
        calls.append(1)
        if len(calls) == 2 and where == "metrics.csv":  # epoch 2's write, after its checkpoint
            raise KeyboardInterrupt
        real(path, rows)
        if len(calls) == 2:  # epoch 2's rows written, the count not yet taken
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(train_module, "write_csv", stopped)
        with pytest.raises(KeyboardInterrupt):
            train(compose_config(RUN + ["epochs=3"]), tmp_path)
    saved = load(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = pd.read_csv(tmp_path / "metrics.csv")
    assert saved["epoch"] == 2 and summary["status"] == "interrupted"
    assert summary["epochs_completed"] == len(rows) == 2
    assert sum(m["steps"] for m in summary["mechanisms"]) == sum(a["count"] for a in saved["accountant"]) == 8
    assert summary["final"]["epsilon"] == pytest.approx(rows.epsilon.iloc[-1], rel=1e-12)
    proc = dprun_in_process(f"resume={tmp_path}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["epochs_completed"] == 3


def test_a_second_ctrl_c_while_the_run_publishes_its_saved_epoch_waits(tmp_path, monkeypatch):
    """Review 39: Ctrl-C after epoch 2's checkpoint, then a second Ctrl-C while the stopping run published that epoch
    (between metrics.csv and summary.json): summary.json stayed at epoch 1 (status running) beside a 2-epoch
    checkpoint.pt. Signals now wait while the run writes its last records; the first Ctrl-C's exception ends it."""
    import os
    import signal

    import runner.train as train_module

    real, calls = train_module.write_csv, []

    def stopped(path, rows):
        calls.append(1)
        if len(calls) == 2:  # epoch 2's metrics.csv, after its checkpoint: the first Ctrl-C
            raise KeyboardInterrupt
        real(path, rows)
        if len(calls) == 3:  # the stopping run's publication of epoch 2: a second Ctrl-C, a real SIGINT
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (not a test worker's)
    try:
        with monkeypatch.context() as m:
            m.setattr(train_module, "write_csv", stopped)
            with pytest.raises(KeyboardInterrupt):
                train(compose_config(RUN + ["epochs=3"]), tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(calls) == 3 and load(tmp_path)["epoch"] == 2
    assert (summary["status"], summary["epochs_completed"]) == ("interrupted", 2)
    assert len(pd.read_csv(tmp_path / "metrics.csv")) == 2
    assert sum(m["steps"] for m in summary["mechanisms"]) == 8


def test_signals_held_raises_a_signal_that_arrived_once_the_block_ends():
    """A Ctrl-C during a clean end (no exception on its way) is raised after the records are written, not lost."""
    import os
    import signal

    from runner.interrupt import Terminated, signals_held

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        written = []
        with pytest.raises(KeyboardInterrupt) as e:
            with signals_held():
                os.kill(os.getpid(), signal.SIGINT)
                written.append("summary.json")  # the block runs to its end first
        assert written == ["summary.json"] and not isinstance(e.value, Terminated)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        signal.signal(signal.SIGINT, previous)
