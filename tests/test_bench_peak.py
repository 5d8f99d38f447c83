"""`python -m runner.bench.peak` (runner/bench/peak.py): what a step holds at its memory peak."""
from __future__ import annotations

import torch

from runner.bench import peak as bench_peak
from runner.bench.clip import method_contender, workloads
from runner.bench.common import step_memory_bytes, synthetic_batch
from runner.models import MODELS

MIB = 2**20


def test_the_peak_is_what_is_alive_at_once_with_the_operator_and_line_that_made_it():
    kept = []

    def step():
        big = torch.ones(1024, 256)  # 1 MiB, kept past the step
        kept.append(big)
        tmp = big * 2  # 1 MiB more: the peak, 2 MiB
        del tmp
        torch.ones(16)  # after the peak

    peak, at, rows = bench_peak.peak_tensors(step)
    assert peak == 2 * MIB
    assert at.startswith("mul (test_bench_peak.py:")
    assert rows.mb.tolist() == [1.0, 1.0]
    assert sorted(rows.operator) == ["mul", "ones"]
    assert all(site.startswith("test_bench_peak.py:") for site in rows.site)


def test_autograds_saved_tensors_count_after_python_drops_them():
    x = torch.randn(512, 256)
    w = torch.randn(256, 512, requires_grad=True)

    def step():
        h = (x @ w).tanh()  # tanh keeps its output (512 x 512: 1 MiB) for the backward
        loss = h.sum()
        del h  # Python's reference gone: autograd's remains
        loss.backward()

    peak, _, rows = bench_peak.peak_tensors(step, before=lambda: setattr(w, "grad", None))
    tanh = rows[rows.operator == "tanh"]
    assert len(tanh) == 1 and tanh.mb.iloc[0] == 1.0 and tanh["shape"].iloc[0] == (512, 512)
    assert peak >= 2 * MIB  # tanh's output beside its gradient (or the weight's) at some point of the backward


def test_the_peak_of_a_bench_step_is_bench_clips_measure():
    """The same quantity as bench-clip's profiler measure (the full transformer: 128.45 MB in both)."""
    w = next(w for w in workloads(quick=True) if w.name == "transformer_imdb")
    torch.manual_seed(0)
    base = MODELS.build(w.model, w.info, **w.model_kwargs)
    x, y = synthetic_batch(w.info, w.batch, torch.device("cpu"))
    for label in ("nonprivate", "reweight-bk"):
        c, _ = method_contender(label, base, x, y, float(w.batch), w.info.train_size)
        c.step()
        peak, at, rows = bench_peak.peak_tensors(c.step, before=c.zero_grad)
        # the profiler also sees the few bytes of tensors made from Python values (torch.tensor), outside the operators
        measured = step_memory_bytes(c.step, torch.device("cpu"), before=c.zero_grad)
        assert measured > 2**16 and abs(peak - measured) <= 256
        assert abs(rows.mb.sum() * MIB - peak) < 1 and at


def test_the_cli_prints_each_contender_and_saves_the_rows(tmp_path, capsys):
    df = bench_peak.main(["--quick", "--workloads", "fig6_b16", "--methods", "nonprivate,reweight-bk", "--top", "3",
                          "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.count("[peak] fig6_b16 B=2") == 2 and "bench-clip's measure" in out
    assert set(df.method) == {"nonprivate", "reweight-bk"} and (tmp_path / "peak_cpu_quick.csv").exists()
