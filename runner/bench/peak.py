"""What a bench step holds at its memory peak: each tensor alive then, with the operator and the line that made it.

    python -m runner.bench.peak --workloads transformer_imdb --methods nonprivate,reweight-bk,opacus-ghost
    python -m runner.bench.peak --suite gpu --workloads gpt2small_t128 --methods reweight-bk --top 30

bench-clip's `step_mem_mb` says how high a step's memory goes; this says what is there at that moment (issue 31:
book-keeping's transformer step peaks in the attention's softmax backward, holding the feed-forward layers'
per-example gradients beside the attention's saved tensors). One step of each contender (built as bench-clip builds
it) runs under a TorchDispatchMode that notes every tensor an operator returns in new storage: its bytes, the
operator, the shape and the innermost frame outside torch (`file:line`); a weakref finalizer on each tensor frees the
storage's bytes when its last tensor dies (autograd's saved tensors keep theirs alive: torch preserves a tensor's
Python object while C++ holds it). The peak is the largest sum of live bytes above the step's start: on the CPU the
same quantity as bench-clip's profiler measure (but for the few bytes of tensors made from Python values, outside
the operators), and the run prints both. Storage that existed before the step (the
weights, the batch, the optimizer state) and views of it are not counted, as there.

Output: per contender the peak, the operator running when it was reached, and the `--top` largest tensors alive
then; outputs/bench/peak_<device>.csv holds every row.
"""
from __future__ import annotations

import os
import traceback
import weakref
from collections.abc import Callable

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from runner.bench.clip import contender_arguments, suite_workloads, warmed_contenders
from runner.bench.common import bench_device, save_frames, select_workloads, step_memory_bytes

TORCH_DIR = os.path.dirname(torch.__file__)


def caller() -> str:
    """file:line of the innermost frame outside torch and this module: the line that asked for the operator."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(TORCH_DIR) and frame.filename != __file__:
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"


class _Live(TorchDispatchMode):
    """Bytes of the storages the operators create, alive now; the largest total seen and what was alive then."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list] = {}  # storage data_ptr -> [bytes, operator, shape, site, tensors alive]
        self.now = self.peak = 0
        self.at = ""
        self.held: list[tuple] = []

    def _freed(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is not None:
            entry[4] -= 1
            if entry[4] == 0:
                self.now -= entry[0]
                del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        site = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if ptr == 0 or size == 0:
                continue
            if ptr in self.live:
                self.live[ptr][4] += 1  # another tensor on a storage made in this step (a view returned again)
            elif ptr in inputs:
                continue  # a view or an in-place result of an input: no new memory
            else:
                site = site or caller()
                self.live[ptr] = [size, func.__name__.split(".")[0], tuple(t.shape), site, 1]
                self.now += size
            weakref.finalize(t, self._freed, ptr)
        if self.now > self.peak:
            self.peak, self.at = self.now, f"{func.__name__.split('.')[0]} ({site or caller()})"
            self.held = [tuple(entry[:4]) for entry in self.live.values()]
        return out


def peak_tensors(step: Callable[[], object], before: Callable[[], object] | None = None) -> tuple[int, str, pd.DataFrame]:
    """(peak bytes above the step's start, the operator at the peak and its line, the tensors alive then: one row each,
    largest first: mb, operator, shape, site)."""
    if before is not None:
        before()
    with _Live() as live:
        step()
    rows = pd.DataFrame(live.held, columns=["bytes", "operator", "shape", "site"])
    rows = rows.sort_values("bytes", ascending=False, ignore_index=True)
    rows.insert(0, "mb", rows.pop("bytes") / 2**20)
    return live.peak, live.at, rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = contender_arguments("python -m runner.bench.peak", __doc__, repeats=1, warmup=2, out="peak_<device>.csv",
                               top=15, rows="tensors").parse_args(argv)
    device = bench_device(args.device)
    chosen = select_workloads(suite_workloads(args.suite, args.quick), args.workloads, "bench-peak")
    frames = []
    for w, label, c in warmed_contenders(chosen, args.methods.split(","), device, args.precision, args.warmup, "peak"):
        peak, at, rows = peak_tensors(c.step, before=c.zero_grad)
        measured = step_memory_bytes(c.step, device, before=c.zero_grad)
        print(f"\n[peak] {w.name} B={w.batch} {label} {args.precision}: {peak / 2**20:.2f} MB at {at}; "
              f"{len(rows)} tensors alive (bench-clip's measure: {measured / 2**20:.2f} MB)")
        print(rows.head(args.top).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
        frames.append(rows.assign(workload=w.name, method=label, precision=args.precision, peak_mb=peak / 2**20, at=at))
    return save_frames(frames, args.out, "peak", device, args.quick, "peak")


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.peak"))
