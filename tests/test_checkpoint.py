"""Checkpoint and resume (runner/checkpoint.py): a run interrupted in epoch 3 (or finished after epoch 2) and resumed
to epoch 4 equals one that ran 4 epochs straight — weights, losses and epsilon per epoch."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import compose_config
from runner.checkpoint import FILE, load, resume_argv
from runner.errors import DprunError
from runner.train import train

RUN = ["method=reweight", "sigma=1.0", "max_steps_per_epoch=4", "progress=false", "optimizer=adam", "lr=0.01"]


def files(folder):
    """Every file under folder (.hydra/ included) -> its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


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


def test_resume_argv_reuses_the_runs_overrides_and_folder(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- method=jl\n- epochs=2\n- r=4\n")
    argv = resume_argv([f"resume={tmp_path}", "epochs=5"])
    assert argv == ["method=jl", "r=4", f"resume={tmp_path}", "epochs=5", f"hydra.run.dir={tmp_path}"]
