"""The `dprun` command: composition, sweeps, and one-line errors for bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, dprun_in_process


def dprun(*args, cwd, timeout=300):
    return subprocess.run([sys.executable, "-m", "runner.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


# What dprun says and writes is checked in this process (conftest.dprun_in_process: the same code from argv to the
# exit status, without a new interpreter's ~5 s of imports); the tests that start `python -m runner.cli` check the
# process itself: --version, --help, a multirun's terminal output.


def one_line_error(proc) -> str:
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("dprun: ")
    return lines[0]


@pytest.mark.parametrize("arg,bad,valid", [("method=foo", "foo", "nxbp"), ("model=bar", "bar", "mlp"),
                                           ("dataset=cifar100", "cifar100", "cifar10"),
                                           ("optimizer=rmsprop", "rmsprop", "adam")])
def test_unknown_group_option_is_one_line(tmp_path, arg, bad, valid):
    line = one_line_error(dprun_in_process(arg, cwd=tmp_path))
    assert bad in line and valid in line


def test_bad_knob_values_are_one_line(tmp_path):
    line = one_line_error(dprun_in_process("sampling=random", "epochs=1", cwd=tmp_path))
    assert "random" in line and "poisson" in line
    line = one_line_error(dprun_in_process("device=tpu", "epochs=1", cwd=tmp_path))
    assert "tpu" in line and "cpu" in line
    line = one_line_error(dprun_in_process("batch_size=100000", "epochs=1", cwd=tmp_path))
    assert "100000" in line


def test_missing_dataset_files_name_the_files_and_folder(tmp_path):
    line = one_line_error(dprun_in_process("dataset=mnist", f"data_dir={tmp_path}/nowhere", "epochs=1", cwd=tmp_path))
    assert "nowhere" in line and "train-images" in line


def test_multirun_writes_one_folder_per_run(tmp_path):
    proc = dprun("-m", "model=cnn,mlp", "dataset=digits", "epochs=1", "max_steps_per_epoch=3", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summaries = sorted((tmp_path / "outputs" / "multirun").rglob("summary.json"))
    assert len(summaries) == 2
    models = {json.loads(p.read_text())["config"]["model"]["name"] for p in summaries}
    assert models == {"cnn", "mlp"}
    assert all((p.parent / "metrics.csv").exists() for p in summaries)
    assert sorted(p.parent.name for p in summaries) == ["0_model=cnn", "1_model=mlp"]  # named by what was swept
    for p in summaries:  # each job: its own log, one line per epoch with an ETA
        assert "epoch 1/1: train_loss=" in (p.parent / "dprun.log").read_text()
    assert proc.stderr.count("eta=0:00:00") == 2 and "dprun: nonprivate on digits: test_acc" in proc.stdout


def test_two_runs_in_the_same_second_never_share_a_folder(tmp_path):
    a = dprun_in_process("epochs=1", "max_steps_per_epoch=2", cwd=tmp_path)  # in this process: <1 s apart
    b = dprun_in_process("epochs=1", "max_steps_per_epoch=2", cwd=tmp_path)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert len(list((tmp_path / "outputs" / "runs").rglob("summary.json"))) == 2


def test_synthetic_cifar_run_starts(tmp_path):
    proc = dprun_in_process("dataset=synthetic", "dataset.like=cifar10", "dataset.train_size=512",
                            "dataset.test_size=64", "epochs=1", "max_steps_per_epoch=2", "batch_size=32",
                            "max_eval_batches=1", "eval_batch_size=16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "papernot_cnn" in (list((tmp_path / "outputs").rglob("summary.json"))[0]).read_text()


def test_a_sweep_over_a_method_option_reports_one_row_per_value(tmp_path):
    proc = dprun_in_process("-m", "method=reweight", "method.mode=bk,twopass", "dataset=digits", "epochs=1",
                            "max_steps_per_epoch=2", "progress=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from runner.report import collect, latest

    rows = latest(collect(tmp_path / "outputs"))
    assert sorted(rows["method_options"]) == ["mode=bk norm=auto keep=1.1 recorder=auto defer=auto late=auto",
                                              "mode=twopass norm=auto keep=1.1 recorder=auto defer=auto late=auto"]
    assert rows["config_key"].nunique() == 2


@pytest.fixture(scope="module")
def help_proc(tmp_path_factory):
    """`dprun --help`, once for the tests that read it."""
    return dprun("--help", cwd=tmp_path_factory.mktemp("help"))


def test_help_lists_groups_knobs_and_examples_with_nothing_unresolved(help_proc):
    proc = help_proc
    assert proc.returncode == 0 and "${" not in proc.stdout
    for text in ("method: jl, multiloss, nonprivate", "batch_size=64", "resume=<run dir>", "Examples:",
                 "dprun method=reweight target_epsilon=3", "docs/api.md"):
        assert text in proc.stdout, text
    assert "powered by Hydra" not in proc.stdout


def test_help_lists_every_knob_of_config_yaml(help_proc):
    """A knob added to conf/config.yaml without a line in the help's Knobs section fails here."""
    import re

    import yaml

    proc = help_proc
    knobs = proc.stdout[proc.stdout.index("Knobs ("):proc.stdout.index("Examples:")]
    config = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())
    keys = set()  # a group of knobs (distributed:) counts by its dotted keys, each needing its line
    for key in set(config) - {"defaults", "hydra"}:
        keys |= {f"{key}.{sub}" for sub in config[key]} if isinstance(config[key], dict) else {key}
    missing = sorted(k for k in keys if not re.search(rf"(^|\s){re.escape(k)}(=|\s|$)", knobs, re.MULTILINE))
    assert not missing, f"conf/config.yaml knobs without a line in the help template: {missing}"


def test_version_is_dprun_s_and_exits_0(tmp_path):
    from runner import __version__

    proc = dprun("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == f"dprun {__version__}\n" and proc.stderr == ""
    assert not (tmp_path / "outputs").exists()  # answered before Hydra: no run folder


@pytest.mark.parametrize("arg", ["+batchsize=32", "batchsize=32"])
def test_an_unknown_key_is_refused_in_one_line(tmp_path, arg):
    line = one_line_error(dprun_in_process(arg, cwd=tmp_path))
    assert "unknown key 'batchsize'" in line and "did you mean 'batch_size'" in line


def test_launcher_without_its_plugin_names_the_extra(tmp_path, monkeypatch):
    from runner import cli

    monkeypatch.setattr(cli, "_importable", lambda module: False)
    with pytest.raises(cli.DprunError, match=r"launcher=joblib needs its Hydra plugin: pip install 'dprun\[launchers\]'"):
        cli.check_launcher_extra(["-m", "launcher=joblib"])


def test_model_mlp_on_digits_is_the_model_auto_gives():
    from conftest import compose_config
    from omegaconf import OmegaConf
    from runner import models
    from runner.data.base import DataInfo

    info = DataInfo("digits", (1, 8, 8), 10)
    built = []
    for choice in ("auto", "mlp"):
        cfg = OmegaConf.to_container(compose_config([f"model={choice}"]).model, resolve=True)
        kwargs = {k: v for k, v in cfg.items() if k not in ("name", "kwargs")} | (cfg.get("kwargs") or {})
        built.append(str(models.build(cfg["name"], info, **kwargs)))
    assert built[0] == built[1] and "Tanh" in built[0]
    mnist = OmegaConf.to_container(compose_config(["dataset=mnist", "model=mlp"]).model, resolve=True)
    knobs = {k: v for k, v in mnist.items() if k not in ("name", "kwargs") and v is not None}  # null: the default
    assert "Sigmoid" in str(models.build("mlp", DataInfo("mnist", (1, 28, 28), 10), **knobs))  # L&K's MLP elsewhere


def test_a_resumes_method_option_is_checked_against_the_resumed_run(tmp_path):
    """`dprun resume=<a method=jl r=30 run> method.r=2` said "method.r is not an option of method=nonprivate" (the
    command line's default method, before the resume merged the run's config); now the resume's own check names the
    run's value."""
    run = tmp_path / "jl30"
    first = dprun_in_process("method=jl", "r=30", "dataset=digits", "epochs=1", "max_steps_per_epoch=1",
                             "progress=false", f"out_dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    line = one_line_error(dprun_in_process(f"resume={run}", "epochs=2", "method.r=2", cwd=tmp_path))
    assert "method.r=2 would change the run (method.r=30 there)" in line and "nonprivate" not in line
    assert one_line_error(dprun_in_process("resume=null", "method.r=2", "epochs=1", cwd=tmp_path)).startswith(
        "dprun: method.r is not an option of method=nonprivate")  # no resume: checked as before
