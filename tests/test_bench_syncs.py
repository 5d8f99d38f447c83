"""bench-syncs (runner/bench/syncs.py): each synchronizing call of a step named by its thread and innermost frames.
The CUDA warn mode is not on this machine: the recorder is checked with warnings raised as torch raises them."""
from __future__ import annotations

import threading
import warnings

import pandas as pd

from runner.bench import syncs


def reads_a_value():  # stands for a step's `bool(t.all())` on a GPU
    warnings.warn("called a synchronizing CUDA operation", UserWarning)


def test_each_sync_is_counted_where_it_came_from():
    switched = []
    with syncs.syncs_recorded(lambda: switched.append("on"), lambda: switched.append("off")) as seen:
        for _ in range(2):
            reads_a_value()
        worker = threading.Thread(target=reads_a_value, name="autograd-like")
        worker.start()
        worker.join()
    assert switched == ["on", "off"]
    assert sum(seen.values()) == 3
    main = [place for place in seen if place.startswith("[MainThread]")]
    assert len(main) == 1 and seen[main[0]] == 2 and "reads_a_value" in main[0] and "test_bench_syncs.py" in main[0]
    other = [place for place in seen if place.startswith("[autograd-like]")]
    assert len(other) == 1 and "reads_a_value" in other[0]


def test_the_command_runs_on_the_cpu_and_says_there_is_nothing_to_wait_for(tmp_path):
    df = syncs.main(["--device", "cpu", "--quick", "--workloads", "cnn_mnist", "--methods", "nonprivate,reweight-bk",
                     "--out", str(tmp_path)])
    assert list(df["method"]) == ["nonprivate", "reweight-bk"]
    assert (df["note"] == "no device to wait for on the CPU").all() and df["syncs_per_step"].isna().all()
    saved = pd.read_csv(next(tmp_path.glob("syncs_cpu*.csv")))
    assert len(saved) == 2
