"""The privacy validator's cost (runner/methods/privacy_check/): once per run, against one training step, on the bench
workloads of runner/bench/clip.py.

    python -m runner.bench.privacy_check            # the three workloads at their batch sizes, CPU or CUDA
    python -m runner.bench.privacy_check --quick    # B/8: the same code paths

Per workload and method: check_ms (check_first_step alone, the median of `--repeats` runs), step_ms (one private
step without the check, median), and their ratio: what the first step pays once; every later step pays nothing.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

from runner.bench.clip import METHOD_VARIANTS, workloads
from runner.bench.common import loss_fn, synthetic_batch
from runner.errors import DprunError
from runner.methods import METHODS
from runner.metrics import device_name, synchronize
from runner.models import MODELS
from runner.methods.privacy_check import check_first_step

METHODS_TIMED = ["reweight-bk", "reweight-twopass", "opacus-hooks", "multiloss", "jl-4"]
VARIANTS = {**METHOD_VARIANTS, "jl-4": ("jl", {"r": 4})}  # jl: its estimates and release against each example alone


def timed(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def row(w, label: str, device, repeats: int) -> dict:
    name, options = VARIANTS[label]
    torch.manual_seed(0)
    base = MODELS.build(w.model, w.info, **w.model_kwargs).to(device)
    x, y = synthetic_batch(w.info, w.batch, device)
    method = METHODS.build(name, cfg=options, clip=1.0, sigma=1.0)
    method.privacy_check = False  # the step timed alone; the check timed by itself below
    model = method.attach(copy.deepcopy(base))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = lambda: method.step(model, loss_fn, x, y, opt, sample_rate=0.01, expected_batch_size=float(w.batch))  # noqa: E731

    def check():
        method._privacy_checked = None
        check_first_step(method, model, loss_fn, x, y)

    step()  # warm-up
    check()
    step_ms, check_ms = timed(step, device, repeats), timed(check, device, repeats)
    return {"workload": w.name, "batch": w.batch, "method": label, "step_ms": round(step_ms, 1),
            "check_ms": round(check_ms, 1), "check_over_step": round(check_ms / step_ms, 2)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    print(f"[bench-privacy-check] {device_name(device)}, torch {torch.__version__}, {args.repeats} repeats, median")
    rows = []
    for w in workloads(args.quick)[:3]:  # cnn_mnist, lstm_mnist, transformer_imdb
        for label in METHODS_TIMED:
            try:
                rows.append(row(w, label, device, args.repeats))
            except DprunError as e:
                rows.append({"workload": w.name, "batch": w.batch, "method": label, "note": f"n/a: {e}"})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    try:
        main()
    except DprunError as e:
        sys.exit(f"dprun: {e}")
