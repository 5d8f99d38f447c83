"""runner/bench/device_time.py: a step's host time and its kernels' device time, counted once each."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

from runner.bench import clip, compare
from runner.bench.common import interleaved_times
from runner.bench.device_time import device_activity_us, device_events, host_and_wall, kernel_ms, mallocs_per_step, shown_columns

CPU = torch.device("cpu")


def event(device_type, start_us, end_us, name):
    return SimpleNamespace(device_type=device_type, name=name,
                           time_range=SimpleNamespace(elapsed_us=lambda: end_us - start_us))


def test_device_activity_counts_each_device_event_once_and_no_host_operator():
    """A kernel is also attributed to the aten operator that launched it (a CPU event): only the device's own events
    are added, so the total is the device's busy time, not twice it; by name, a kernel's calls add up."""
    events = [event(DeviceType.CPU, 0, 500, "aten::mm"),       # on the host, its kernel inside
              event(DeviceType.CUDA, 10, 310, "sgemm"),         # the mm kernel: 300 us
              event(DeviceType.CPU, 500, 520, "cudaLaunchKernel"),
              event(DeviceType.CUDA, 320, 345, "memset")]       # 25 us
    assert device_activity_us(events) == 325.0
    assert device_activity_us([event(DeviceType.CPU, 0, 9, "aten::add")]) == 0.0
    events.append(event(DeviceType.CUDA, 400, 700, "sgemm"))  # the mm kernel again (a second step)
    assert device_events(events) == {"sgemm": (2, 600.0), "memset": (1, 25.0)}


def test_host_time_is_until_the_step_returned():
    host, wall = host_and_wall(lambda: time.sleep(0.02), CPU)
    assert 0.02 <= host <= wall < 1.0


def test_no_device_time_off_cuda():
    assert math.isnan(kernel_ms(lambda: torch.ones(3).sum(), CPU))


def test_interleaved_times_keep_each_timed_steps_host_seconds():
    host: dict = {}
    times = interleaved_times({"a": lambda: time.sleep(0.001), "b": lambda: None}, CPU, repeats=3, warmup=2, host=host)
    assert {k: len(v) for k, v in times.items()} == {k: len(v) for k, v in host.items()} == {"a": 3, "b": 3}
    assert all(h <= t for h, t in zip(host["a"], times["a"])) and min(host["a"]) >= 0.001


def test_the_split_is_shown_on_cuda_only():
    for columns, device_columns in ((clip.COLUMNS, clip.DEVICE_COLUMNS), (compare.COLUMNS, compare.DEVICE_COLUMNS)):
        assert set(device_columns) <= set(columns)
        assert shown_columns(columns, device_columns, torch.device("cuda")) == columns
        assert shown_columns(columns, device_columns, CPU) == [c for c in columns if c not in device_columns]


def test_a_failing_profiler_costs_the_column_not_the_table(monkeypatch, capsys):
    """kernel_ms on CUDA with a step that raises under the profiler: nan and one line, not an exception that would lose
    the bench's timings (the step itself already ran in the timed loop)."""
    def boom():
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr("torch.profiler.profile.__enter__", lambda self: self)
    monkeypatch.setattr("torch.profiler.profile.__exit__", lambda self, *exc: None)
    assert math.isnan(kernel_ms(boom, torch.device("cuda")))
    assert "gpu_ms is nan (RuntimeError: CUPTI unavailable)" in capsys.readouterr().out

    def no_stats(device=None):
        raise RuntimeError("no allocator stats")

    monkeypatch.setattr(torch.cuda, "memory_stats", no_stats)
    assert math.isnan(mallocs_per_step(lambda: None, torch.device("cuda")))
    assert "mallocs_per_step is nan (RuntimeError: no allocator stats)" in capsys.readouterr().out


def test_driver_calls_per_step_count_segments_retries_and_pinned_host_blocks(monkeypatch):
    """mallocs_per_step: the allocator's calls into the driver during the steps, per step, device and pinned host
    alike (the allocator's cached reuse, the steady state, is 0); nan off CUDA."""
    stats = {"segment.all.allocated": 10, "segment.all.freed": 4, "num_alloc_retries": 0, "allocated.all.allocated": 999}
    host = {"num_host_alloc": 2, "num_host_free": 1}

    def step():  # each step: one segment freed and one allocated (a cache that does not fit), one pinned block
        stats["segment.all.freed"] += 1
        stats["segment.all.allocated"] += 1
        stats["allocated.all.allocated"] += 50  # requests the cache served: not driver calls
        host["num_host_alloc"] += 1

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: dict(host), raising=False)
    assert mallocs_per_step(step, torch.device("cuda"), steps=4) == 3.0
    assert mallocs_per_step(lambda: None, torch.device("cuda")) == 0.0
    assert math.isnan(mallocs_per_step(step, CPU))
