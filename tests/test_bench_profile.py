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


def test_a_compiled_row_is_profiled_and_kernel_rows_need_a_cuda_timeline(tmp_path, monkeypatch):
    """--compile MODE: rows <row>+compile step compiled (here Dynamo with eager kernels, not Inductor: seconds, not
    minutes), profiled like any row; such a row without --compile, and --by kernel off CUDA, are one line each."""
    import torch

    import runner.methods.compiled as compiled

    original = compiled.CompiledStep.__init__

    def eager_backend(self, method, mode, device, physical, backend=None):
        original(self, method, mode, device, physical, backend="eager")

    torch._dynamo.reset()
    monkeypatch.setattr(compiled.CompiledStep, "__init__", eager_backend)
    table = profile.main(["--quick", "--device", "cpu", "--workloads", "fig6_b16", "--methods",
                          "nonprivate+compile", "--compile", "default", "--repeats", "1", "--warmup", "3",
                          "--out", str(tmp_path)])
    assert set(table.method) == {"nonprivate+compile"} and table.name.str.startswith("aten::").any()
    with pytest.raises(DprunError, match="row 'reweight-bk\\+compile' needs --compile MODE"):
        profile.main(["--quick", "--device", "cpu", "--workloads", "fig6_b16", "--methods", "reweight-bk+compile"])
    with pytest.raises(DprunError, match="unknown row 'reweight-bk\\+jit'"):
        profile.main(["--quick", "--device", "cpu", "--workloads", "fig6_b16", "--methods", "reweight-bk+jit"])
    with pytest.raises(DprunError, match="--by kernel needs the device's own timeline: a CUDA device without --host "
                       "\\(here cpu\\)"):
        profile.main(["--quick", "--device", "cpu", "--workloads", "fig6_b16", "--by", "kernel"])
