"""Side-by-side timing and memory of training steps, for every benchmark in runner/bench/.

    contenders = {"nonprivate": step_a, "nxbp": step_b}          # name -> zero-argument callable (one step)
    times = interleaved_times(contenders, device, repeats=10, warmup=2)   # name -> [seconds, ...]
    peak = step_memory_bytes(step_a, device, before=lambda: opt.zero_grad(set_to_none=True))  # bytes: see below
    x, y = synthetic_batch(info, 256, device)                    # inputs of a dataset's shape
    c, note = contender("jl", {"r": 4}, base, x, y, lambda ps: torch.optim.SGD(ps, lr=0.1), q, 256.0)

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

import argparse
import contextlib
import copy
import math
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from runner import memory_format as layout
from runner.bench.device_time import host_and_wall
from runner.heap import minor_page_faults, retain_freed_memory
import torch.nn.functional as F

from runner.data.base import DataInfo
from runner.data.synthetic import like_info
from runner.entry import OneLineParser
from runner.errors import DprunError
from runner.methods import METHODS
from runner.metrics import synchronize
from runner.randomness import SecureRandom

# Kineto (torch.profiler, the CPU memory measurement) prints "USDT: ... profiler_start/stop" at every profiled step;
# level 6 is above all of its levels (read when a profile starts)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


# the datasets' shapes the benchmarks draw synthetic inputs of (the timings do not depend on the values), from
# dataset=synthetic's table of them
MNIST, CIFAR10, IMDB = like_info("mnist"), like_info("cifar10"), like_info("imdb")


@dataclass
class Workload:
    """One benchmark workload: a model on a dataset's shapes at a batch size (each bench adds its own fields)."""

    name: str
    model: str
    info: DataInfo
    batch: int


def loss_fn(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, y, reduction="none")  # (B,)


def synthetic_batch(info: DataInfo, batch: int, device: torch.device, seed: int = 0):
    """Inputs of the dataset's shape: standard-normal images, or token ids with zero padding after a random length."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, info.num_classes, (batch,), generator=g)
    if info.kind == "text":
        T = info.input_shape[0]
        x = torch.randint(1, info.vocab_size, (batch, T), generator=g)  # (B, T)
        lengths = torch.randint(T // 3, T + 1, (batch, 1), generator=g)
        x = x.masked_fill(torch.arange(T) >= lengths, 0)
    else:
        x = torch.randn(batch, *info.input_shape, generator=g)
    return x.to(device), y.to(device)


class Contender(NamedTuple):
    step: Callable[[], object]  # one Method.step on the method's own copy of the model
    zero_grad: Callable[[], object]  # frees the last step's gradients (the memory measurement's baseline)
    layout: str = "contiguous"  # the conv weights' memory format the step ran with (runner/memory_format.py)


def contender(name: str, options: dict, base: torch.nn.Module, x, y, make_optimizer, sample_rate: float,
              expected_batch_size: float, compile_mode: str = "", configure: dict | None = None,
              rng: str = "seeded", memory_format: str = "auto") -> tuple[Contender | None, str]:
    """One method's Contender on its own copy of the model (Method.attach: validated and prepared, as in a run),
    or None and a note why there is none (the method rejects the model: "n/a: ..."; a bug: "error: ...").
    compile_mode: step through runner/methods/compiled.py (its first steps compile: they are the warm-up).
    configure: Method.configure's settings (physical_batch_size, precision).
    rng: "seeded" (noise from a torch.Generator) | "secure" (runner/randomness.py's SecureRandom, as rng=secure).
    memory_format: as a run's (runner/memory_format.py: auto puts the CPU CNNs measured faster so in channels-last,
    unless the method needs NCHW)."""
    try:
        method = METHODS.build(name, cfg=options, clip=1.0, sigma=1.0).configure(**(configure or {}))
        model = copy.deepcopy(base)
        chosen = layout.apply(model, memory_format, method)  # what assemble() does for a run
        model = method.attach(model)
        opt = make_optimizer(model.parameters())
        gen = SecureRandom() if rng == "secure" else torch.Generator(device=x.device).manual_seed(0)
        method_step = method.step
        if compile_mode:
            from runner.methods.compiled import CompiledStep

            # the bench's batch has a fixed size: each chunk padded to it (or to physical_batch_size), one graph
            physical = (configure or {}).get("physical_batch_size") or len(y)
            method_step = CompiledStep(method, compile_mode, x.device, physical=int(physical))
        step = lambda: method_step(model, loss_fn, x, y, opt, sample_rate=sample_rate,  # noqa: E731
                                   expected_batch_size=expected_batch_size, generator=gen)
        if rng == "secure":  # the next step's noise, drawn ahead, is waited for: interleaved with the other
            plain = step     # contenders, it would otherwise be drawn during their timed steps
            step = lambda: (plain(), gen.drain())  # noqa: E731
        step()  # fails here, not in the timing loop, if the method rejects the model
        if compile_mode:
            step()  # the compiled step's first step is eager; this one compiles
            if method_step.compiled is None:
                return None, f"n/a: compile={compile_mode} fell back to eager (see the log line)"
            if method_step.cudagraph_skips:  # compiled, but not captured: its launches stay (the reason, for the row)
                return (Contender(step, lambda: opt.zero_grad(set_to_none=True), chosen),
                        "no CUDA graph: " + "; ".join(method_step.cudagraph_skips))
        return Contender(step, lambda: opt.zero_grad(set_to_none=True), chosen), ""
    except DprunError as e:
        return None, f"n/a: {e}"
    except Exception as e:  # a bug in a method being written: a row that says so, the other rows still run
        return None, f"error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def timed(step: Callable[[], object], device: torch.device) -> float:
    """Seconds of one step, from an idle device until it finished the step."""
    return host_and_wall(step, device)[1]


def interleaved_times(contenders: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                      warmup: int = 2, budget_s: float = math.inf,
                      host: dict[str, list[float]] | None = None,
                      faults: dict[str, list[int]] | None = None) -> dict[str, list[float]]:
    """name -> the timed steps' seconds. Warm-up steps first (all contenders alike), then interleaved repeats. `host`,
    if given, gets name -> each timed step's seconds until step() returned (runner/bench/device_time.py); `faults`
    name -> each timed step's minor page faults (the faults inside the very steps the medians time)."""
    first: dict[str, float] = {}
    for name, step in contenders.items():
        for _ in range(max(1, warmup)):
            first[name] = timed(step, device)  # the last warm-up step estimates the step's cost
    quota = {name: max(1, int(min(repeats, budget_s / max(t, 1e-9)))) for name, t in first.items()}  # inf: repeats
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(repeats):
        for name, step in contenders.items():
            if r < quota[name]:
                faults_before = minor_page_faults()
                returned, finished = host_and_wall(step, device)
                times[name].append(finished)
                if faults is not None:
                    faults.setdefault(name, []).append(minor_page_faults() - faults_before)
                if host is not None:
                    host.setdefault(name, []).append(returned)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def timing_columns(label: str, times: dict[str, list[float]], repeats: int) -> dict:
    """A contender's row: median step_ms, steps_timed, x_nonprivate, and a note when slow steps were cut short."""
    t = {k: median(ts) for k, ts in times.items()}
    fewer = len(times[label]) < repeats
    return dict(step_ms=1e3 * t[label], steps_timed=len(times[label]),
                x_nonprivate=t[label] / t["nonprivate"] if "nonprivate" in t else math.nan,
                note=f"estimated from {len(times[label])} of {repeats} steps (slow)" if fewer else "")


@contextlib.contextmanager
def quiet_stderr():
    """The process's stderr (fd 2) muted: the CPU profiler's C++ allocator warning ("Memory block of unknown size was
    allocated before the profiling started", printed once per block freed while profiling) is noise in a bench table."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


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

    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):  # +bytes on allocation, -bytes on free
        live += e.nbytes()
        peak = max(peak, live)
    return int(peak)


def arguments(prog: str, doc: str, *, repeats: int, warmup: int, budget: float, quick: str, workloads: list[str],
              out: str) -> argparse.ArgumentParser:
    """The options every bench takes (each adds its own after these)."""
    ap = OneLineParser(prog=prog, description=doc.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--repeats", type=int, default=None, help=f"timed steps per contender (median reported; default "
                    f"{repeats}, with --quick 2)")
    ap.add_argument("--warmup", type=int, default=warmup, help="untimed steps per contender first")
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--workloads", default="", help="comma-separated subset of: " + ", ".join(workloads))
    ap.add_argument("--budget", type=float, default=budget, help="seconds of timed steps per contender; slower "
                    "contenders (nxbp) are timed on fewer steps")
    ap.add_argument("--out", default="outputs/bench", help=f"folder for {out}")
    ap.set_defaults(default_repeats=repeats)
    return ap


def timed_repeats(args) -> int:
    """--repeats as given; else 2 with --quick (a smoke run), else the bench's default. Small batches with many
    steps (--quick --repeats 300) time a step bound by the host's dispatch, as a small model's GPU step is."""
    if args.repeats is not None:
        return args.repeats
    return 2 if args.quick else args.default_repeats


def bench_device(name: str) -> torch.device:
    """--device auto: this machine's best device."""
    from runner.train import resolve_device

    device = resolve_device(name)  # cuda without CUDA, or a name that is no device: one line
    if device.type == "cpu":
        retain_freed_memory()  # freed blocks reused, not re-faulted: the ratios mean compute (runner/heap.py)
    return device


def faults_per_step(step: Callable[[], object], steps: int = 3) -> float:
    """Minor page faults per step over `steps` steps (after the timing's warm-up): ~0 once the heap is retained."""
    before = minor_page_faults()
    for _ in range(steps):
        step()
    return (minor_page_faults() - before) / steps


def select_workloads(available: list, wanted_csv: str | None, tool: str) -> list:
    """The workloads named in `--workloads a,b` (all when empty); an unknown name exits with one line."""
    if not wanted_csv:
        return available
    wanted = wanted_csv.split(",")
    names = [w.name for w in available]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise DprunError(f"unknown workload {unknown[0]!r}; valid: {', '.join(names)}")
    return [w for w in available if w.name in wanted]


def save_frames(frames: list, out_dir: str, stem: str, device: torch.device, quick: bool, tool: str):
    """The tables of a bench tool's contenders as one CSV, <out_dir>/<stem>_<device>[_quick].csv; the joined table."""
    import pandas as pd

    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}_{device.type}{'_quick' if quick else ''}.csv")
    out.to_csv(path, index=False)
    print(f"[{tool}] saved {path}")
    return out
