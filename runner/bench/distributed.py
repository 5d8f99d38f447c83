"""`make bench-dist`: data-parallel steps per second and bytes all-reduced per step, 1 vs N processes.

    python -m runner.bench.distributed                         # 1 and 2 processes on the CPU (gloo)
    python -m runner.bench.distributed --device cuda --nproc 1,8   # one GPU per process (nccl); make bench-gpu

For each process count n the bench starts `torchrun --nproc_per_node=n` on itself (--worker); every rank builds the
same model and global batch, trains on its share (runner/distributed.py: the one-process step, the clipped sums
all-reduced in flat buckets, one noise draw), and rank 0 reports: median step time over --steps synchronised steps
(after --warmup), steps per second, the speed-up over one process, and the bytes all-reduced per step (the model's
gradient once, in float32, plus the 8-byte example count). Synthetic inputs of the workload's shape; the global
batch is fixed at --batch (no Poisson variation: the timing is of the step, not of the sampler).
Saves outputs/bench/distributed_<device>.csv.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from runner.entry import OneLineParser
from runner.errors import DprunError

WORKLOADS = {"cnn_mnist": ("bu_cnn", "mnist"), "transformer_imdb": ("transformer", "imdb")}


def worker(args) -> None:
    """One rank: the same steps as a dprun run's (Method.step on this rank's share), timed on rank 0."""
    import torch

    from runner import distributed, memory_format
    from runner.bench.common import loss_fn, synthetic_batch
    from runner.data.synthetic import like_info
    from runner.methods import METHODS
    from runner.metrics import device_name, synchronize
    from runner.models import MODELS

    world = distributed.init(args.device, 300.0, seed=0)
    device = torch.device(f"cuda:{world.local_rank}" if args.device.startswith("cuda") else "cpu")
    model_name, like = WORKLOADS[args.workload]
    info = like_info(like)
    torch.manual_seed(0)
    model = MODELS.build(model_name, info, **({"dropout": 0.0} if model_name == "transformer" else {})).to(device)
    name, _, mode = args.method.partition("-")
    method = METHODS.build(name, cfg={"mode": mode} if mode else {}, clip=1.0, sigma=1.0).configure(
        physical_batch_size=args.physical, world=world)
    memory_format.apply(model, "auto", method)  # as assemble() does for a run (bu_cnn: channels-last on the CPU)
    model = method.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = synthetic_batch(info, args.batch, device)
    idx = world.share(torch.arange(args.batch, device=device))
    xs, ys = x[idx], y[idx]
    times = []
    for i in range(args.warmup + args.steps):
        world.barrier()
        synchronize(device)
        start = time.perf_counter()
        method.step(model, loss_fn, xs, ys, opt, sample_rate=args.batch / info.train_size,
                    expected_batch_size=float(args.batch))
        synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    (slowest,) = world.max([statistics.median(times)], device)  # the step is as slow as the slowest rank
    reduced = world.bytes_reduced / (args.warmup + args.steps)
    if world.main:
        Path(args.out).write_text(json.dumps({
            "workload": args.workload, "model": model_name, "method": args.method, "processes": world.size,
            "backend": world.backend or "-", "batch": args.batch, "per_rank": args.batch // world.size,
            "step_ms": 1e3 * slowest, "steps_per_s": 1.0 / slowest, "bytes_allreduced_per_step": int(reduced),
            "device": device_name(device)}))
    distributed.shutdown(world, wait=True)


def run_one(args, n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}", "--nnodes=1",
               "-m", "runner.bench.distributed", "--worker", "--out", str(out), "--device", args.device,
               "--workload", args.workload, "--method", args.method, "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        if args.physical:
            cmd += ["--physical", str(args.physical)]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n))}  # the cores, shared
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            return {"workload": args.workload, "method": args.method, "processes": n, "note": f"error: {tail}"}
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = OneLineParser(prog="python -m runner.bench.distributed", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu (gloo) | cuda (nccl, one GPU per process)")
    ap.add_argument("--nproc", default="1,2", help="comma-separated process counts")
    ap.add_argument("--workload", default="cnn_mnist", choices=list(WORKLOADS))
    ap.add_argument("--method", default="reweight-bk", help="method[-mode], e.g. nonprivate, reweight-bk, jl")
    ap.add_argument("--batch", type=int, default=256, help="global batch per step")
    ap.add_argument("--physical", type=int, default=None, help="physical_batch_size per rank (default: one pass)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="outputs/bench")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return pd.DataFrame()
    counts = [v for v in args.nproc.split(",") if v.isdigit() and int(v) >= 1]
    if not counts or len(counts) != len(args.nproc.split(",")):
        raise DprunError(f"--nproc={args.nproc} must be comma-separated process counts >= 1, e.g. 1,2")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise DprunError(f"--device={args.device} is not valid; valid: cpu (gloo), cuda (nccl)")
    rows = []
    for n in [int(v) for v in counts]:
        print(f"bench.distributed: {args.workload} {args.method} B={args.batch} on {n} process(es) ({args.device})",
              flush=True)
        rows.append(run_one(args, n))
    table = pd.DataFrame(rows)
    if "steps_per_s" in table and (table["processes"] == 1).any():
        table["speedup"] = table["steps_per_s"] / float(table.loc[table["processes"] == 1, "steps_per_s"].iloc[0])
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    out = Path(args.out) / f"distributed_{args.device.split(':')[0]}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    print(f"bench.distributed: wrote {out}")
    return table


if __name__ == "__main__":
    from runner.entry import run_entry

    sys.exit(run_entry(main, "python -m runner.bench.distributed"))
