"""`make bench-jl`: DP-SGD-JL / DP-Adam-JL step time vs r, as ratios to non-private and to ReweightGP, side by side.

    python -m runner.bench.jl                          # all workloads, r in 1, 4, 10, 30, this machine's best device
    python -m runner.bench.jl --device cpu --repeats 5 --workloads bilstm_imdb --r 1,4
    python -m runner.bench.jl --quick                  # every code path: B/8, r in 1, 4, 2 repeats (a smoke run)

Workloads (JL paper section 3): the MNIST CNN `bu_cnn` (B=256, SGD), the Papernot CIFAR-10 CNN `papernot_cnn`
(B=256, SGD; Table 2) and the IMDB `bilstm` (B=256, Adam; Table 3), on synthetic tensors of the datasets' shapes.
Contenders: non-private, ReweightGP (exact, its default mode), and jl with jvp=forward and jvp=double_vjp (the
paper's PyTorch route) for every r. A step is Method.step (privatize + noise + optimizer step); one process, one
model copy per contender (same seed), the same warm-up, interleaved repeats, median (runner/bench/common.py).
`--chunk K` bounds the directions per vmap call (memory of the tangents ~ K forwards). Wall time (`step_ms`, the
paper's measure) and process CPU time (`cpu_ms`: robust on a shared machine; use `--threads 1` there) per step.
After the table, one line per workload and jvp mode fits CPU time = a + b r: the marginal cost of a direction.
`aten_ops` / `leaf_ops`: operators dispatched per step (runner/bench/opcount.py; leaves ~ kernel launches).
Saves outputs/bench/jl_<device>.csv (jl_<device>_quick.csv with --quick).
"""
from __future__ import annotations

import sys
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from runner.bench.common import (CIFAR10, IMDB, MNIST, arguments, bench_device, contender, interleaved_times,
                                 median, select_workloads, step_memory_bytes, synthetic_batch, timing_columns, timed_repeats)
from runner.bench import common
from runner.bench.opcount import op_counts
from runner.data.base import DataInfo
from runner.metrics import device_name, write_csv
from runner.models import MODELS

MODES = ("forward", "double_vjp")
COLUMNS = ["workload", "model", "batch", "optimizer", "method", "jvp", "r", "step_ms", "x_nonprivate", "x_reweight",
           "cpu_ms", "cpu_x_nonprivate", "cpu_x_reweight", "step_mem_mb", "aten_ops", "leaf_ops", "steps_timed", "note"]


@dataclass
class Workload(common.Workload):
    optimizer: str  # sgd | adam
    lr: float


def workloads(quick: bool = False) -> list[Workload]:
    b = 32 if quick else 256
    return [Workload("cnn_mnist", "bu_cnn", MNIST, b, "sgd", 0.25),
            Workload("papernot_cifar10", "papernot_cnn", CIFAR10, b, "sgd", 0.1),
            Workload("bilstm_imdb", "bilstm", IMDB, b, "adam", 0.001)]


def gpu_workloads(quick: bool = False) -> list[Workload]:
    """Issue 12's GPU table (make bench-gpu): the three above plus the transformer on IMDB, VGG-11 and ResNet-18 on
    CIFAR-10 (B=128) and ResNet-101 at 256 px (B=32)."""
    scale = (lambda b: max(2, b // 8)) if quick else (lambda b: b)
    big = DataInfo("imagenet256", (3, 256, 256), 1000, "image", None, 1281167, 50000)
    return [Workload("cnn_mnist", "bu_cnn", MNIST, scale(256), "sgd", 0.25),
            Workload("papernot_cifar10", "papernot_cnn", CIFAR10, scale(256), "sgd", 0.1),
            Workload("transformer_imdb", "transformer", IMDB, scale(256), "adam", 0.001),
            Workload("bilstm_imdb", "bilstm", IMDB, scale(256), "adam", 0.001),
            Workload("vgg11_cifar10", "vgg11", CIFAR10, scale(128), "sgd", 0.1),
            Workload("resnet18_cifar10", "resnet18", CIFAR10, scale(128), "sgd", 0.1),
            Workload("resnet101_256px", "resnet101", big, scale(32), "sgd", 0.1)]


def variants(rs: list[int], chunk: int) -> dict[str, tuple[str, dict, int, str]]:
    """label -> (method, options, r, jvp)."""
    out = {"nonprivate": ("nonprivate", {}, 1, ""), "reweight": ("reweight", {}, 1, "")}
    for mode in MODES:
        out.update({f"jl{r}-{mode}": ("jl", {"jvp": mode, "chunk": chunk}, r, mode) for r in rs})
    return out


def jl_contender(method_name: str, options: dict, r: int, base, w: Workload, x, y):
    """(step, zero_grad) on the method's own model copy (runner/bench/common.py), or None and the reason."""
    opt_cls = torch.optim.Adam if w.optimizer == "adam" else torch.optim.SGD
    return contender(method_name, {**options, "r": r}, base, x, y, lambda ps: opt_cls(ps, lr=w.lr, foreach=True),
                     w.batch / w.info.train_size, float(w.batch))


def bench_workload(w: Workload, rs: list[int], chunk: int, device, repeats: int, warmup: int, budget_s: float,
                   memory: bool) -> list[dict]:
    labels = variants(rs, chunk)
    rows = [dict(workload=w.name, model=w.model, batch=w.batch, optimizer=w.optimizer, method=m if m != "jl"
                 else f"jl({r})", jvp=mode, r=r if m == "jl" else None, label=label)
            for label, (m, _, r, mode) in labels.items()]
    torch.manual_seed(0)
    base = MODELS.build(w.model, w.info).to(device)
    x, y = synthetic_batch(w.info, w.batch, device)
    contenders, notes = {}, {}
    for label, (m, options, r, _) in labels.items():
        contenders[label], notes[label] = jl_contender(m, options, r, base, w, x, y)
        if notes[label]:
            print(f"[bench-jl] {w.name} {label}: {notes[label]}")
    live = {k: c for k, c in contenders.items() if c is not None}
    cpu: dict[str, list[float]] = {k: [] for k in live}  # process CPU seconds of every step, warm-up included

    def with_cpu(label, step):
        def run():
            start = time.process_time()
            step()
            cpu[label].append(time.process_time() - start)
        return run

    times = interleaved_times({k: with_cpu(k, c[0]) for k, c in live.items()}, device, repeats, warmup, budget_s)
    t = {k: median(ts) for k, ts in times.items()}
    ct = {k: median(cpu[k][-len(ts):]) for k, ts in times.items()}  # the timed steps' CPU seconds
    mem = {k: step_memory_bytes(c[0], device, before=c[1]) for k, c in live.items()} if memory else {}
    ops = {k: op_counts(c[0], before=c[1]) for k, c in live.items()}
    for row in rows:
        label = row.pop("label")
        if label not in live:
            row.update(note=notes[label])
            continue
        row.update(**timing_columns(label, times, repeats),
                   x_reweight=t[label] / t["reweight"] if "reweight" in t else math.nan,
                   cpu_ms=1e3 * ct[label],
                   cpu_x_nonprivate=ct[label] / ct["nonprivate"] if "nonprivate" in ct else math.nan,
                   cpu_x_reweight=ct[label] / ct["reweight"] if "reweight" in ct else math.nan,
                   step_mem_mb=mem[label] / 2**20 if label in mem else math.nan, **ops[label])
    return rows


def linear_fits(df: pd.DataFrame) -> list[str]:
    """Per workload and jvp mode: step CPU time = a + b r (least squares); a, b in non-private steps, and R^2."""
    lines = []
    jl = df[df["r"].notna() & df["cpu_x_nonprivate"].notna()]
    for (wl, mode), g in jl.groupby(["workload", "jvp"], sort=False):
        if len(g) < 2:
            continue
        r, ratio = g["r"].to_numpy(float), g["cpu_x_nonprivate"].to_numpy(float)
        b, a = np.polyfit(r, ratio, 1)
        fit = a + b * r
        r2 = 1 - ((ratio - fit) ** 2).sum() / max(((ratio - ratio.mean()) ** 2).sum(), 1e-12)
        lines.append(f"[bench-jl] {wl} jvp={mode}: step CPU time ~ {a:.2f} + {b:.2f} r non-private steps "
                     f"(R^2 {r2:.3f})")
    return lines


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = arguments("python -m runner.bench.jl", __doc__, repeats=5, warmup=1, budget=30.0,
                   quick="B=32, r in 1,4, 2 repeats: a smoke run of every code path",
                   workloads=[w.name for w in workloads()], out="jl_<device>.csv")
    ap.add_argument("--r", default="1,4,10,30", help="comma-separated JL dimensions")
    ap.add_argument("--chunk", type=int, default=10, help="directions per vmap call (method.chunk; 0 = all r)")
    ap.add_argument("--memory", action="store_true", help="also measure each contender's peak step memory")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default); 1 on a "
                    "shared CPU, where idle spinning threads make wall times of multi-threaded steps meaningless")
    ap.add_argument("--suite", default="default", choices=["default", "gpu"],
                    help="default: the three CPU workloads; gpu: issue 12's GPU table (make bench-gpu)")
    args = ap.parse_args(argv)
    device = bench_device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    repeats = timed_repeats(args)
    rs = [1, 4] if args.quick else [int(v) for v in args.r.split(",")]
    suite = gpu_workloads(args.quick) if args.suite == "gpu" else workloads(args.quick)
    chosen = select_workloads(suite, args.workloads, "bench-jl")
    print(f"[bench-jl] {device_name(device)}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{repeats} repeats, median step time; r = {rs}, chunk = {args.chunk}")
    path = Path(args.out) / f"jl_{device.type}{'_quick' if args.quick else ''}.csv"
    rows: list[dict] = []
    for w in chosen:  # the CSV is rewritten after every workload, so a long run keeps what it has measured
        print(f"[bench-jl] {w.name}: model={w.model} B={w.batch} optimizer={w.optimizer} ...", flush=True)
        rows += bench_workload(w, rs, args.chunk, device, repeats, args.warmup, args.budget, args.memory)
        df = table(rows)
        write_csv(path, df.astype(object).where(df.notna(), "").to_dict("records"))  # blanks, not NaN
    with pd.option_context("display.max_rows", None, "display.width", 250, "display.max_colwidth", 70,
                           "display.float_format", "{:.2f}".format):
        print(df.to_string(index=False))
    print("\n".join(linear_fits(df)))
    print(f"[bench-jl] saved {path}")
    return df


def table(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    df["r"] = df["r"].astype("Int64")
    return df


if __name__ == "__main__":
    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.jl"))
