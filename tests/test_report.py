"""dprun-report on run folders this test makes: one row per run, the config columns, final and per-epoch metrics,
filters by experiment and scale, and `latest` keeps the newest of repeated runs."""
from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from runner.metrics import write_csv, write_json
from runner.report import collect, latest, main


def make_run(folder, method, r=1, experiment="default", scale="smoke", epochs=2, step=0.01, status="finished",
             sample_rate=0.1, capped=None, mtime=None, extra=None, sigma=0.9, started=None):
    cfg = {"experiment_name": experiment, "scale": scale, "dataset": {"name": "synthetic", "like": "cifar10"},
           "model": {"name": "papernot_cnn"}, "method": {"name": method}, "r": r, "batch_size": 256, "sigma": 0.9,
           "clip": 2.0, "lr": 0.1, "optimizer": {"name": "sgd"}, "epochs": epochs, "seed": 0,
           "max_steps_per_epoch": capped, "delta": 1e-5}
    for dotted, value in (extra or {}).items():  # e.g. {"method.mode": "bk"}
        *parents, last = dotted.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    rows = [{"epoch": e, "steps": 3, "train_loss": 2.0 / e, "train_acc": 0.1 * e, "test_loss": 2.1 / e,
             "test_acc": 0.2 * e, "epoch_time_s": 1.0 + e, "step_time_s": step, "peak_mem_bytes": 1000,
             "epsilon": "" if method == "nonprivate" else 0.5 * e} for e in range(1, epochs + 1)]
    write_csv(folder / "metrics.csv", rows)
    write_json(folder / "summary.json", {"status": status, "config": cfg, "method": method, "data_source": "synthetic",
                                         "sampling": "poisson", "sample_rate": sample_rate, "steps_per_epoch": 3,
                                         "device": "cpu", "device_name": "cpu (test)",
                                         "versions": {"torch": "2.13.0"}, "final": rows[-1],
                                         "epochs_completed": epochs,
                                         "sigma": None if method == "nonprivate" else sigma,
                                         **({"started_at": started} if started else {})})
    if mtime:
        os.utime(folder / "summary.json", (mtime, mtime))


@pytest.fixture
def outputs(tmp_path):
    root = tmp_path / "outputs"
    make_run(root / "runs" / "2026-01-01" / "a", "nonprivate")
    for i, (m, r) in enumerate([("jl", 1), ("jl", 4), ("nxbp", 1)]):
        make_run(root / "multirun" / "2026-01-01" / "s" / f"{i}_{m}", m, r=r, experiment="jl_table2", capped=3)
    return root


def test_one_row_per_run_with_config_and_final_metrics(outputs):
    table = collect(outputs)
    assert len(table) == 4
    jl4 = table[(table["method"] == "jl") & (table["r"] == 4)].iloc[0]
    assert (jl4["dataset"], jl4["like"], jl4["model"], jl4["batch_size"], jl4["sigma"], jl4["clip"]) == \
        ("synthetic", "cifar10", "papernot_cnn", 256, 0.9, 2.0)
    assert (jl4["data_source"], jl4["device"], jl4["torch_version"], jl4["experiment"]) == \
        ("synthetic", "cpu", "2.13.0", "jl_table2")
    assert jl4["test_acc"] == pytest.approx(0.4) and jl4["epsilon"] == pytest.approx(1.0)
    assert jl4["total_time_s"] == pytest.approx(2.0 + 3.0)
    assert jl4["epoch_time_est_s"] == pytest.approx(0.01 * 10)  # median step time x 1/q steps
    assert pd.isna(table[table["method"] == "nonprivate"]["epsilon"].iloc[0])


def test_filters_and_the_per_epoch_long_table(outputs):
    assert set(collect(outputs, experiment="jl_table2")["method"]) == {"jl", "nxbp"}
    assert collect(outputs, scale="paper").empty
    long = collect(outputs, experiment="jl_table2", per_epoch=True)
    assert len(long) == 3 * 2
    assert list(long[long["r"] == 4].sort_values("epoch")["epsilon"]) == [0.5, 1.0]


def test_latest_keeps_the_newest_finished_run(tmp_path):
    make_run(tmp_path / "old", "jl", r=1, epochs=1, mtime=1_000_000)
    make_run(tmp_path / "new", "jl", r=1, epochs=1, mtime=2_000_000)
    make_run(tmp_path / "broken", "jl", r=1, epochs=1, status="running", mtime=3_000_000)
    kept = latest(collect(tmp_path))
    assert len(kept) == 1 and kept["run_dir"].iloc[0].endswith("new")


def test_runs_differing_in_any_option_are_distinct_rows(tmp_path):
    for i, (key, value) in enumerate([("method.mode", "bk"), ("method.mode", "twopass"), ("accountant", "rdp"),
                                      ("sampling", "shuffle"), ("dtype", "float64"), ("target_epsilon", 3.0)]):
        make_run(tmp_path / str(i), "reweight", mtime=1_000_000 + i, **{"extra": {key: value}})
    assert len(latest(collect(tmp_path))) == 6


def test_cli_prints_one_row_per_run_and_writes_csv(outputs, capsys):
    assert main(["--root", str(outputs)]) == 0
    out = capsys.readouterr().out
    assert "4 runs, 4 rows" in out and out.count("finished") == 4
    csv = pd.read_csv(outputs / "tables" / "runs.csv")
    assert len(csv) == 4
    assert main(["--root", str(outputs), "--experiment", "jl_table2", "--epochs", "--quiet"]) == 0
    assert len(pd.read_csv(outputs / "tables" / "runs_jl_table2_epochs.csv")) == 6


def test_bad_root_is_one_line(tmp_path, capsys):
    assert main(["--root", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dprun-report: no outputs folder")


def test_unreadable_run_is_skipped(outputs, capsys):
    (outputs / "runs" / "bad").mkdir()
    (outputs / "runs" / "bad" / "summary.json").write_text("{not json")
    assert len(collect(outputs)) == 4
    assert "skipping unreadable run" in capsys.readouterr().err


def test_calibrated_sigma_no_sigma_when_not_private_iso_time_and_the_inf_pointer(tmp_path, capsys):
    root = tmp_path / "outputs"
    make_run(root / "runs" / "a", "nonprivate")
    make_run(root / "runs" / "b", "nxbp", sigma=0.72)  # configured 0.9, calibrated to a target epsilon: 0.72
    make_run(root / "runs" / "c", "jl")
    summary = root / "runs" / "c" / "summary.json"
    data = json.loads(summary.read_text())
    data["epsilon_lower_bound"] = 4.2e11
    summary.write_text(json.dumps(data))
    rows = pd.read_csv(root / "runs" / "c" / "metrics.csv")
    rows["epsilon"] = float("inf")
    rows.to_csv(root / "runs" / "c" / "metrics.csv", index=False)
    table = collect(root).set_index("method")
    assert table.loc["nxbp", "sigma"] == 0.72 and table.loc["nxbp", "sigma_configured"] == 0.9
    assert pd.isna(table.loc["nonprivate", "sigma"]) and pd.isna(table.loc["nonprivate", "delta"])
    assert table.loc["nxbp", "delta"] == 1e-5 and table.loc["nxbp", "finished_at"].endswith("+00:00")
    assert main(["--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "1 runs have epsilon=inf" in out and "4.2e+11" in out and "docs/privacy.md" in out


def test_a_run_without_noise_shows_inf_without_an_infinite_lower_bound(tmp_path, capsys):
    """sigma=0: epsilon and its lower bound are both inf; the report says inf (not "inf (> inf)") and names sigma=0."""
    root = tmp_path / "outputs"
    make_run(root / "runs" / "a", "jl", sigma=0.0)
    rows = pd.read_csv(root / "runs" / "a" / "metrics.csv")
    rows["epsilon"], rows["epsilon_lower_bound"] = float("inf"), float("inf")
    rows.to_csv(root / "runs" / "a" / "metrics.csv", index=False)
    assert main(["--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "inf (> inf)" not in out and " inf " in out.splitlines()[1] + " "
    assert "1 runs have epsilon=inf" in out and "sigma=0" in out and "lower bounds up to" not in out


def test_the_default_table_is_yours_oldest_first_with_folder_start_and_capped_runs_marked(tmp_path, capsys):
    """After a sweep: the committed reference runs (outputs/reference/) are left out unless asked for, rows are in
    start order with their folder, and runs cut short by max_steps_per_epoch say so."""
    root = tmp_path / "outputs"
    make_run(root / "runs" / "b", "nxbp", started="2026-01-02T10:00:00+00:00")
    make_run(root / "multirun" / "s" / "0_jl", "jl", capped=3, started="2026-01-01T10:00:00+00:00")  # 3 of 10 steps
    make_run(root / "multirun" / "s" / "1_jl", "jl", capped=30, started="2026-01-01T10:00:01+00:00")  # 30 >= 10
    make_run(root / "reference" / "paper" / "runs" / "x", "reweight")
    table = collect(root)
    assert list(table["folder"]) == ["multirun/s/0_jl", "multirun/s/1_jl", "runs/b"]  # oldest first, no reference
    assert list(table["started_at"]) == sorted(table["started_at"])
    assert list(table["capped"]) == [True, False, False] and table["full_steps_per_epoch"].iloc[0] == 10
    mixed = collect(root, reference=True)
    assert dict(zip(mixed["folder"], mixed["source"]))["reference/paper/runs/x"] == "reference"
    assert set(mixed["source"]) == {"reference", "user"}
    assert main(["--root", str(root)]) == 0
    out = capsys.readouterr().out
    header, first = out.splitlines()[:2]
    assert "started" in header and "folder" in header and "capped" in header and "source" not in header
    assert "multirun/s/0_jl" in first and "3/10" in first and "2026-01-01" in first
    assert "reference" not in out and "3 runs, 3 rows" in out
    assert main(["--root", str(root), "--all"]) == 0
    out = capsys.readouterr().out
    assert "source" in out.splitlines()[0] and "reference/paper/runs/x" in out and "4 runs, 4 rows" in out


def test_only_reference_runs_says_how_to_see_them(tmp_path, capsys):
    make_run(tmp_path / "reference" / "x", "reweight")
    assert main(["--root", str(tmp_path)]) == 0
    assert "listed with --reference" in capsys.readouterr().out


def test_a_run_that_missed_its_target_epsilon_is_named(tmp_path, capsys):
    make_run(tmp_path / "runs" / "gdp", "reweight", extra={"target_epsilon": 2.0})
    summary = json.loads((tmp_path / "runs" / "gdp" / "summary.json").read_text())
    summary.update(planned_epsilon=3.279, target_epsilon_met=False, calibration_accountant="gdp")
    (tmp_path / "runs" / "gdp" / "summary.json").write_text(json.dumps(summary))
    make_run(tmp_path / "runs" / "ok", "reweight")
    row = collect(tmp_path).set_index("folder").loc["runs/gdp"]
    assert (row["target_epsilon"], row["planned_epsilon"], row["target_epsilon_met"]) == (2.0, 3.279, False)
    assert main(["--root", str(tmp_path)]) == 0
    assert "1 runs missed their target_epsilon" in capsys.readouterr().out


def test_audited_column_and_a_failed_audit_is_a_warning(tmp_path, capsys):
    make_run(tmp_path / "runs" / "bad", "reweight")
    summary = json.loads((tmp_path / "runs" / "bad" / "summary.json").read_text())
    summary["audit"] = {"kind": "gradient", "epsilon_lower_bound": 2.5, "epsilon_lower_bound_fdp": 3.1,
                        "ceiling": 5.1, "epsilon_claimed": 1.0, "above_claimed": True}
    (tmp_path / "runs" / "bad" / "summary.json").write_text(json.dumps(summary))
    make_run(tmp_path / "runs" / "ok", "reweight")
    assert main(["--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "AUDIT FAILED >= 2.5" in out and "WARNING: 1 runs FAILED their privacy audit" in out
    assert "runs/bad" in out.splitlines()[-2]
    assert main(["--root", str(tmp_path), "--wide"]) == 0  # the default view shortens cells to fit 120 columns
    assert "AUDIT FAILED >= 2.5 (f-DP 3.1)" in capsys.readouterr().out
