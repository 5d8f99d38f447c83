"""The memory study (runner/memory_study.py) survives out-of-memory and finds the largest batch by bisection.

On a GPU, `make fig-lk_memory SCALE=paper` once stopped at the first OOM (non-private ResNet-101 at B=512) and
the 22 multiLoss and ReweightGP jobs after it wrote nothing. Here, on the CPU with a tiny MLP, an OOM is injected
(a monkeypatched training step that raises torch.OutOfMemoryError above K examples, an artificial memory cap, or
a probe process killed with SIGKILL as the kernel's OOM killer does) and the tests check that every method's
search still runs, that each probe wrote its own result, and that the bisection lands on K exactly.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from runner import memory_study as ms

# lk_memory preset, shrunk: digits-shaped synthetic data (1x8x8), the 2-layer MLP, one step per probe
TINY = ["device=cpu", "dataset.like=digits", "dataset.image_size=null", "model=mlp", "dataset.train_size=128",
        "max_steps_per_epoch=1", "warmup_steps=0", "memory_study.physical_batch_size=null"]


def fake_probe(limit, calls):
    def probe(b):
        calls.append(b)
        return ms.Probe("m", b, "ok" if b <= limit else "oom")
    return probe


@pytest.mark.parametrize("limit", [1, 5, 37, 64, 100])
def test_search_doubles_then_bisects_to_the_largest_batch(limit):
    calls = []
    found = ms.search(fake_probe(limit, calls), start=4, max_batch=128)
    if limit >= 128:
        assert found.largest_ok == 128 and found.first_oom is None
    else:
        assert (found.largest_ok, found.first_oom) == (limit, limit + 1)
    doubling, b = [], 4  # 4, 8, 16, ... up to the first that does not fit (or max_batch)
    while True:
        doubling.append(b)
        if b > limit or b >= 128:
            break
        b *= 2
    assert calls[:len(doubling)] == doubling
    assert len(calls) <= 6 + 7  # doubling, then log2 bisection steps


def test_search_max_batch_fits_and_error_stops_the_method():
    assert ms.search(fake_probe(10**6, []), 8, 100).largest_ok == 100
    calls = []

    def broken(b):
        calls.append(b)
        return ms.Probe("m", b, "ok" if b < 16 else "error", error="TypeError: a bug")
    found = ms.search(broken, 4, 128)
    assert found.stopped_by_error and found.largest_ok == 8 and calls == [4, 8, 16]


@pytest.fixture
def oom_above(monkeypatch):
    """Every method's training step raises torch.OutOfMemoryError when the batch has more than K examples."""
    from runner import assembly

    real_build = assembly.build_method  # the one assembly of a run's method (runner/assembly.py)

    def install(k):
        def build(request, world):
            method = real_build(request, world)
            step = method.step

            def step_or_oom(model, loss_fn, x, y, *args, **kwargs):
                if len(y) > k:
                    raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(y)} GiB (injected)")
                return step(model, loss_fn, x, y, *args, **kwargs)
            method.step = step_or_oom
            return method
        monkeypatch.setattr(assembly, "build_method", build)
    return install


def test_sweep_continues_after_an_oom_and_finds_the_largest_batch(tmp_path, oom_above):
    K = 11  # probes 8, 16 (oom), then bisection 12 (oom), 10, 11
    oom_above(K)
    out = ms.run_study("smoke", TINY + ["memory_study.start=8"], ["nonprivate", "reweight"], "inprocess", tmp_path,
                       stamp="s", log=lambda s: None)
    for method in ("nonprivate", "reweight"):
        res = out["methods"][method]
        assert (res["largest_ok"], res["first_oom"]) == (K, K + 1), res
        statuses = {p["batch_size"]: p["status"] for p in res["probes"]}
        assert statuses[16] == "oom" and statuses[K] == "ok" and statuses[K + 1] == "oom"
        for p in res["probes"]:  # each probe wrote its own result, and the run folder says what happened
            probe = json.loads((Path(p["run_dir"]) / "probe.json").read_text())
            summary = json.loads((Path(p["run_dir"]) / "summary.json").read_text())
            assert probe["status"] == p["status"]
            assert summary["status"] == ("finished" if p["status"] == "ok" else "failed")
            if p["status"] == "oom":
                assert "OutOfMemoryError" in probe["error"]
    # the sweep went on after nonprivate's OOMs: reweight was probed, and its probes came after them
    assert [p["batch_size"] for p in out["methods"]["reweight"]["probes"]] == [8, 16, 12, 10, 11]
    assert json.loads((tmp_path / "s" / "study.json").read_text())["methods"]["reweight"]["largest_ok"] == K

    # the figure reads these probes through dprun-report: all methods, the largest batch that fit, the first OOM
    from runner.figures.lee_kifer import memory_table
    from runner.plots import select_runs
    from runner.report import collect

    runs = select_runs(collect(tmp_path), "lk_memory", "smoke", keep_failed=True)
    table = memory_table(runs, None, "smoke").set_index("label")
    assert set(table.index) == {"Non-private", "ReweightGP"}
    assert (table["largest batch trained"] == K).all() and (table["first batch that failed"] == K + 1).all()


def test_memory_cap_is_an_out_of_memory(tmp_path, monkeypatch):
    # the measured peak, made deterministic: 1000 bytes per example
    monkeypatch.setattr(ms, "measured_peak",
                        lambda device, summary: None if summary is None else 1000 * summary["config"]["batch_size"])
    cap = ["memory_study.memory_cap_bytes=20500", "memory_study.start=16"]  # probes 16, 32 (oom), 24, 20, 22, 21
    out = ms.run_study("smoke", TINY + cap, ["nonprivate"], "inprocess", tmp_path, stamp="cap", log=lambda s: None)
    res = out["methods"]["nonprivate"]
    assert (res["largest_ok"], res["first_oom"]) == (20, 21)
    over = next(p for p in res["probes"] if p["batch_size"] == 21)
    assert over["status"] == "oom" and "memory cap" in over["error"] and over["memory_cap_bytes"] == 20500


FAKE_CHILD = r"""
import json, os, signal, sys
run_dir, overrides = sys.argv[1], sys.argv[2:]
b = int(next(o for o in overrides if o.startswith("batch_size=")).split("=")[1])
if b > 20:
    os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does: no exception, no probe.json
os.makedirs(run_dir, exist_ok=True)
json.dump({"method": "x", "batch_size": b, "status": "ok", "run_dir": run_dir}, open(run_dir + "/probe.json", "w"))
"""


def test_a_probe_killed_by_the_os_ends_only_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(ms, "child_command",
                        lambda run_dir, overrides: [sys.executable, "-c", FAKE_CHILD, str(run_dir), *overrides])
    out = ms.run_study("smoke", TINY, ["nonprivate", "multiloss"], "subprocess", tmp_path, stamp="k",
                       log=lambda s: None)
    for method in ("nonprivate", "multiloss"):
        res = out["methods"][method]
        assert (res["largest_ok"], res["first_oom"]) == (20, 21)
        killed = [p for p in res["probes"] if p["status"] == "oom"]
        assert killed and all("signal 9" in p["error"] for p in killed)
        assert all((Path(p["run_dir"]) / "probe.json").exists() for p in res["probes"])


@pytest.mark.slow
def test_real_probe_process_out_of_memory(tmp_path):
    """One real probe in its own process with a 1-byte cap: recorded as out of memory, summary.json failed."""
    run_dir = tmp_path / "p"
    overrides = ms.probe_overrides("smoke", "nonprivate", 8, TINY + ["memory_study.memory_cap_bytes=1"])
    p = ms.probe_subprocess(overrides, run_dir, "nonprivate", 8)
    assert p.status == "oom" and "memory cap" in p.error
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"



def test_at_a_fixed_physical_batch_the_largest_logical_batch_is_the_data_set(tmp_path, monkeypatch):
    """Issue 20's column: a chunk of more than K examples runs out of memory (injected in privatize, which sees one
    chunk); in one pass the largest batch is K, with physical_batch_size=8 every logical batch up to the training
    set (128) trains, and the figure shows both."""
    from runner.methods.base import Method

    K = 11
    real_step = Method.clipped_sum

    def chunked_or_oom(self, model, loss_fn, x, y, privatize=None):
        inner = privatize or self.privatize

        def checked(m, lf, xc, yc):
            if len(yc) > K:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(yc)} GiB (injected)")
            return inner(m, lf, xc, yc)
        return real_step(self, model, loss_fn, x, y, checked)

    monkeypatch.setattr(Method, "clipped_sum", chunked_or_oom)
    over = [o for o in TINY if not o.startswith("memory_study.physical_batch_size")]
    out = ms.run_study("smoke", over + ["memory_study.start=8", "memory_study.physical_batch_size=8"], ["reweight"],
                       "inprocess", tmp_path, stamp="p", log=lambda s: None)
    res = out["methods"]["reweight"]
    assert (res["largest_ok"], res["first_oom"]) == (K, K + 1)
    assert res["logical"]["physical_batch_size"] == 8
    assert (res["logical"]["largest_ok"], res["logical"]["first_oom"]) == (128, None)  # the whole training set
    assert [p["batch_size"] for p in res["logical"]["probes"]] == [8, 16, 32, 64, 128]

    from runner.figures.lee_kifer import memory_table
    from runner.plots import select_runs
    from runner.report import collect

    table = memory_table(select_runs(collect(tmp_path), "lk_memory", "smoke", keep_failed=True), None, "smoke")
    row = table.set_index("label").loc["ReweightGP"]
    assert row["largest batch trained"] == K and row["largest logical batch at P"] == 128
    assert row["physical batch P"] == 8
