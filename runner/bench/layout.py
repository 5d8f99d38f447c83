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
from runner.bench.clip import method_contender
from runner.bench.side_by_side import side_by_side_main, timed_each_way
from runner.errors import DprunError
from runner.methods import METHODS

LAYOUTS = ("contiguous", "channels_last")


def compare_layouts(w, labels: list[str], device: torch.device, repeats: int, warmup: int, budget_s: float,
                    precision: str) -> list[dict]:
    """One row per method: its median step in each layout, the ratio, and what auto picks for this model."""
    def contenders(label, model, x, y):
        steps, note = {}, ""
        for fmt in LAYOUTS:
            try:
                c, why = method_contender(label, model, x, y, float(w.batch), w.info.train_size, "", precision, fmt)
            except DprunError as e:  # e.g. channels_last for a method that needs NCHW: its row says so
                c, why = None, str(e)
            if c is None:
                note = why
            else:
                steps[fmt] = c.step
        return steps, note

    ms, notes, model = timed_each_way(w, labels, device, repeats, warmup, budget_s, LAYOUTS, contenders)
    auto = memory_format.choose(model, "auto", METHODS.build("reweight"))
    return [dict(workload=w.name, model=w.model, batch=w.batch, method=label, precision=precision,
                 nchw_ms=t["contiguous"], channels_last_ms=t["channels_last"],
                 cl_over_nchw=t["channels_last"] / t["contiguous"] if t["contiguous"] > 0 else math.nan,
                 auto="channels_last" if auto == torch.channels_last else "as built", note=notes.get(label, ""))
            for label, t in ms.items()]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return side_by_side_main("layout", __doc__, argv, compare_layouts, repeats=10, warmup=2)


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.layout"))
