"""python -m runner.bench.layout: each row in NCHW and channels-last side by side, and what memory_format=auto picks."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from runner.bench import clip, layout
from runner.bench.common import bench_device
from runner.errors import DprunError


def test_both_layouts_are_timed_in_one_process_and_a_method_that_needs_nchw_says_so(tmp_path):
    table = layout.main(["--quick", "--device", "cpu", "--workloads", "cnn_mnist", "--methods",
                         "nonprivate,reweight-bk,opacus-hooks", "--repeats", "2", "--warmup", "1",
                         "--out", str(tmp_path)])
    saved = pd.read_csv(tmp_path / "layout_cpu_quick.csv")
    assert list(saved.method) == ["nonprivate", "reweight-bk", "opacus-hooks"] and len(table) == 3
    ours = saved[saved.method != "opacus-hooks"]
    assert (ours.nchw_ms > 0).all() and (ours.channels_last_ms > 0).all()
    assert (ours.cl_over_nchw - ours.channels_last_ms / ours.nchw_ms).abs().max() < 1e-9
    opacus = saved[saved.method == "opacus-hooks"].iloc[0]
    assert opacus.nchw_ms > 0 and math.isnan(opacus.channels_last_ms) and "needs NCHW" in opacus.note
    assert set(saved.auto) == {"channels_last"}  # bu_cnn carries the mark


def test_auto_column_says_a_model_measured_slower_stays_as_built():
    vgg = next(w for w in clip.suite_workloads("gpu", quick=True) if w.name == "vgg11_cifar10")
    rows = layout.compare_layouts(vgg, ["nonprivate"], bench_device("cpu"), repeats=1, warmup=1, budget_s=math.inf,
                                  precision="fp32")
    assert rows[0]["auto"] == "as built" and rows[0]["nchw_ms"] > 0 and rows[0]["channels_last_ms"] > 0


def test_an_unknown_row_is_one_line():
    with pytest.raises(DprunError, match="unknown row 'nope'"):
        layout.main(["--quick", "--device", "cpu", "--workloads", "cnn_mnist", "--methods", "nope"])
