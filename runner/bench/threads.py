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
from runner.bench.clip import method_contender
from runner.bench.common import interleaved_times, median, synthetic_batch
from runner.bench.side_by_side import side_by_side_main
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
    return side_by_side_main("threads", __doc__, argv, compare_threads, repeats=20, warmup=3)


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.threads"))
