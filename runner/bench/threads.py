"""Where the step's backward runs: autograd's CUDA device thread or the calling thread (runner/backward_thread.py),
each method's step both ways, interleaved in one process.

    python -m runner.bench.threads --device cuda --suite gpu --precision tf32 --workloads cnn_mnist,resnet18_cifar10
    python -m runner.bench.threads --device cpu --quick        # the CPU runs its backward in the caller either way

The same contender (model, batch, method) stepped in turn with runner.backward_thread.IN_CALLING_THREAD on and off,
so the machine's load falls on both alike: the column to read is caller_over_worker (median step time with the
backward in the calling thread / on autograd's device thread; < 1: the calling thread is faster, as dprun now
runs an eager CUDA step). On the CPU the two are the same step (a measure of the noise). Output: threads_<device>.csv.
"""
from __future__ import annotations

import math

import pandas as pd
import torch

from runner import backward_thread
from runner.bench.clip import ALL, add_suite_argument, method_contender, suite_workloads, workload_names
from runner.bench.common import (arguments, bench_device, interleaved_times, median, save_frames, select_workloads,
                                 synthetic_batch, timed_repeats)
from runner.errors import DprunError
from runner.models import MODELS

WHERE = {"worker": False, "caller": True}  # column -> backward_thread.IN_CALLING_THREAD


def in_thread(step, in_calling_thread: bool):
    """step() with the backward's thread set as asked, and the setting put back after."""
    def run():
        before = backward_thread.IN_CALLING_THREAD
        backward_thread.IN_CALLING_THREAD = in_calling_thread
        try:
            return step()
        finally:
            backward_thread.IN_CALLING_THREAD = before
    return run


def compare_threads(w, labels: list[str], device: torch.device, repeats: int, warmup: int, budget_s: float,
                    precision: str) -> list[dict]:
    """One row per method: its median step with the backward on each thread, and the ratio."""
    torch.manual_seed(0)
    base = MODELS.build(w.model, w.info, **w.model_kwargs).to(device)
    x, y = synthetic_batch(w.info, w.batch, device)
    steps, notes = {}, {}
    for label in labels:
        c, note = method_contender(label, base, x, y, float(w.batch), w.info.train_size, "", precision)
        if c is None:
            notes[label] = note
            continue
        for where, flag in WHERE.items():
            steps[(label, where)] = in_thread(c.step, flag)
    times = interleaved_times(steps, device, repeats, warmup, budget_s)
    rows = []
    for label in labels:
        ms = {where: 1e3 * median(times.get((label, where), [])) for where in WHERE}
        rows.append(dict(workload=w.name, model=w.model, batch=w.batch, method=label, precision=precision,
                         worker_ms=ms["worker"], caller_ms=ms["caller"],
                         caller_over_worker=ms["caller"] / ms["worker"] if ms["worker"] > 0 else math.nan,
                         note=notes.get(label, "")))
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = arguments("python -m runner.bench.threads", __doc__, repeats=20, warmup=3, budget=60.0,
                   quick="batches / 8: a smoke run", workloads=workload_names(), out="threads_<device>.csv")
    add_suite_argument(ap)
    ap.add_argument("--methods", default="nonprivate,reweight-bk", help="comma-separated eager rows of bench-clip: "
                    + ", ".join(m for m in ALL if not m.endswith("+compile")))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "tf32"])
    args = ap.parse_args(argv)
    labels = args.methods.split(",")
    unknown = [m for m in labels if m not in ALL or m.endswith("+compile")]
    if unknown:
        raise DprunError(f"--methods: unknown or compiled row {unknown[0]!r}; choose from "
                         f"{', '.join(m for m in ALL if not m.endswith('+compile'))}")
    device = bench_device(args.device)
    chosen = select_workloads(suite_workloads(args.suite, args.quick), args.workloads, "bench-threads")
    rows = []
    for w in chosen:
        print(f"[bench-threads] {w.name}: model={w.model} B={w.batch} ...", flush=True)
        rows += compare_threads(w, labels, device, timed_repeats(args), args.warmup, args.budget, args.precision)
    df = pd.DataFrame(rows)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return save_frames([df], args.out, "threads", device, args.quick, "bench-threads")


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.threads"))
