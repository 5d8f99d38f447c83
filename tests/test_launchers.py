"""Sweeps locally (basic, joblib), on Slurm (submitit, tested by composition) and with submitit's local executor
(end to end, -m slow)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from runner.paths import compose

TARGETS = {
    "basic": "hydra._internal.core_plugins.basic_launcher.BasicLauncher",
    "joblib": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
    "submitit_local": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
    "slurm": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
}


PLUGIN = {"joblib": "hydra_plugins.hydra_joblib_launcher", "submitit_local": "hydra_plugins.hydra_submitit_launcher",
          "slurm": "hydra_plugins.hydra_submitit_launcher"}  # the `launchers` extra


def needs_plugin(launcher):
    if launcher in PLUGIN:
        pytest.importorskip(PLUGIN[launcher], reason="pip install 'dprun[launchers]'")


def hydra_cfg(overrides):
    return compose(overrides, return_hydra_config=True)


def test_default_launcher_is_basic():
    assert hydra_cfg([]).hydra.launcher._target_ == TARGETS["basic"]


@pytest.mark.parametrize("launcher", sorted(TARGETS))
def test_launcher_composes(launcher):
    needs_plugin(launcher)
    cfg = hydra_cfg([f"launcher={launcher}", "experiment=jl_table2"])
    assert cfg.hydra.launcher._target_ == TARGETS[launcher]
    assert cfg.experiment_name == "jl_table2"


def test_slurm_reads_site_settings_from_the_environment(monkeypatch):
    needs_plugin("slurm")
    monkeypatch.setenv("DPRUN_SLURM_PARTITION", "gpu-h100")
    monkeypatch.delenv("DPRUN_SLURM_ACCOUNT", raising=False)
    launcher = hydra_cfg(["launcher=slurm"]).hydra.launcher
    assert launcher.partition == "gpu-h100" and launcher.account is None
    assert launcher.gpus_per_node == 1 and launcher.timeout_min >= 60
    assert str(launcher.submitit_folder).endswith(".submitit/%j")


def test_slurm_options_override_on_the_command_line():
    needs_plugin("slurm")
    cfg = hydra_cfg(["launcher=slurm", "hydra.launcher.partition=long", "hydra.launcher.timeout_min=30"])
    assert cfg.hydra.launcher.partition == "long" and cfg.hydra.launcher.timeout_min == 30


def sweep_in(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "runner.cli", "-m", *args, "dataset=digits", "epochs=1",
                           "progress=false", "seed=0,1"], cwd=tmp_path, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_parallel_launchers_end_to_end(launcher, tmp_path):
    needs_plugin(launcher)
    proc = sweep_in(tmp_path, f"launcher={launcher}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    from runner.report import collect

    runs = collect(tmp_path / "outputs")
    assert sorted(runs["seed"]) == [0, 1] and (runs["status"] == "finished").all()
    if launcher == "submitit_local":
        assert list((tmp_path / "outputs" / "multirun").rglob(".submitit"))
