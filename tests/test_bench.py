"""A smoke run of runner/bench (make bench-clip): the table's rows, columns and notes, not its timings."""
import math

import pandas as pd
import pytest
import torch

from runner.bench import clip
from runner.bench.common import interleaved_times, step_memory_bytes, synthetic_batch
from runner.data.base import DataInfo
from runner.errors import DprunError

TINY = DataInfo("tiny", (1, 4, 4), 3, "image", None, 100, 10)
CPU = torch.device("cpu")
try:
    import opacus  # noqa: F401  (the `peers` extra)
    HAVE_OPACUS = True
except ImportError:
    HAVE_OPACUS = False


def test_workload_rows_ratios_and_notes(monkeypatch):
    monkeypatch.setitem(clip.METHOD_VARIANTS, "future", ("no_such_method", {}))
    labels = ["nonprivate", "nxbp", "multiloss", "opacus-hooks", "opacus-ghost", "future"]
    if not HAVE_OPACUS:
        labels = [x for x in labels if not x.startswith("opacus")]
    w = clip.Workload("tiny", "mlp", TINY, 4, labels, {"widths": (5, 6)})
    df = clip.table(clip.bench_workload(w, CPU, repeats=2, warmup=1, budget_s=60.0), CPU)
    assert list(df.columns) == [c for c in clip.COLUMNS if c not in clip.DEVICE_COLUMNS]  # CPU: no host/device split
    assert list(df.method) == labels and set(df.workload) == {"tiny"} and set(df.batch) == {4}
    ran = df[df.method != "future"].set_index("method")
    assert ran.x_nonprivate["nonprivate"] == pytest.approx(1.0)
    assert ran.mem_x_nonprivate["nonprivate"] == pytest.approx(1.0)
    assert (ran.step_ms > 0).all() and (ran.step_mem_mb > 0).all() and (ran.steps_timed == 2).all()
    if HAVE_OPACUS:
        opacus_best = ran.loc[["opacus-hooks", "opacus-ghost"], "x_opacus_best"]
        assert opacus_best.min() == pytest.approx(1.0) and opacus_best.max() >= 1.0
    future = df.set_index("method").loc["future"]
    assert future.note.startswith("n/a: unknown method 'no_such_method'") and math.isnan(future.step_ms)


def test_rejected_model_is_a_row_with_a_note_and_an_unknown_model_one_line():
    text = DataInfo("text", (5,), 2, "text", 7, 100, 10)
    w = clip.Workload("rec", "rnn", text, 2, ["nonprivate", "opacus-ghost"], {"hidden": 3, "embed_dim": 2})
    df = clip.table(clip.bench_workload(w, CPU, repeats=1, warmup=1, budget_s=60.0), CPU).set_index("method")
    no_opacus = "n/a: method=opacus needs Opacus: pip install"  # without the `peers` extra: a note, not a crash
    assert df.note["opacus-ghost"].startswith("n/a: method=opacus grad_sample_mode=ghost fails" if HAVE_OPACUS
                                              else no_opacus)
    assert math.isnan(df.x_opacus_best["nonprivate"])  # no Opacus mode ran
    w = clip.Workload("gone", "no_such_model", TINY, 2, ["nonprivate"])
    with pytest.raises(DprunError, match="unknown model 'no_such_model'"):
        clip.bench_workload(w, CPU, 1, 1, 60.0)


def test_precision_rows_and_a_method_that_refuses_it():
    """--precision sets every row's precision=; reweight twopass refuses tf32 in its note, bk runs (CPU: no effect)."""
    w = clip.Workload("tiny", "mlp", TINY, 4, ["nonprivate", "reweight-bk", "reweight-twopass"], {"widths": (5, 6)})
    df = clip.table(clip.bench_workload(w, CPU, 1, 1, 60.0, precision="tf32"), CPU).set_index("method")
    assert set(df.precision) == {"tf32"}
    assert df.note["reweight-twopass"].startswith("n/a: method=reweight cannot run with precision=tf32: ")
    assert df.step_ms["reweight-bk"] > 0 and not df.note["reweight-bk"]


def test_cli_quick_subset_writes_the_csv(tmp_path, capsys):
    df = clip.main(["--quick", "--device", "cpu", "--workloads", "fig6_b16", "--out", str(tmp_path)])
    assert list(df.method) == clip.FIG6 and list(df.batch) == [2] * len(clip.FIG6)
    saved = pd.read_csv(tmp_path / "clip_cpu_quick.csv")
    assert list(saved.columns) == [c for c in clip.COLUMNS if c not in clip.DEVICE_COLUMNS] and len(saved) == len(clip.FIG6)
    secure = df.set_index("method").loc[["reweight-bk-secure", "noise-secure"]]  # rng=secure's cost, measured
    assert (secure.step_ms > 0).all() and (secure.x_seeded > 0).all() and secure.note.eq("").all()
    out = capsys.readouterr().out
    assert "x_nonprivate" in out and "saved" in out


def test_methods_option_keeps_only_the_named_rows(tmp_path):
    df = clip.main(["--quick", "--device", "cpu", "--workloads", "fig6_b16", "--out", str(tmp_path),
                    "--methods", "reweight-bk,reweight-bk-secure"])
    assert list(df.method) == ["reweight-bk", "reweight-bk-secure"] and df.x_seeded.iloc[1] > 0
    with pytest.raises(SystemExit, match="unknown method row 'bk'"):
        clip.main(["--device", "cpu", "--methods", "bk"])


def test_a_row_on_request_is_timed_only_when_named(tmp_path):
    """reweight-bk-full (method.recorder=full) is no default row of any workload, and a row when --methods names it."""
    assert all("reweight-bk-full" not in w.methods for w in clip.workloads() + clip.gpu_workloads())
    df = clip.main(["--quick", "--device", "cpu", "--workloads", "fig6_b16", "--out", str(tmp_path),
                    "--methods", "reweight-bk,reweight-bk-full"])
    assert list(df.method) == ["reweight-bk", "reweight-bk-full"] and (df.step_ms > 0).all() and df.note.eq("").all()


def test_unknown_workload_names_the_valid_ones():
    with pytest.raises(DprunError, match="unknown workload 'cnn'.*cnn_mnist"):
        clip.main(["--workloads", "cnn", "--device", "cpu"])


def test_slow_contenders_are_timed_on_fewer_steps():
    import time

    times = interleaved_times({"fast": lambda: None, "slow": lambda: time.sleep(0.02)}, CPU, repeats=5, warmup=1,
                              budget_s=0.05)
    assert len(times["fast"]) == 5 and 1 <= len(times["slow"]) < 5


def test_without_a_budget_every_contender_gets_every_repeat():
    times = interleaved_times({"a": lambda: None, "b": lambda: None}, CPU, repeats=4, warmup=1)  # budget_s = inf
    assert [len(ts) for ts in times.values()] == [4, 4]


def test_the_faults_column_counts_the_timed_steps_own_faults():
    """bench-clip's faults_per_step comes from the very steps the medians time (it used to be 3 extra steps after the
    memory profiler's, which read 600-1,700 a step for steps that took none while timed). A step that maps and touches
    256 fresh pages must show them; one that does nothing must show ~none."""
    import mmap

    def touch():
        with mmap.mmap(-1, 256 * mmap.PAGESIZE) as m:
            for page in range(256):
                m[page * mmap.PAGESIZE] = 1

    faults: dict[str, list[int]] = {}
    times = interleaved_times({"touch": touch, "nothing": lambda: None}, CPU, repeats=4, warmup=1, faults=faults)
    assert [len(faults[k]) for k in times] == [4, 4]
    assert min(faults["touch"]) >= 256 and max(faults["nothing"]) < 16


def test_cpu_step_memory_counts_the_peak_not_the_end():
    def step():
        a = torch.empty(1_000_000, dtype=torch.uint8)  # 1 MB live ...
        b = torch.empty(3_000_000, dtype=torch.uint8)  # ... + 3 MB: the peak
        del a, b
        return torch.empty(500_000, dtype=torch.uint8)  # 0.5 MB survives the step

    peak = step_memory_bytes(step, CPU)
    assert 4_000_000 <= peak < 4_200_000


def test_the_compile_path_times_a_compiled_step(monkeypatch):
    """--compile default: the contender's step is a CompiledStep that compiled (it was n/a on every row when the
    bench built it with physical=None). torch.compile's backend is swapped for Dynamo's eager one: the bench's own
    path is what runs, without minutes of Inductor code generation on a CPU."""
    import runner.methods.compiled as compiled
    from runner.bench.common import contender, synthetic_batch

    real = torch.compile
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: real(fn, backend="eager", dynamic=False))
    base = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    x, y = synthetic_batch(TINY, 4, CPU)
    for name, options in (("nonprivate", {}), ("reweight", {"mode": "bk"})):
        made, note = contender(name, options, base, x, y, lambda ps: torch.optim.SGD(ps, lr=0.1), 0.04, 4.0,
                               compile_mode="default")
        assert made is not None and note == "", note
        made.step()


def test_the_gpt2_small_workloads_build_and_step():
    """--suite gpu's GPT-2-small-shaped stack (issue 31): 12 blocks of d 768 at T=128, B=32 and T=512, B=8; --quick's
    2 blocks of d 64 build through the workload's own builder and take a nonprivate and a reweight-bk step through
    the bench's contender code (the full 91M-parameter model is not built here)."""
    from runner.models import MODELS

    full = {w.name: w for w in clip.gpu_workloads()}
    for name, T, B in (("gpt2small_t128", 128, 32), ("gpt2small_t512", 512, 8)):
        w = full[name]
        assert (w.model, w.info.input_shape, w.batch, w.info.vocab_size, w.info.num_classes) == \
            ("transformer", (T,), B, 8192, 2)
        assert w.model_kwargs == {"layers": 12, "d_model": 768, "heads": 12, "ff": 3072, "dropout": 0.0}
    w = clip.gpt2_small(128, 32, quick=True)
    assert w.name == "gpt2small_t128" and w.info.input_shape == (16,) and w.batch == 4
    assert w in clip.gpu_workloads(quick=True)
    torch.manual_seed(0)
    base = MODELS.build(w.model, w.info, **w.model_kwargs)
    assert len(base.encoder) == 2
    x, y = synthetic_batch(w.info, w.batch, CPU)
    for label in ("nonprivate", "reweight-bk"):
        made, note = clip.method_contender(label, base, x, y, float(w.batch), w.info.train_size)
        assert made is not None and note == "", note
        made.step()


def test_the_cpu_memory_measurement_prints_no_profiler_lines(capfd):
    model = torch.nn.Linear(4, 2)
    held = [torch.randn(4096) for _ in range(4)]  # allocated before the profiler starts, freed while it runs

    def step():
        held.clear()  # the profiler's allocator warning ("Memory block of unknown size ...") without the mute
        model(torch.randn(3, 4)).sum().backward()

    step_memory_bytes(step, CPU)
    captured = capfd.readouterr()
    assert "USDT" not in captured.err + captured.out
    assert "Memory block of unknown size" not in captured.err + captured.out


def test_the_heap_is_retained_so_a_private_cpu_step_takes_no_page_faults():
    """runner/heap.py: with glibc's thresholds raised, the bk step's freed blocks serve the next step (the bench's
    faults_per_step column); without it the LSTM bk step took ~6,000 minor faults a step (here 885-4,149 per step
    over 15 measurements, none below 800). The best of 5 measurements: other faults come and go (CPython 3.11 maps
    and unmaps a 16 KiB frame chunk whenever a call crosses a chunk boundary, docs/bench.md stop 47; with retention
    the same step measured 0-900 a step, 0 in most measurements), so a single measurement was flaky under pytest -n."""
    import torch

    from runner.bench.common import MNIST, bench_device, contender, faults_per_step, synthetic_batch
    from runner.heap import retain_freed_memory
    from runner.models import MODELS

    assert retain_freed_memory() and bench_device("cpu").type == "cpu"
    torch.manual_seed(0)
    base = MODELS.build("lstm", MNIST)
    x, y = synthetic_batch(MNIST, 64, torch.device("cpu"))
    c, note = contender("reweight", {"mode": "bk"}, base, x, y, lambda ps: torch.optim.SGD(ps, lr=0.01), 0.01, 64.0)
    assert c is not None, note
    for _ in range(2):
        c.step()
    assert min(faults_per_step(c.step, steps=3) for _ in range(5)) < 100
