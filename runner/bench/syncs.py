"""Where a step waits for the GPU: every synchronizing CUDA call of one step, with the Python stack and thread it came
from (torch.cuda.set_sync_debug_mode("warn")).

    python -m runner.bench.syncs --device cuda --suite gpu --precision tf32 --workloads cnn_mnist,resnet18_cifar10

An eager private step reads one value by design (runner/norms/certify.py every_record_kept: on CUDA a wait for an
event recorded before the clipped sums, which torch's debug mode would not see, so it warns itself); any other read stalls the
host until the device has drained its queue, and a host-bound step pays for it. Stop 41's H100 found that read in
every bk step and one more in ResNet-18's with no dprun frame on its Python stack: this tool names each one's
thread and innermost frames (dprun's or torch's), so that the next look is one command. Each contender is warmed
up, then `--repeats` steps run under the warn mode (their syncs counted per step). On the CPU there is no device to
wait for: the rows say so. Output: syncs_<device>.csv.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import traceback
import warnings

import pandas as pd
import torch

from runner.bench.clip import method_contender
from runner.bench.common import synthetic_batch
from runner.bench.side_by_side import side_by_side_main
from runner.models import MODELS

FRAMES = 3  # innermost Python frames named per sync


def where(stack: list) -> str:
    """The thread and the innermost FRAMES Python frames (outside the warnings machinery) of one sync."""
    frames = [f for f in stack if "/warnings.py" not in f.filename and not f.filename.endswith("bench/syncs.py")]
    thread = threading.current_thread().name
    if not frames:
        return f"[{thread}] (no Python frame: called from C++)"
    return f"[{thread}] " + " <- ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}"
                                        for f in reversed(frames[-FRAMES:]))


@contextlib.contextmanager
def syncs_recorded(enable, disable):
    """Inside: every warning shown is counted by where it came from (a Counter, yielded); enable() / disable() turn
    the device's sync warnings on and off around it."""
    seen: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        seen[where(traceback.extract_stack())] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        enable()
        try:
            yield seen
        finally:
            disable()


def count_syncs(w, labels: list[str], device: torch.device, repeats: int, warmup: int, budget_s: float,
                precision: str) -> list[dict]:
    """One row per method: synchronizing calls per step and where they came from."""
    torch.manual_seed(0)
    model = MODELS.build(w.model, w.info, **w.model_kwargs).to(device)
    x, y = synthetic_batch(w.info, w.batch, device)
    rows = []
    for label in labels:
        c, note = method_contender(label, model, x, y, float(w.batch), w.info.train_size, "", precision)
        row = dict(workload=w.name, model=w.model, batch=w.batch, method=label, precision=precision,
                   syncs_per_step=float("nan"), where="", note=note)
        if c is not None and device.type != "cuda":
            row["note"] = "no device to wait for on the CPU"
        elif c is not None:
            for _ in range(warmup):
                c.step()
            torch.cuda.synchronize(device)
            steps = max(1, repeats)
            with syncs_recorded(lambda: torch.cuda.set_sync_debug_mode("warn"),
                                lambda: torch.cuda.set_sync_debug_mode("default")) as seen:
                for _ in range(steps):
                    c.step()
            row["syncs_per_step"] = sum(seen.values()) / steps
            row["where"] = " | ".join(f"{n / steps:g} x {place}" for place, n in seen.most_common())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    return side_by_side_main("syncs", __doc__, argv, count_syncs, repeats=2, warmup=3)


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.syncs"))
