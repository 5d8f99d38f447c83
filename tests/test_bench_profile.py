"""python -m runner.bench.profile: the operators of a bench step by self time, per contender, saved as a table."""
from __future__ import annotations

import pandas as pd
import pytest

from runner.bench import profile
from runner.errors import DprunError


def test_the_profile_names_the_steps_operators_and_their_share(tmp_path, capsys):
    table = profile.main(["--quick", "--device", "cpu", "--workloads", "cnn_mnist", "--methods",
                          "nonprivate,reweight-bk", "--repeats", "1", "--warmup", "1", "--top", "5",
                          "--out", str(tmp_path)])
    assert set(table.method) == {"nonprivate", "reweight-bk"}
    saved = pd.read_csv(tmp_path / "profile_cpu_quick.csv")
    assert len(saved) == len(table) and (saved.self_ms_per_step > 0).all()
    for method, rows in saved.groupby("method"):
        assert abs(rows.share.sum() - 1) < 1e-6 and rows.name.str.startswith("aten::").any()
    bk, plain = (saved[saved.method == m] for m in ("reweight-bk", "nonprivate"))
    assert bk.calls_per_step.sum() > plain.calls_per_step.sum()  # the norms and clipped sums are there
    assert "reweight-bk fp32" in capsys.readouterr().out


def test_an_unknown_row_is_one_line():
    with pytest.raises(DprunError, match="unknown row 'nope'"):
        profile.main(["--quick", "--device", "cpu", "--workloads", "cnn_mnist", "--methods", "nope"])


def test_host_time_per_operator_keeps_the_backwards_python(tmp_path):
    """--host: the host's self time per operator (on CUDA instead of the kernels' device time), with autograd's rows,
    where the lean recorder's hooks run inside the backward."""
    table = profile.main(["--quick", "--device", "cpu", "--workloads", "cnn_mnist", "--methods", "reweight-bk-inline",
                          "--repeats", "1", "--warmup", "1", "--host", "--out", str(tmp_path)])
    assert table.name.str.startswith("autograd::engine::evaluate_function").any()
    assert table.name.str.startswith("aten::").any() and (table.self_ms_per_step > 0).all()
