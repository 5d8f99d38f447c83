"""Side-by-side timing and memory of training steps, for every benchmark in runner/bench/.

    contenders = {"nonprivate": step_a, "nxbp": step_b}          # name -> zero-argument callable (one step)
    times = interleaved_times(contenders, device, repeats=10, warmup=2)   # name -> [seconds, ...]
    peak = step_memory_bytes(step_a, device, before=lambda: opt.zero_grad(set_to_none=True))  # bytes: see below

Timing: every contender gets the same warm-up steps, then the repeats are interleaved (a, b, c, a, b, c, ...), so
a slow patch of the machine (another process, thermal throttling) hits every contender alike; report the median.
CUDA is synchronised around every step. A contender whose steps are slow (warm-up step x repeats over
`budget_s`) is timed on fewer steps; the caller marks those rows.

Memory, one extra step per contender, the same definition on both devices: the peak bytes of tensors allocated
during the step above what was live when it started (parameters, data and optimizer state are the baseline).
CUDA: torch.cuda.max_memory_allocated after a reset, minus memory_allocated at the start. CPU: the process's RSS
cannot be reset or split per method, so the step runs under torch.profiler(profile_memory=True) and the peak is
the running sum of its allocation/free records (the CPU allocator's view, like CUDA's, not the OS's).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch

from runner.metrics import synchronize


def timed(step: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - start


def interleaved_times(contenders: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                      warmup: int = 2, budget_s: float = math.inf) -> dict[str, list[float]]:
    """name -> the timed steps' seconds. Warm-up steps first (all contenders alike), then interleaved repeats."""
    first: dict[str, float] = {}
    for name, step in contenders.items():
        for _ in range(max(1, warmup)):
            first[name] = timed(step, device)  # the last warm-up step estimates the step's cost
    quota = {name: max(1, min(repeats, int(budget_s / max(t, 1e-9)))) for name, t in first.items()}
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(repeats):
        for name, step in contenders.items():
            if r < quota[name]:
                times[name].append(timed(step, device))
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def step_memory_bytes(step: Callable[[], object], device: torch.device,
                      before: Callable[[], object] | None = None) -> int:
    """Peak bytes allocated during one step above the bytes live at its start (see the module docstring).

    `before` runs first, outside the measurement: e.g. zero_grad(set_to_none=True), so the previous step's
    gradients are freed before the baseline on both devices (the CPU profiler cannot size frees of blocks
    allocated before it started)."""
    if before is not None:
        before()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        step()
        synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - start)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):  # +bytes on allocation, -bytes on free
        live += e.nbytes()
        peak = max(peak, live)
    return int(peak)


def select_workloads(available: list, wanted_csv: str | None, tool: str) -> list:
    """The workloads named in `--workloads a,b` (all when empty); an unknown name exits with one line."""
    if not wanted_csv:
        return available
    wanted = wanted_csv.split(",")
    names = [w.name for w in available]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise SystemExit(f"{tool}: unknown workload {unknown[0]!r}; valid: {', '.join(names)}")
    return [w for w in available if w.name in wanted]
