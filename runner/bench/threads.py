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
from runner.bench.side_by_side import side_by_side_main, timed_each_way

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
    def contenders(label, model, x, y):
        c, note = method_contender(label, model, x, y, float(w.batch), w.info.train_size, "", precision)
        return ({} if c is None else {where: in_thread(c.step, flag) for where, flag in WHERE.items()}), note

    ms, notes, _ = timed_each_way(w, labels, device, repeats, warmup, budget_s, tuple(WHERE), contenders)
    return [dict(workload=w.name, model=w.model, batch=w.batch, method=label, precision=precision,
                 worker_ms=t["worker"], caller_ms=t["caller"],
                 caller_over_worker=t["caller"] / t["worker"] if t["worker"] > 0 else math.nan,
                 note=notes.get(label, ""))
            for label, t in ms.items()]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return side_by_side_main("threads", __doc__, argv, compare_threads, repeats=20, warmup=3)


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.threads"))
