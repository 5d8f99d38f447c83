"""Whether channels-last pays: each workload's rows in NCHW and in channels-last, interleaved in one process, and the
layout memory_format=auto picks for its model (runner/memory_format.py).

    python -m runner.bench.layout --device cpu --suite gpu --quick --workloads vgg11_cifar10,resnet18_cifar10
    python -m runner.bench.layout --device cuda --suite gpu --precision tf32 --workloads cnn_mnist,resnet18_cifar10

The same model (seed 0), batch and method in both layouts, their steps taken in turn, so the machine's load falls
on both alike: the column to read is cl_over_nchw (median step time in channels-last / in NCHW; < 1: channels-last
is faster). A method that needs NCHW (the Opacus peer) is a row with its note. Output: layout_<device>.csv.
"""
from __future__ import annotations

import math

import pandas as pd
import torch

from runner import memory_format
from runner.bench.clip import ALL, add_suite_argument, method_contender, suite_workloads, workload_names
from runner.bench.common import (arguments, bench_device, interleaved_times, median, save_frames, select_workloads,
                                 synthetic_batch, timed_repeats)
from runner.errors import DprunError
from runner.methods import METHODS
from runner.models import MODELS

LAYOUTS = ("contiguous", "channels_last")


def compare_layouts(w, labels: list[str], device: torch.device, repeats: int, warmup: int, budget_s: float,
                    precision: str) -> list[dict]:
    """One row per method: its median step in each layout, the ratio, and what auto picks for this model."""
    torch.manual_seed(0)
    base = MODELS.build(w.model, w.info, **w.model_kwargs).to(device)
    x, y = synthetic_batch(w.info, w.batch, device)
    auto = memory_format.choose(base, "auto", METHODS.build("reweight"))
    steps, notes = {}, {}
    for label in labels:
        for fmt in LAYOUTS:
            try:
                c, note = method_contender(label, base, x, y, float(w.batch), w.info.train_size, "", precision, fmt)
            except DprunError as e:  # e.g. channels_last for a method that needs NCHW: its row says so
                c, note = None, str(e)
            if c is None:
                notes[label] = note
                continue
            steps[(label, fmt)] = c.step
    times = interleaved_times(steps, device, repeats, warmup, budget_s)
    rows = []
    for label in labels:
        ms = {fmt: 1e3 * median(times.get((label, fmt), [])) for fmt in LAYOUTS}
        rows.append(dict(workload=w.name, model=w.model, batch=w.batch, method=label, precision=precision,
                         nchw_ms=ms["contiguous"], channels_last_ms=ms["channels_last"],
                         cl_over_nchw=ms["channels_last"] / ms["contiguous"] if ms["contiguous"] > 0 else math.nan,
                         auto="channels_last" if auto == torch.channels_last else "as built",
                         note=notes.get(label, "")))
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = arguments("python -m runner.bench.layout", __doc__, repeats=10, warmup=2, budget=60.0,
                   quick="batches / 8: a smoke run", workloads=workload_names(), out="layout_<device>.csv")
    add_suite_argument(ap)
    ap.add_argument("--methods", default="nonprivate,reweight-bk", help="comma-separated rows of bench-clip: "
                    + ", ".join(ALL))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "tf32"])
    args = ap.parse_args(argv)
    labels = args.methods.split(",")
    unknown = [m for m in labels if m not in ALL or m.endswith("+compile")]
    if unknown:
        raise DprunError(f"--methods: unknown row {unknown[0]!r}; choose from {', '.join(ALL)}")
    device = bench_device(args.device)
    chosen = select_workloads(suite_workloads(args.suite, args.quick), args.workloads, "bench-layout")
    rows = []
    for w in chosen:
        print(f"[bench-layout] {w.name}: model={w.model} B={w.batch} ...", flush=True)
        rows += compare_layouts(w, labels, device, timed_repeats(args), args.warmup, args.budget, args.precision)
    df = pd.DataFrame(rows)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return save_frames([df], args.out, "layout", device, args.quick, "bench-layout")


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.layout"))
