"""Where a bench step's time goes: the operators of a few steps under torch.profiler, by self time per step (CPU) or
by the device time of the kernels each launched (CUDA).

    python -m runner.bench.profile --device cuda --suite gpu --workloads gpt2small_t512 --methods nonprivate,reweight-bk
    python -m runner.bench.profile --workloads transformer_imdb --methods reweight-bk --top 30 --precision bf16
    python -m runner.bench.profile --device cuda --suite gpu --workloads papernot_cifar10 --host   # the host's share
    python -m runner.bench.profile --device cuda --suite gpu --precision bf16 --compile reduce-overhead --by kernel \
        --workloads gpt2small_t128 --methods nonprivate+compile,reweight-bk+compile --warmup 4       # a replayed graph

Each contender is built as bench-clip builds it (runner/bench/clip.py method_contender), warmed up, then profiled over
--steps steps. Output: a table per contender (name, calls per step, self ms per step, share of the step's self time)
and profile_<device>.csv with every row.
"""
from __future__ import annotations

import math

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from runner.bench.clip import contender_arguments, suite_workloads, warmed_contenders
from runner.bench.common import bench_device, quiet_stderr, save_frames, select_workloads, timed_repeats
from runner.bench.device_time import device_events
from runner.errors import DprunError
from runner.metrics import synchronize


def profiled(step, device: torch.device, steps: int, host: bool = False, by: str = "op") -> pd.DataFrame:
    """Self time per step of each operator (CPU: its own time; CUDA: its kernels' device time, or with `host` the
    host's own time in it: Python hooks inside the backward show as autograd's evaluate_function rows) over `steps`
    steps, largest first. by="kernel" (CUDA): each kernel, copy or memset by its own name, wherever it was launched
    from (a compiled step's CUDA-graph replay launches its kernels from no aten operator)."""
    on_device = device.type == "cuda" and not host
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with quiet_stderr(), profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    if by == "kernel":
        rows = [dict(name=name, calls_per_step=count / steps, self_ms_per_step=us / 1e3 / steps)
                for name, (count, us) in device_events(prof.events()).items()]
        return by_time(rows)
    rows = []
    for e in prof.key_averages():
        self_us = e.self_device_time_total if on_device else e.self_cpu_time_total
        # CUDA: each aten op with the device time of the kernels it launched (the kernels' own rows, which would
        # count the same time twice under their long template names, are left out)
        if self_us > 0 and (not on_device or e.key.startswith("aten::")):
            rows.append(dict(name=e.key, calls_per_step=e.count / steps, self_ms_per_step=self_us / 1e3 / steps))
    return by_time(rows)


def by_time(rows: list[dict]) -> pd.DataFrame:
    """The rows (name, calls_per_step, self_ms_per_step) largest first, with each one's share of their total."""
    out = pd.DataFrame(rows, columns=["name", "calls_per_step", "self_ms_per_step"])
    out = out.sort_values("self_ms_per_step", ascending=False, ignore_index=True)
    out["share"] = out.self_ms_per_step / out.self_ms_per_step.sum() if len(out) else math.nan
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = contender_arguments("python -m runner.bench.profile", __doc__, repeats=3, warmup=3,
                             out="profile_<device>.csv", top=20, rows="operators")
    ap.add_argument("--host", action="store_true", help="CUDA: the host's self time per operator instead of its "
                    "kernels' device time (where a step bound by its host spends it)")
    ap.add_argument("--by", default="op", choices=["op", "kernel"], help="CUDA: rows per aten operator (op) or per "
                    "kernel name (kernel: also the kernels of a compiled step's CUDA-graph replay)")
    ap.add_argument("--compile", default="", help="rows <row>+compile step under compile=MODE (default | "
                    "reduce-overhead | cudagraphs; runner/methods/compiled.py); --warmup must cover the compiling steps")
    args = ap.parse_args(argv)
    device = bench_device(args.device)
    if args.by == "kernel" and (device.type != "cuda" or args.host):
        raise DprunError(f"bench-profile --by kernel needs the device's own timeline: a CUDA device without --host "
                         f"(here {device.type}{' with --host' if args.host else ''}); use --by op")
    chosen = select_workloads(suite_workloads(args.suite, args.quick), args.workloads, "bench-profile")
    frames = []
    what = ("self time of the operators" if device.type != "cuda" or args.host
            else f"device time of the kernels, by {'kernel' if args.by == 'kernel' else 'operator'}")
    for w, label, c in warmed_contenders(chosen, args.methods.split(","), device, args.precision, args.warmup,
                                         "profile", args.compile):
        table = profiled(c.step, device, max(1, timed_repeats(args)), args.host, args.by)
        total = table.self_ms_per_step.sum()
        print(f"\n[profile] {w.name} B={w.batch} {label} {args.precision}: {total:.2f} ms {what} per step, "
              f"{table.calls_per_step.sum():.0f} {'kernels' if args.by == 'kernel' else 'operator calls'}")
        print(table.head(args.top).to_string(index=False, float_format=lambda v: f"{v:.3f}",
                                             formatters={"name": lambda s: s[:90]}))
        frames.append(table.assign(workload=w.name, method=label, precision=args.precision))
    return save_frames(frames, args.out, "profile", device, args.quick, "profile")


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.profile"))
