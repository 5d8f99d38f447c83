"""Where a bench step's time goes: the operators of a few steps under torch.profiler, by self time per step (CPU) or
by the device time of the kernels each launched (CUDA).

    python -m runner.bench.profile --device cuda --suite gpu --workloads gpt2small_t512 --methods nonprivate,reweight-bk
    python -m runner.bench.profile --workloads transformer_imdb --methods reweight-bk --top 30 --precision bf16

Each contender is built as bench-clip builds it (runner/bench/clip.py method_contender), warmed up, then profiled over
--steps steps. Output: a table per contender (name, calls per step, self ms per step, share of the step's self time)
and profile_<device>.csv with every row.
"""
from __future__ import annotations

import math
import os

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from runner.bench.clip import ALL, add_suite_argument, method_contender, suite_workloads, workload_names
from runner.bench.common import arguments, bench_device, quiet_stderr, synthetic_batch, timed_repeats
from runner.errors import DprunError
from runner.metrics import synchronize
from runner.models import MODELS


def profiled(step, device: torch.device, steps: int) -> pd.DataFrame:
    """Self time per step of each operator (CPU: its own time; CUDA: its kernels' device time) over `steps` steps,
    largest first."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with quiet_stderr(), profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    rows = []
    for e in prof.key_averages():
        self_us = e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total
        # CUDA: each aten op with the device time of the kernels it launched (the kernels' own rows, which would
        # count the same time twice under their long template names, are left out)
        if self_us > 0 and (device.type != "cuda" or e.key.startswith("aten::")):
            rows.append(dict(name=e.key, calls_per_step=e.count / steps, self_ms_per_step=self_us / 1e3 / steps))
    out = pd.DataFrame(rows, columns=["name", "calls_per_step", "self_ms_per_step"])
    out = out.sort_values("self_ms_per_step", ascending=False, ignore_index=True)
    out["share"] = out.self_ms_per_step / out.self_ms_per_step.sum() if len(out) else math.nan
    return out


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = arguments("python -m runner.bench.profile", __doc__, repeats=3, warmup=3, budget=math.inf,
                   quick="batches / 8: a smoke run", workloads=workload_names(), out="profile_<device>.csv")
    add_suite_argument(ap)
    ap.add_argument("--methods", default="nonprivate,reweight-bk", help="comma-separated rows of bench-clip: "
                    + ", ".join(ALL))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "tf32"])
    ap.add_argument("--top", type=int, default=20, help="rows printed per contender")
    args = ap.parse_args(argv)
    device = bench_device(args.device)
    chosen = [w for w in suite_workloads(args.suite, args.quick)
              if not args.workloads or w.name in args.workloads.split(",")]
    if not chosen:
        raise DprunError(f"--workloads {args.workloads!r} names no workload of --suite {args.suite}; "
                         f"choose from {', '.join(workload_names())}")
    frames = []
    for w in chosen:
        torch.manual_seed(0)
        base = MODELS.build(w.model, w.info, **w.model_kwargs).to(device)
        x, y = synthetic_batch(w.info, w.batch, device)
        for label in args.methods.split(","):
            if label not in ALL:
                raise DprunError(f"--methods: unknown row {label!r}; choose from {', '.join(ALL)}")
            c, note = method_contender(label, base, x, y, float(w.batch), w.info.train_size, "", args.precision)
            if c is None:
                print(f"[profile] {w.name} {label}: {note}")
                continue
            for _ in range(max(1, args.warmup)):
                c.step()
            table = profiled(c.step, device, max(1, timed_repeats(args)))
            total = table.self_ms_per_step.sum()
            print(f"\n[profile] {w.name} B={w.batch} {label} {args.precision}: {total:.2f} ms "
                  f"{'device time of the kernels' if device.type == 'cuda' else 'self time of the operators'} per "
                  f"step, {table.calls_per_step.sum():.0f} operator calls")
            print(table.head(args.top).to_string(index=False, float_format=lambda v: f"{v:.3f}",
                                                 formatters={"name": lambda s: s[:90]}))
            frames.append(table.assign(workload=w.name, method=label, precision=args.precision))
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile_{device.type}{'_quick' if args.quick else ''}.csv")
    out.to_csv(path, index=False)
    print(f"[profile] saved {path}")
    return out


if __name__ == "__main__":
    import sys

    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.profile"))
