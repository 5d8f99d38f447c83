"""A GPU step's wall time split into the host's part and the device's: is the step bound by its host?

    host_s, wall_s = host_and_wall(step, device)   # until step() returned; until its last kernel finished
    ms = kernel_ms(step, device)                    # device time of the kernels (and copies) one step runs; nan off CUDA
    n = mallocs_per_step(step, device)              # device and pinned-host allocator calls a step; nan off CUDA

Issue 26's conv nets read 1.10-1.28x the uncertified tree's step on an H200 (stop 43) while launching fewer kernels
and giving the GPU less work (stop 41's profile): the mark of a step whose GPU waits on the host's Python. These two
numbers, beside each timed step (bench-clip's `host_ms` and `gpu_ms` columns on CUDA, bench-compare's per tree),
say so in the same call as the timing: gpu_ms well below step_ms is a GPU left idle, and host_ms close to step_ms is
a host that never got ahead of it. host_ms includes any wait inside the step for the device (book-keeping's one read
of the certificate, runner/norms/certify.py), so a host-bound step and a device-bound one with a read near its end
can both show host_ms ~ step_ms; gpu_ms tells them apart.

A third number tells a GPU-only cost from both: mallocs_per_step counts the CUDA allocator's calls into the driver
(cudaMalloc / cudaFree of a segment, retries after a failed one, pinned host allocations): each synchronizes the
device or costs ~0.1-1 ms, so in steady state a step should make none; a step whose freed blocks do not fit the next
step's requests makes some every step, and one process can be unlucky where another is not (issue 26's ResNet-18 bk
step varied 31-45 ms from process to process on an H200).

Imports torch only: bench-compare's worker loads this file by its path (runner/bench/compare_worker.py), so both trees
are measured alike by this tree's code.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_and_wall(step: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(seconds until step() returned, seconds until the device finished it), from an idle device. On the CPU both are
    the step's time."""
    synchronize(device)
    start = time.perf_counter()
    step()
    returned = time.perf_counter()
    synchronize(device)
    return returned - start, time.perf_counter() - start


def device_activity_us(events: Iterable) -> float:
    """Total microseconds of the profiler's device-side events (kernels, memcpy, memset; each recorded once, on the
    device's own timeline): torch.autograd.profiler_util FunctionEvents whose device_type is not the CPU. The host's
    operators, which the kernels are also attributed to, are not counted again."""
    return float(sum(us for _, us in device_events(events).values()))


def device_events(events: Iterable) -> dict[str, tuple[int, float]]:
    """name -> (count, microseconds) of the profiler's device-side events (kernels, memcpy, memset), whichever host
    operator launched them: also the kernels a CUDA graph replays, which belong to no aten operator."""
    from torch.autograd import DeviceType

    out: dict[str, tuple[int, float]] = {}
    for e in events:
        if e.device_type != DeviceType.CPU:
            count, us = out.get(e.name, (0, 0.0))
            out[e.name] = (count + 1, us + e.time_range.elapsed_us())
    return out


def kernel_ms(step: Callable[[], object], device: torch.device, steps: int = 3) -> float:
    """Device milliseconds of one step's kernels (the mean over `steps` profiled steps); nan off CUDA, where no device
    timeline exists. The profiler slows the host, not the kernels."""
    if device.type != "cuda":
        return math.nan
    from torch.profiler import ProfilerActivity, profile

    def measure() -> float:
        synchronize(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            synchronize(device)
        return device_activity_us(prof.events()) / 1e3 / steps

    return diagnostic(measure, "gpu_ms")


def diagnostic(measure: Callable[[], float], column: str) -> float:
    """measure(), or nan and one line if it fails: a diagnostic column must not cost the table its timings (measured
    before it, on a device time that is scarce)."""
    try:
        return measure()
    except Exception as e:
        print(f"[device-time] {column} is nan ({type(e).__name__}: {str(e).strip()[:200]})", flush=True)
        return math.nan


# the allocator's counters that are calls into the CUDA driver (torch.cuda.memory_stats, host_memory_stats)
DEVICE_CALLS = ("segment.all.allocated", "segment.all.freed", "num_alloc_retries")
HOST_CALLS = ("num_host_alloc", "num_host_free")


def allocator_calls(device: torch.device) -> int:
    """The running total of the CUDA caching allocators' calls into the driver on `device` (and for pinned host
    memory, where this torch counts them)."""
    device_stats = torch.cuda.memory_stats(device)
    host_stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return sum(int(device_stats.get(k, 0)) for k in DEVICE_CALLS) + sum(int(host_stats.get(k, 0)) for k in HOST_CALLS)


def mallocs_per_step(step: Callable[[], object], device: torch.device, steps: int = 3) -> float:
    """Allocator calls into the CUDA driver per step over `steps` steps (steady state: 0); nan off CUDA."""
    if device.type != "cuda":
        return math.nan

    def measure() -> float:
        synchronize(device)
        before = allocator_calls(device)
        for _ in range(steps):
            step()
        synchronize(device)
        return (allocator_calls(device) - before) / steps

    return diagnostic(measure, "mallocs_per_step")


def shown_columns(columns: list[str], device_columns: list[str], device: torch.device) -> list[str]:
    """A bench table's columns: `device_columns` (the host / device split) only where a device runs the kernels."""
    return columns if device.type == "cuda" else [c for c in columns if c not in device_columns]
