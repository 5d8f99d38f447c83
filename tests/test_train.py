"""The training loop: accuracy on real data, the metrics files, crash safety."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import compose_config
from runner.metrics import write_csv
from runner.train import train

METRIC_COLUMNS = ["epoch", "steps", "train_loss", "train_acc", "test_acc", "epoch_time_s", "step_time_s",
                  "peak_mem_bytes", "epsilon"]


def test_digits_nonprivate_reaches_90_percent(tmp_path):
    cfg = compose_config(["progress=false"])  # the demo defaults: digits, MLP, SGD
    summary = train(cfg, tmp_path)
    assert summary["status"] == "finished"
    assert summary["final"]["test_acc"] >= 0.90
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    claimed = re.search(r"~(\d+)% test accuracy in seconds", readme).group(1)  # the set-up section's demo
    assert summary["final"]["test_acc"] == pytest.approx(int(claimed) / 100, abs=0.015)


def test_metrics_csv_and_summary_json(tmp_path):
    cfg = compose_config(["epochs=2", "progress=false", "max_steps_per_epoch=3"])
    train(cfg, tmp_path)
    table = pd.read_csv(tmp_path / "metrics.csv")
    assert [c for c in table.columns if c in METRIC_COLUMNS] == METRIC_COLUMNS
    assert table.epoch.tolist() == [1, 2] and (table.steps == 3).all()
    assert (table.step_time_s > 0).all() and (table.peak_mem_bytes > 0).all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["dataset"]["name"] == "digits"
    assert summary["versions"]["torch"] == torch.__version__
    assert summary["data_source"] == "real" and summary["sampling"] == "poisson"
    assert summary["final"]["epoch"] == 2 and summary["epochs_completed"] == 2


def test_interrupted_run_keeps_only_complete_rows(tmp_path, monkeypatch):
    """A crash in epoch 2 leaves epoch 1's complete row and a summary marked as not finished."""
    from runner.methods.base import NonPrivate

    cfg = compose_config(["epochs=3", "progress=false", "max_steps_per_epoch=2"])
    calls = {"n": 0}
    original = NonPrivate.step

    def crashing_step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # first step of epoch 2
            raise KeyboardInterrupt
        return original(self, *a, **k)

    monkeypatch.setattr(NonPrivate, "step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path)
    table = pd.read_csv(tmp_path / "metrics.csv")
    assert table.epoch.tolist() == [1]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["epochs_completed"] == 1


def test_csv_writer_is_atomic(tmp_path, monkeypatch):
    """If writing fails half-way, the previous complete file stays."""
    path = tmp_path / "m.csv"
    write_csv(path, [{"a": 1}])
    import runner.metrics as m

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(m.os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_csv(path, [{"a": 1}, {"a": 2}])
    assert path.read_text().splitlines() == ["a", "1"]


@pytest.mark.parametrize("sampling", ["shuffle", "fixed"])
def test_non_poisson_sampling_is_recorded(tmp_path, sampling):
    cfg = compose_config([f"sampling={sampling}", "epochs=1", "progress=false", "max_steps_per_epoch=2"])
    assert train(cfg, tmp_path)["sampling"] == sampling


def test_failed_run_is_marked_failed(tmp_path, monkeypatch):
    from runner.methods.base import NonPrivate

    def oom(self, *a, **k):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(NonPrivate, "step", oom)
    with pytest.raises(RuntimeError):
        train(compose_config(["epochs=1", "progress=false"]), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "out of memory" in summary["error"]


def test_eval_cap_and_per_epoch_cpu_peak_memory(tmp_path):
    from runner.evaluation import eval_subset, evaluate

    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(100, 4), torch.randint(0, 3, (100,))
    loss_all, _ = evaluate(model, x, y, 10)
    idx = eval_subset(y, 20)
    loss_cap, _ = evaluate(model, x, y, 10, idx)
    assert loss_cap == pytest.approx(evaluate(model, x[idx], y[idx], 10)[0]) and loss_cap != loss_all
    assert eval_subset(y, 100) is None and eval_subset(y, 500) is None  # a cap at or above N: all of it
    if not Path("/proc/self/clear_refs").exists():
        return
    # Linux: the peak resets (/proc/self/clear_refs), so a job after a bigger one reports its own peak. In a fresh
    # process: pytest's own heap would blur a 256 MiB step.
    script = """
import torch
from runner.metrics import peak_memory_bytes, reset_peak_memory
cpu = torch.device("cpu")
big = torch.ones(256 * 2**20 // 4); big.add_(1); high = peak_memory_bytes(cpu); del big
reset_peak_memory(cpu)
print(high - peak_memory_bytes(cpu))
"""
    assert in_fresh_process(script) > 128 * 2**20


def in_fresh_process(script: str) -> int:
    """The last number `script` prints, run by this python in the repository root."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_cpu_peak_excludes_the_heap_an_earlier_job_freed():
    """glibc keeps freed blocks below the heap's top resident; reset_peak_memory hands them back first, so a sweep's
    next job does not start from the previous job's leftovers. 256 MiB of 64 KiB blocks (below malloc's mmap
    threshold: the heap), all freed but the last one."""
    import platform

    if not Path("/proc/self/clear_refs").exists() or platform.libc_ver()[0] != "glibc":
        pytest.skip("per-epoch CPU peak and malloc_trim: Linux with glibc")
    script = """
import torch
from runner.metrics import peak_memory_bytes, reset_peak_memory
cpu = torch.device("cpu")
reset_peak_memory(cpu); before = peak_memory_bytes(cpu)
blocks = [bytearray(64 * 2**10) for _ in range(4096)]
last = blocks[-1]; del blocks
reset_peak_memory(cpu)
print(peak_memory_bytes(cpu) - before)
"""
    assert in_fresh_process(script) < 64 * 2**20


@pytest.mark.parametrize("progress", [False, True])
def test_training_loop_reads_nothing_back_from_the_device_per_step(tmp_path, monkeypatch, progress):
    """On a GPU every .item()/float()/int() of a device tensor is a sync that stalls the queue. The loop keeps loss
    and accuracy on the device, and the progress bar reads them every PROGRESS_EVERY steps only, so the reads made
    from runner/train.py must not grow with the number of steps."""
    import sys

    import runner.train as train_module

    reads = {"n": 0}

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            if sys._getframe(1).f_code.co_filename == train_module.__file__:
                reads["n"] += 1
            return original(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, wrapper)

    for name in ("item", "__float__", "__int__", "tolist"):
        counting(name)
    monkeypatch.setattr(train_module, "PROGRESS_EVERY", 1000)
    counts = []
    for steps in (3, 9):
        reads["n"] = 0
        cfg = compose_config(["epochs=1", f"progress={str(progress).lower()}", f"max_steps_per_epoch={steps}",
                              "step_timing=epoch", "max_eval_batches=1"])
        train(cfg, tmp_path / f"{progress}-{steps}")
        counts.append(reads["n"])
    assert counts[0] == counts[1], counts
    table = pd.read_csv(tmp_path / f"{progress}-9" / "metrics.csv")
    assert table.step_time_s.iloc[0] > 0 and 0 <= table.train_acc.iloc[0] <= 1


def test_log_norms_adds_quantiles_and_the_unclipped_share(tmp_path):
    """method=reweight: exact norms, so the unclipped share at a clip above every norm is 1, and at a tiny clip 0."""
    for clip, share in (("1e9", 1.0), ("1e-6", 0.0)):
        cfg = compose_config(["epochs=1", "progress=false", "max_steps_per_epoch=3", "method=reweight",
                              f"clip={clip}", "sigma=1.0", "log_norms=true", "max_eval_batches=1"])
        train(cfg, tmp_path / clip)
        row = pd.read_csv(tmp_path / clip / "metrics.csv").iloc[0]
        assert row.unclipped_frac == share
        assert 0 < row.norm_p10 <= row.norm_median <= row.norm_p90 <= row.norm_max
    cfg = compose_config(["epochs=1", "progress=false", "max_steps_per_epoch=2", "max_eval_batches=1"])
    train(cfg, tmp_path / "np")  # non-private: no norms, no columns
    assert "norm_median" not in pd.read_csv(tmp_path / "np" / "metrics.csv").columns


def test_epoch_line_says_why_there_is_no_epsilon(tmp_path, caplog):
    """A private method without an accountant adds noise: its epoch line must not call the run non-private."""
    with caplog.at_level("INFO", logger="dprun"):
        train(compose_config(["dataset=digits", "epochs=1", "progress=false", "method=reweight",
                              "accountant=none"]), tmp_path / "private")
        train(compose_config(["dataset=digits", "epochs=1", "progress=false"]), tmp_path / "nonprivate")
    lines = [r.getMessage() for r in caplog.records if "epoch 1/1" in r.getMessage()]
    assert len(lines) == 2
    assert "epsilon=none (accountant=none)" in lines[0] and "non-private" not in lines[0]
    assert "epsilon=none (non-private)" in lines[1]
